"""Read one stored item: its raw byte range, decoded through its transforms, piece by piece.

Every decode of an item goes through `decode_stored_pieces`, which stops a tensor item under a
codec once it decodes past what its chunk can hold (a few stored bytes can decode to
terabytes) and names the file, item and byte range in whatever error it meets.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator

from dcpctl.errors import (DataError, DcpctlError, UnsupportedLayoutError, missing_file_error,
                           truncated_error)
from dcpctl.format.checkpoint.view import SAFETENSORS, Checkpoint, ObjectEntry, TensorEntry
from dcpctl.format.codecs.base import iter_decoded
from dcpctl.format.codecs.registry import IDENTITY, Codec, codec_for_descriptors
from dcpctl.format.metadata.records import ChunkMetadata, StorageInfo
from dcpctl.format.safetensors import safetensors_tensor_range
from dcpctl.format.torch_save.layout import max_tensor_archive_bytes
from dcpctl.storage.local import open_for_reading

DEFAULT_PIECE_BYTES = 4 << 20
MAX_ITEM_IN_MEMORY_BYTES = 256 << 20


@dataclass(frozen=True)
class ItemLocation:
    """Where an item's stored bytes are, how to decode them, and the most bytes they may
    decode to (None: no bound known, as for objects)."""

    fqn: str
    path: Path
    start: int
    length: int
    codec: Codec
    max_decoded_bytes: int | None = None

    @property
    def end(self) -> int:
        """Offset one past the item's last stored byte in its file."""
        return self.start + self.length


def locate_item(checkpoint: Checkpoint, fqn: str, storage: StorageInfo,
                chunk_nbytes: int | None = None) -> ItemLocation:
    """The byte range and codec of one item: a tensor chunk of chunk_nbytes bytes of elements,
    or (None) an object. In SAFETENSORS-serialized files, tensor items live inside one
    safetensors blob per file and are found through its header."""
    path = checkpoint.data_path(storage.relative_path)
    is_tensor = chunk_nbytes is not None
    if checkpoint.files[storage.relative_path].serialization == SAFETENSORS and is_tensor:
        if storage.transform_descriptors:
            raise UnsupportedLayoutError(
                f"combines SAFETENSORS serialization with transforms "
                f"{list(storage.transform_descriptors)}, which torch cannot read back either",
                path=path, fqn=fqn)
        start, length = safetensors_tensor_range(path, storage.offset, fqn)
        return ItemLocation(fqn, path, start, length, IDENTITY)
    try:
        codec = codec_for_descriptors(storage.transform_descriptors)
    except DcpctlError as error:
        raise error.located(path=path, fqn=fqn) from None
    bound = max_tensor_archive_bytes(chunk_nbytes) if is_tensor and codec.descriptors else None
    return ItemLocation(fqn, path, storage.offset, storage.length, codec, bound)


def locate_chunk(checkpoint: Checkpoint, tensor: TensorEntry, chunk: ChunkMetadata) -> ItemLocation:
    """Where a tensor chunk is stored; raises DataError if the metadata gives it no storage."""
    if chunk.storage is None:
        raise DataError(f"chunk at {list(chunk.offsets)} has no storage entry in the metadata",
                        path=checkpoint.path, fqn=tensor.fqn)
    return locate_item(checkpoint, tensor.fqn, chunk.storage,
                       math.prod(chunk.sizes) * tensor.dtype.itemsize)


def locate_object(checkpoint: Checkpoint, entry: ObjectEntry) -> ItemLocation:
    """Where a non-tensor entry is stored; raises DataError if the metadata gives it none."""
    if entry.storage is None:
        raise DataError("object has no storage entry in the metadata", path=checkpoint.path,
                        fqn=entry.fqn)
    return locate_item(checkpoint, entry.fqn, entry.storage)


class StoredSpan:
    """The stored bytes of neighbouring items of one file, read with one read: small items
    cost a system call and a Python round trip each otherwise."""

    def __init__(self, path: Path, start: int, end: int, first_fqn: str) -> None:
        self.path = path
        self.start = start
        try:
            with open_for_reading(path) as stream:
                self._data = memoryview(os.pread(stream.fileno(), end - start, start))
        except FileNotFoundError:
            raise missing_file_error(path, first_fqn) from None

    def stored_bytes(self, location: ItemLocation) -> memoryview:
        """The item's stored bytes, which must lie in the span."""
        offset = location.start - self.start
        if offset < 0 or location.path != self.path:
            raise ValueError(f"item {location.fqn!r} is not in this span")
        stored = self._data[offset:offset + location.length]
        if len(stored) < location.length:
            raise truncated_error(location.path, location.fqn, location.start, location.end,
                                  location.start + len(stored))
        return stored


def iter_stored_pieces(location: ItemLocation, piece_bytes: int = DEFAULT_PIECE_BYTES,
                       span: StoredSpan | None = None) -> Iterator[bytes]:
    """The item's stored (still encoded) bytes, in pieces of at most piece_bytes; from the span
    when it holds them, in one piece."""
    if span is not None:
        yield span.stored_bytes(location)
        return
    try:
        with open_for_reading(location.path) as stream:
            position = location.start
            while position < location.end:
                piece = os.pread(stream.fileno(), min(piece_bytes, location.end - position),
                                 position)
                if not piece:
                    raise truncated_error(location.path, location.fqn, location.start,
                                          location.end, position)
                position += len(piece)
                yield piece
    except FileNotFoundError:
        raise missing_file_error(location.path, location.fqn) from None


def decode_stored_pieces(location: ItemLocation, stored_pieces: Iterable[bytes]
                         ) -> Iterator[bytes]:
    """The item's decoded bytes from its stored bytes, however they were read; raises a
    DcpctlError naming the item if they do not decode or pass what the item can hold."""
    try:
        yield from iter_decoded(location.codec.new_decoder(), stored_pieces,
                                location.max_decoded_bytes)
    except DcpctlError as error:
        raise error.located(path=location.path, fqn=location.fqn, start=location.start,
                            end=location.end) from None


def iter_item_pieces(location: ItemLocation, piece_bytes: int = DEFAULT_PIECE_BYTES,
                     span: StoredSpan | None = None) -> Iterator[bytes]:
    """The item's decoded bytes, in pieces (see decode_stored_pieces)."""
    return decode_stored_pieces(location, iter_stored_pieces(location, piece_bytes, span))


def read_item(location: ItemLocation) -> bytes:
    """The whole decoded item, for small items such as pickled objects: one that decodes past
    MAX_ITEM_IN_MEMORY_BYTES is refused (a few KiB of zstd can decode to gigabytes)."""
    pieces, held = [], 0
    for piece in iter_item_pieces(location):
        held += len(piece)
        if held > MAX_ITEM_IN_MEMORY_BYTES:
            raise DataError(f"decodes to more than {MAX_ITEM_IN_MEMORY_BYTES} bytes, more than "
                            "dcpctl holds in memory for one item", path=location.path,
                            fqn=location.fqn, start=location.start, end=location.end)
        pieces.append(piece)
    return b"".join(pieces)

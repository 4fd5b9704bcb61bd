"""Read one stored item: its raw byte range, decoded through its transforms, piece by piece."""

from __future__ import annotations

import functools
import io
import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from dcpctl.errors import DataError, UnsupportedLayoutError
from dcpctl.format.checkpoint.view import SAFETENSORS, Checkpoint
from dcpctl.format.codecs.registry import IDENTITY, Codec, codec_for_descriptors, iter_decoded
from dcpctl.format.metadata.records import StorageInfo

DEFAULT_PIECE_BYTES = 4 << 20
_MAX_SAFETENSORS_HEADER_BYTES = 100 << 20


@dataclass(frozen=True)
class ItemLocation:
    """Where an item's stored bytes are and how to decode them."""

    fqn: str
    path: Path
    start: int
    length: int
    codec: Codec


def locate_item(checkpoint: Checkpoint, fqn: str, storage: StorageInfo,
                is_tensor: bool) -> ItemLocation:
    """The byte range and codec of one item. In SAFETENSORS-serialized files, tensor items
    live inside one safetensors blob per file and are found through its header."""
    path = checkpoint.data_path(storage.relative_path)
    data_file = checkpoint.files[storage.relative_path]
    if data_file.serialization == SAFETENSORS and is_tensor:
        if storage.transform_descriptors:
            raise UnsupportedLayoutError(
                f"{path}: item {fqn!r} combines SAFETENSORS serialization with transforms "
                f"{list(storage.transform_descriptors)}, which torch cannot read back either")
        start, length = _safetensors_tensor_range(path, storage.offset, fqn)
        return ItemLocation(fqn, path, start, length, IDENTITY)
    try:
        codec = codec_for_descriptors(storage.transform_descriptors)
    except UnsupportedLayoutError as error:
        raise UnsupportedLayoutError(f"{path}: item {fqn!r}: {error}") from None
    return ItemLocation(fqn, path, storage.offset, storage.length, codec)


class StoredSpan:
    """The stored bytes of neighbouring items of one file, read with one read: small items
    cost a system call and a Python round trip each otherwise."""

    def __init__(self, path: Path, start: int, end: int, first_fqn: str) -> None:
        self.path = path
        self.start = start
        try:
            with open(path, "rb", buffering=0) as stream:
                self._data = memoryview(os.pread(stream.fileno(), end - start, start))
        except FileNotFoundError:
            raise _missing(path, first_fqn) from None

    def stored_bytes(self, location: ItemLocation) -> memoryview:
        """The item's stored bytes, which must lie in the span."""
        offset = location.start - self.start
        if offset < 0 or location.path != self.path:
            raise ValueError(f"item {location.fqn!r} is not in this span")
        stored = self._data[offset:offset + location.length]
        if len(stored) < location.length:
            raise _truncated(location, location.length - len(stored))
        return stored


def iter_stored_pieces(location: ItemLocation, piece_bytes: int = DEFAULT_PIECE_BYTES,
                       span: StoredSpan | None = None) -> Iterator[bytes]:
    """The item's stored (still encoded) bytes, in pieces of at most piece_bytes; from the span
    when it holds them, in one piece."""
    if span is not None:
        yield span.stored_bytes(location)
        return
    try:
        with open(location.path, "rb", buffering=0) as stream:
            stream.seek(location.start)
            remaining = location.length
            while remaining:
                piece = stream.read(min(piece_bytes, remaining))
                if not piece:
                    raise _truncated(location, remaining)
                remaining -= len(piece)
                yield piece
    except FileNotFoundError:
        raise _missing(location.path, location.fqn) from None


def _missing(path: Path, fqn: str) -> DataError:
    return DataError(f"{path}: missing data file (item {fqn!r})")


def _truncated(location: ItemLocation, missing_bytes: int) -> DataError:
    end = location.start + location.length
    return DataError(f"{location.path}: truncated: item {location.fqn!r} needs bytes "
                     f"{location.start}..{end}, the file ends at {end - missing_bytes}")


def iter_item_pieces(location: ItemLocation, piece_bytes: int = DEFAULT_PIECE_BYTES,
                     span: StoredSpan | None = None,
                     max_bytes: int | None = None) -> Iterator[bytes]:
    """The item's decoded bytes, in pieces; raises DataError naming the item if they do not
    decode, or if they pass max_bytes (a few stored bytes can decode to terabytes)."""
    try:
        decoded = 0
        for piece in iter_decoded(location.codec.new_decoder(),
                                  iter_stored_pieces(location, piece_bytes, span)):
            decoded += len(piece)
            if max_bytes is not None and decoded > max_bytes:
                raise DataError(f"decodes to more than {max_bytes} bytes, more than the item "
                                "can hold")
            yield piece
    except DataError as error:
        if str(location.path) in str(error):
            raise
        raise DataError(f"{location.path}: item {location.fqn!r} at bytes "
                        f"{location.start}..{location.start + location.length}: {error}") from None


def read_item(location: ItemLocation, max_bytes: int | None = None) -> bytes:
    """The whole decoded item, refused past max_bytes; for small items such as pickled
    objects."""
    return b"".join(iter_item_pieces(location, max_bytes=max_bytes))


class PieceStream(io.RawIOBase):
    """A readable file object over an iterator of byte pieces."""

    def __init__(self, pieces: Iterator[bytes]) -> None:
        self._pieces = pieces
        self._piece = memoryview(b"")

    def readable(self) -> bool:
        return True

    def readinto(self, target) -> int:
        while not self._piece:
            piece = next(self._pieces, None)
            if piece is None:
                return 0
            self._piece = memoryview(piece).cast("B")
        count = min(len(target), len(self._piece))
        target[:count] = self._piece[:count]
        self._piece = self._piece[count:]
        return count

    def readall(self) -> bytes:
        return b"".join([bytes(self._piece), *self._pieces])


class ItemStream(PieceStream):
    """A readable file object over an item's decoded bytes."""

    def __init__(self, location: ItemLocation, piece_bytes: int = DEFAULT_PIECE_BYTES) -> None:
        super().__init__(iter_item_pieces(location, piece_bytes))


def open_item_stream(location: ItemLocation) -> io.BufferedReader:
    """A buffered readable stream of the item's decoded bytes."""
    return io.BufferedReader(ItemStream(location))


@functools.lru_cache(maxsize=64)
def read_safetensors_header(path: Path, blob_offset: int) -> tuple[dict, int]:
    """The JSON header of the safetensors blob at blob_offset, and where its data starts."""
    try:
        with open(path, "rb") as stream:
            stream.seek(blob_offset)
            prefix = stream.read(8)
            if len(prefix) < 8:
                raise DataError(f"{path}: truncated safetensors header at byte {blob_offset}")
            (header_bytes,) = struct.unpack("<Q", prefix)
            if header_bytes > _MAX_SAFETENSORS_HEADER_BYTES:
                raise DataError(f"{path}: safetensors header at byte {blob_offset} claims "
                                f"{header_bytes} bytes, more than any real header")
            header = json.loads(stream.read(header_bytes))
    except (ValueError, UnicodeDecodeError) as error:
        raise DataError(f"{path}: safetensors header at byte {blob_offset} is not JSON "
                        f"({error})") from None
    except FileNotFoundError:
        raise DataError(f"{path}: missing data file") from None
    if not isinstance(header, dict):
        raise DataError(f"{path}: safetensors header at byte {blob_offset} is not an object")
    return header, blob_offset + 8 + header_bytes


def _safetensors_tensor_range(path: Path, blob_offset: int, fqn: str) -> tuple[int, int]:
    header, data_start = read_safetensors_header(path, blob_offset)
    entry = header.get(fqn)
    try:
        begin, end = entry["data_offsets"]
        if not (isinstance(begin, int) and isinstance(end, int) and 0 <= begin <= end):
            raise TypeError
    except (TypeError, KeyError, ValueError):
        raise DataError(f"{path}: safetensors header has no valid entry for {fqn!r}") from None
    return data_start + begin, end - begin


"""Read one stored item: its raw byte range, decoded through its transforms, piece by piece."""

from __future__ import annotations

import functools
import io
import json
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from dcpctl.errors import DataError, UnsupportedLayoutError
from dcpctl.format.checkpoint import SAFETENSORS, Checkpoint
from dcpctl.format.codecs import IDENTITY, Codec, codec_for_descriptors
from dcpctl.format.records import StorageInfo

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


def iter_stored_pieces(location: ItemLocation,
                       piece_bytes: int = DEFAULT_PIECE_BYTES) -> Iterator[bytes]:
    """The item's stored (still encoded) bytes, in pieces of at most piece_bytes."""
    try:
        with open(location.path, "rb", buffering=0) as stream:
            stream.seek(location.start)
            remaining = location.length
            while remaining:
                piece = stream.read(min(piece_bytes, remaining))
                if not piece:
                    raise DataError(
                        f"{location.path}: truncated: item {location.fqn!r} needs bytes "
                        f"{location.start}..{location.start + location.length}, the file ends "
                        f"at {location.start + location.length - remaining}")
                remaining -= len(piece)
                yield piece
    except FileNotFoundError:
        raise DataError(f"{location.path}: missing data file (item {location.fqn!r})") from None


def iter_item_pieces(location: ItemLocation,
                     piece_bytes: int = DEFAULT_PIECE_BYTES) -> Iterator[bytes]:
    """The item's decoded bytes, in pieces; raises DataError naming the item if they do not
    decode."""
    decoder = location.codec.new_decoder()
    try:
        for piece in iter_stored_pieces(location, piece_bytes):
            yield from decoder.decode(piece)
        decoder.finish()
    except DataError as error:
        if str(location.path) in str(error):
            raise
        raise DataError(f"{location.path}: item {location.fqn!r} at bytes "
                        f"{location.start}..{location.start + location.length}: {error}") from None


def read_item(location: ItemLocation) -> bytes:
    """The whole decoded item; for small items such as pickled objects."""
    return b"".join(iter_item_pieces(location))


class ItemStream(io.RawIOBase):
    """A readable file object over an item's decoded bytes."""

    def __init__(self, location: ItemLocation, piece_bytes: int = DEFAULT_PIECE_BYTES) -> None:
        self._pieces = iter_item_pieces(location, piece_bytes)
        self._buffer = b""

    def readable(self) -> bool:
        return True

    def readinto(self, target) -> int:
        while not self._buffer:
            self._buffer = next(self._pieces, b"")
            if not self._buffer:
                return 0
        count = min(len(target), len(self._buffer))
        target[:count] = self._buffer[:count]
        self._buffer = self._buffer[count:]
        return count


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


"""Random access to the raw bytes of stored tensor chunks, whatever their codec.

A plain TORCH_SAVE item is read in place: its torch.save layout (found from the archive's
end, without reading the data) says where the payload starts. An item under a stream codec
such as zstd can only be read front to back, so it is decoded once and read from there: in
memory when its tensor is small (a piece at most), else from a spool file on disk. Either goes
when the last reader that needs it is done. SAFETENSORS items are raw bytes already.
"""

from __future__ import annotations

import io
import os
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

from dcpctl.errors import DataError, UnsupportedLayoutError
from dcpctl.format.checkpoint.items import DEFAULT_PIECE_BYTES, ItemLocation, iter_item_pieces
from dcpctl.format.torch_save.layout import TorchSaveLayout, max_tensor_archive_bytes, \
    read_torch_save_layout
from dcpctl.format.torch_save.zip_records import ReadRange


@dataclass(frozen=True)
class PayloadSource:
    """Where a chunk's raw row-major bytes are: at offset in the file at path, read with
    os.pread, or, for an item decoded in memory, in `data` (path None)."""

    path: Path | None
    offset: int
    nbytes: int
    data: memoryview | None = None


class _ItemState:
    """One stored item's payload, once found, and how many users it has left."""

    __slots__ = ("lock", "source", "users_left")

    def __init__(self, users: int) -> None:
        self.lock = threading.Lock()
        self.source: PayloadSource | None = None
        self.users_left = users


class PayloadReader:
    """Finds and reads the payload of stored chunks; safe to share between threads."""

    def __init__(self, spool_directory: Path, users_by_item: dict[ItemLocation, int],
                 memory_item_bytes: int = DEFAULT_PIECE_BYTES) -> None:
        """Items under a codec whose tensor has at most memory_item_bytes are decoded into
        memory, larger ones into spool_directory."""
        self._spool_directory = spool_directory
        self._memory_item_bytes = memory_item_bytes
        # One state per item, made up front: each use then costs one lookup and no shared lock.
        self._items = {location: _ItemState(users) for location, users in users_by_item.items()}
        self._lock = threading.Lock()
        self._descriptors: dict[Path, int] = {}

    def source_of(self, location: ItemLocation, raw_tensor: bool, expected_nbytes: int
                  ) -> PayloadSource:
        """The payload of the chunk stored at location (raw_tensor: SAFETENSORS bytes)."""
        item = self._items[location]
        source = item.source
        if source is None:
            with item.lock:
                source = item.source
                if source is None:
                    source = item.source = self._locate(location, raw_tensor,
                                                        expected_nbytes)
        if source.nbytes != expected_nbytes:
            raise DataError(f"{location.path}: item {location.fqn!r} holds {source.nbytes} bytes "
                            f"of tensor data, the metadata implies {expected_nbytes}")
        return source

    def read_into(self, source: PayloadSource, offset: int, out: memoryview) -> None:
        """Fill out with the payload's bytes from offset."""
        if source.data is not None:
            if offset + len(out) > source.nbytes:
                raise ValueError(f"bytes {offset}..{offset + len(out)} of a payload of "
                                 f"{source.nbytes}")
            out[:] = source.data[offset:offset + len(out)]
            return
        count = os.preadv(self._descriptor(source.path), [out], source.offset + offset)
        if count != len(out):
            raise DataError(f"{source.path}: truncated at byte {source.offset + offset + count}")

    def release(self, location: ItemLocation) -> None:
        """One user of the item is done; its spool file goes with the last one."""
        item = self._items[location]
        with item.lock:
            item.users_left -= 1
            if item.users_left or item.source is None:
                return
            source, item.source = item.source, None
        if source.path is not None and source.path.parent == self._spool_directory:
            with self._lock:
                descriptor = self._descriptors.pop(source.path, None)
            if descriptor is not None:
                os.close(descriptor)
            source.path.unlink(missing_ok=True)

    def close(self) -> None:
        """Close every file this reader opened."""
        for descriptor in self._descriptors.values():
            os.close(descriptor)
        self._descriptors.clear()

    def _descriptor(self, path: Path) -> int:
        with self._lock:
            descriptor = self._descriptors.get(path)
            if descriptor is None:
                descriptor = self._descriptors[path] = os.open(path, os.O_RDONLY)
            return descriptor

    def _locate(self, location: ItemLocation, raw_tensor: bool,
                expected_nbytes: int) -> PayloadSource:
        if raw_tensor:  # SAFETENSORS files store the bare bytes, never under a codec
            return PayloadSource(location.path, location.start, location.length)
        if not location.codec.descriptors:
            descriptor = self._descriptor(location.path)
            layout = self._layout(location, lambda offset, size: os.pread(
                descriptor, size, location.start + offset), location.length)
            return PayloadSource(location.path, location.start + layout.payload_offset,
                                 layout.tensor.nbytes)
        decoded = self._decode(location, expected_nbytes)
        if isinstance(decoded, Path):
            descriptor = self._descriptor(decoded)
            layout = self._layout(location, lambda offset, size: os.pread(
                descriptor, size, offset), decoded.stat().st_size)
            return PayloadSource(decoded, layout.payload_offset, layout.tensor.nbytes)
        layout = self._layout(location, lambda offset, size: bytes(
            decoded[offset:offset + size]), len(decoded))
        start = layout.payload_offset
        return PayloadSource(None, start, layout.tensor.nbytes,
                             decoded[start:start + layout.tensor.nbytes])

    @staticmethod
    def _layout(location: ItemLocation, read_range: ReadRange, length: int) -> TorchSaveLayout:
        try:
            layout = read_torch_save_layout(read_range, length)
        except DataError as error:
            raise DataError(f"{location.path}: item {location.fqn!r}: {error}") from None
        if not layout.tensor.is_contiguous:
            raise UnsupportedLayoutError(f"{location.path}: item {location.fqn!r} holds a "
                                         "non-contiguous tensor view")
        return layout

    def _decode(self, location: ItemLocation, expected_nbytes: int) -> memoryview | Path:
        """The item's decoded bytes: in memory for a tensor of at most memory_item_bytes, else
        in a spool file. An archive larger than its tensor's bytes and room for its records
        is refused."""
        pieces = iter_item_pieces(location, max_bytes=max_tensor_archive_bytes(expected_nbytes))
        if expected_nbytes > self._memory_item_bytes:
            return self._spool(pieces)
        held = io.BytesIO()
        for piece in pieces:
            held.write(piece)
        return held.getbuffer()

    def _spool(self, pieces: Iterable[bytes]) -> Path:
        handle, name = tempfile.mkstemp(dir=self._spool_directory, suffix=".item")
        try:
            with os.fdopen(handle, "wb") as stream:
                for piece in pieces:
                    stream.write(piece)
        except BaseException:
            os.unlink(name)
            raise
        return Path(name)

"""Random access to the raw bytes of stored tensor chunks, whatever their codec.

A plain TORCH_SAVE item is read in place: its torch.save layout (found from the archive's
end, without reading the data) says where the payload starts. An item under a stream codec
such as zstd can only be read front to back, so it is decoded once into a spool file and read
from there; the spool file goes when the last reader that needs it is done. SAFETENSORS items
are raw bytes already.
"""

from __future__ import annotations

import os
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

from dcpctl.errors import DataError, UnsupportedLayoutError
from dcpctl.format.items import ItemLocation, iter_item_pieces
from dcpctl.format.torch_save import read_torch_save_layout


@dataclass(frozen=True)
class PayloadSource:
    """Where a chunk's raw row-major bytes can be read with os.pread."""

    path: Path
    offset: int
    nbytes: int


class _ItemState:
    """One stored item's payload, once found, and how many users it has left."""

    __slots__ = ("lock", "source", "users_left")

    def __init__(self, users: int) -> None:
        self.lock = threading.Lock()
        self.source: PayloadSource | None = None
        self.users_left = users


class PayloadReader:
    """Finds and reads the payload of stored chunks; safe to share between threads."""

    def __init__(self, spool_directory: Path, users_by_item: dict[ItemLocation, int]) -> None:
        self._spool_directory = spool_directory
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
                    source = item.source = self._locate(location, raw_tensor)
        if source.nbytes != expected_nbytes:
            raise DataError(f"{location.path}: item {location.fqn!r} holds {source.nbytes} bytes "
                            f"of tensor data, the metadata implies {expected_nbytes}")
        return source

    def read_into(self, source: PayloadSource, offset: int, out: memoryview) -> None:
        """Fill out with the payload's bytes from offset."""
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
        if source.path.parent == self._spool_directory:
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

    def _locate(self, location: ItemLocation, raw_tensor: bool) -> PayloadSource:
        if raw_tensor:  # SAFETENSORS files store the bare bytes, never under a codec
            return PayloadSource(location.path, location.start, location.length)
        path, start, length = location.path, location.start, location.length
        if location.codec.descriptors:
            path = self._spool(location)
            start, length = 0, path.stat().st_size
        descriptor = self._descriptor(path)
        try:
            layout = read_torch_save_layout(
                lambda offset, size: os.pread(descriptor, size, start + offset), length)
        except DataError as error:
            raise DataError(f"{location.path}: item {location.fqn!r}: {error}") from None
        if not layout.tensor.is_contiguous:
            raise UnsupportedLayoutError(f"{location.path}: item {location.fqn!r} holds a "
                                         "non-contiguous tensor view")
        return PayloadSource(path, start + layout.payload_offset, layout.tensor.nbytes)

    def _spool(self, location: ItemLocation) -> Path:
        handle, name = tempfile.mkstemp(dir=self._spool_directory, suffix=".item")
        with os.fdopen(handle, "wb") as stream:
            for piece in iter_item_pieces(location):
                stream.write(piece)
        return Path(name)

"""The raw row-major bytes of stored tensor chunks, read at random, whatever their codec or
stored layout: the one reader of chunk payloads, so every command accepts the same inputs.

A plain TORCH_SAVE item is read in place: its torch.save layout (found from the archive's end,
without reading the data) says where the payload starts. An item under a stream codec such as
zstd can only be read front to back, so it is decoded once and read from there: in memory when
its chunk is small (a piece at most), else from a spool file on disk. A chunk saved as a dense
view with strides of its own (torch keeps a tensor's memory format when it saves it: a
channels_last weight, a transposed one) is laid out row-major once, the same way. Either goes
when the last reader that needs it is done. SAFETENSORS items are raw bytes already. Every item
must hold the dtype and shape the metadata gives its chunk.
"""

from __future__ import annotations

import contextlib
import io
import math
import os
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator

import numpy

from dcpctl.errors import DataError, DcpctlError, truncated_error
from dcpctl.format.checkpoint.items import DEFAULT_PIECE_BYTES, ItemLocation, iter_item_pieces
from dcpctl.format.dtypes import DType
from dcpctl.format.torch_save.layout import TorchSaveLayout, read_torch_save_layout
from dcpctl.format.torch_save.zip_records import ReadRange
from dcpctl.storage.local import naming_failures, open_regular_file, scratch_directory_beside


@dataclass(frozen=True)
class PayloadSource:
    """Where a chunk's raw row-major bytes are: at offset in the file at path, read with
    os.pread, or, for bytes held in memory, in `data` (path None)."""

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

    def __init__(self, spool_directory: Path, users_by_item: dict[ItemLocation, int] | None = None,
                 memory_item_bytes: int = DEFAULT_PIECE_BYTES) -> None:
        """Payloads that must be decoded or laid out again are held in memory up to
        memory_item_bytes, in spool_directory above. An item has the users users_by_item
        gives it (one if it is not there): its payload goes once that many have released it."""
        self._spool_directory = spool_directory
        self._memory_item_bytes = memory_item_bytes
        # One state per known item, made up front: each use then costs one lookup, no lock.
        self._items = {location: _ItemState(users)
                       for location, users in (users_by_item or {}).items()}
        self._lock = threading.Lock()
        self._descriptors: dict[Path, int] = {}

    def source_of(self, location: ItemLocation, raw_tensor: bool, dtype: DType,
                  sizes: tuple[int, ...]) -> PayloadSource:
        """The payload of the chunk of this dtype and sizes stored at location (raw_tensor:
        SAFETENSORS bytes); raises DataError if the item holds anything else."""
        item = self._state(location)
        source = item.source
        if source is None:
            with item.lock:
                source = item.source
                if source is None:
                    source = item.source = self._locate(location, raw_tensor, dtype, sizes)
        expected_nbytes = math.prod(sizes) * dtype.itemsize
        if source.nbytes != expected_nbytes:
            raise DataError(f"holds {source.nbytes} bytes of tensor data, the metadata implies "
                            f"{expected_nbytes}", path=location.path, fqn=location.fqn,
                            start=location.start, end=location.end)
        return source

    def read_into(self, source: PayloadSource, offset: int, out: memoryview) -> None:
        """Fill out with the payload's bytes from offset."""
        if offset + len(out) > source.nbytes:
            raise ValueError(f"bytes {offset}..{offset + len(out)} of a payload of "
                             f"{source.nbytes}")
        if source.data is not None:
            out[:] = source.data[offset:offset + len(out)]
            return
        start = source.offset + offset
        count = os.preadv(self._descriptor(source.path), [out], start)
        if count != len(out):
            raise truncated_error(source.path, None, start, start + len(out), start + count)

    def read_chunk(self, location: ItemLocation, raw_tensor: bool, dtype: DType,
                   sizes: tuple[int, ...]) -> bytearray:
        """The whole payload of the chunk at location, for one user, who is then done."""
        try:
            source = self.source_of(location, raw_tensor, dtype, sizes)
            data = bytearray(source.nbytes)
            self.read_into(source, 0, memoryview(data))
            return data
        finally:
            self.release(location)

    def release(self, location: ItemLocation) -> None:
        """One user of the item is done; what was decoded for it goes with the last one."""
        item = self._state(location)
        with item.lock:
            item.users_left -= 1
            if item.users_left or item.source is None:
                return
            source, item.source = item.source, None
        if source.path is not None and source.path.parent == self._spool_directory:
            self._forget(source.path)

    def close(self) -> None:
        """Close every file this reader opened."""
        with self._lock:
            for descriptor in self._descriptors.values():
                os.close(descriptor)
            self._descriptors.clear()

    def _state(self, location: ItemLocation) -> _ItemState:
        item = self._items.get(location)
        if item is None:
            with self._lock:
                item = self._items.setdefault(location, _ItemState(1))
        return item

    def _descriptor(self, path: Path) -> int:
        with self._lock:
            descriptor = self._descriptors.get(path)
            if descriptor is None:
                descriptor = self._descriptors[path] = open_regular_file(path)
            return descriptor

    def _forget(self, spool_path: Path) -> None:
        with self._lock:
            descriptor = self._descriptors.pop(spool_path, None)
        if descriptor is not None:
            os.close(descriptor)
        spool_path.unlink(missing_ok=True)

    def _locate(self, location: ItemLocation, raw_tensor: bool, dtype: DType,
                sizes: tuple[int, ...]) -> PayloadSource:
        if raw_tensor:  # SAFETENSORS files store the bare bytes, never under a codec
            return PayloadSource(location.path, location.start, location.length)
        if not location.codec.descriptors:
            descriptor = self._descriptor(location.path)
            layout = _checked_layout(location, lambda offset, size: os.pread(
                descriptor, size, location.start + offset), location.length, dtype, sizes)
            if layout.tensor.is_contiguous:
                return PayloadSource(location.path, location.start + layout.payload_offset,
                                     layout.tensor.nbytes)
            return self._row_major(layout, _file_bytes(
                location.path, location.start + layout.storage.data_offset,
                layout.storage.size_bytes))
        decoded = self._decode(location, math.prod(sizes) * dtype.itemsize)
        if isinstance(decoded, Path):
            try:
                return self._locate_in_spool(location, decoded, dtype, sizes)
            except BaseException:
                self._forget(decoded)
                raise
        layout = _checked_layout(location, lambda offset, size: bytes(
            decoded[offset:offset + size]), len(decoded), dtype, sizes)
        start = layout.payload_offset
        if layout.tensor.is_contiguous:
            return PayloadSource(None, start, layout.tensor.nbytes,
                                 decoded[start:start + layout.tensor.nbytes])
        storage = layout.storage
        return self._row_major(layout, numpy.frombuffer(
            decoded[storage.data_offset:storage.data_end], dtype=numpy.uint8))

    def _locate_in_spool(self, location: ItemLocation, spool_path: Path, dtype: DType,
                         sizes: tuple[int, ...]) -> PayloadSource:
        descriptor = self._descriptor(spool_path)
        layout = _checked_layout(location, lambda offset, size: os.pread(
            descriptor, size, offset), spool_path.stat().st_size, dtype, sizes)
        if layout.tensor.is_contiguous:
            return PayloadSource(spool_path, layout.payload_offset, layout.tensor.nbytes)
        source = self._row_major(layout, _file_bytes(spool_path, layout.storage.data_offset,
                                                     layout.storage.size_bytes))
        self._forget(spool_path)  # the row-major copy stands in for it
        return source

    def _decode(self, location: ItemLocation, nbytes: int) -> memoryview | Path:
        """The item's decoded bytes (capped by the location at what its chunk can hold): in
        memory for a chunk of at most memory_item_bytes, else in a spool file."""
        pieces = iter_item_pieces(location)
        if nbytes > self._memory_item_bytes:
            return self._spool(pieces)
        held = io.BytesIO()
        for piece in pieces:
            held.write(piece)
        return held.getbuffer()

    def _row_major(self, layout: TorchSaveLayout, storage: numpy.ndarray) -> PayloadSource:
        """The elements of a strided view of `storage` (its bytes), copied into row-major
        order: in memory when small, else into a spool file a block of rows at a time."""
        saved = layout.tensor
        itemsize = saved.dtype.itemsize
        # _checked_layout made sure every element of the view lies inside the storage.
        elements = numpy.lib.stride_tricks.as_strided(
            storage[saved.storage_offset * itemsize:], shape=(*saved.shape, itemsize),
            strides=(*(stride * itemsize for stride in saved.stride), 1), writeable=False)
        if saved.nbytes <= self._memory_item_bytes or not saved.shape:
            data = numpy.ascontiguousarray(elements).reshape(-1)
            return PayloadSource(None, 0, saved.nbytes, memoryview(data))
        rows_per_block = max(1, self._memory_item_bytes // max(1, saved.nbytes // saved.shape[0]))
        blocks = (numpy.ascontiguousarray(elements[first:first + rows_per_block]).data
                  for first in range(0, saved.shape[0], rows_per_block))
        return PayloadSource(self._spool(blocks), 0, saved.nbytes)

    def _spool(self, pieces: Iterable[bytes]) -> Path:
        handle, name = tempfile.mkstemp(dir=self._spool_directory, suffix=".item")
        try:
            with os.fdopen(handle, "wb") as stream, naming_failures(name):
                for piece in pieces:
                    stream.write(piece)
        except BaseException:
            os.unlink(name)
            raise
        return Path(name)


@contextlib.contextmanager
def open_payload_reader(output: Path, users_by_item: dict[ItemLocation, int] | None = None
                        ) -> Iterator[PayloadReader]:
    """A PayloadReader that spools beside output (on its file system), closed and its spool
    removed afterwards."""
    with scratch_directory_beside(output) as spool:
        reader = PayloadReader(spool, users_by_item)
        try:
            yield reader
        finally:
            reader.close()


def _checked_layout(location: ItemLocation, read_range: ReadRange, length: int, dtype: DType,
                    sizes: tuple[int, ...]) -> TorchSaveLayout:
    """The item's torch.save layout, which must hold a tensor of this dtype and shape."""
    try:
        layout = read_torch_save_layout(read_range, length)
    except DcpctlError as error:
        raise error.located(path=location.path, fqn=location.fqn, start=location.start,
                            end=location.end) from None
    saved = layout.tensor
    if saved.dtype != dtype or saved.shape != tuple(sizes):
        raise DataError(f"holds a {saved.dtype.name} tensor of shape {list(saved.shape)}, the "
                        f"metadata says {dtype.name} {list(sizes)}", path=location.path,
                        fqn=location.fqn, start=location.start, end=location.end)
    return layout


def _file_bytes(path: Path, offset: int, length: int) -> numpy.ndarray:
    """Bytes [offset, offset + length) of a file, mapped, not read: a view's elements are
    gathered from them a block at a time."""
    return numpy.memmap(path, dtype=numpy.uint8, mode="r", offset=offset, shape=(length,))

"""The raw row-major bytes of stored tensor chunks, read at random, whatever their codec or
stored layout, and checked: the one reader of chunk payloads, so every command accepts the same
inputs and passes on no damage.

A plain TORCH_SAVE item is read in place: its torch.save layout (found from the archive's end,
without reading the data) says where the payload starts. The ranges read of it are CRC'd as
they are read, and each read gives its caller that CRC-32 (a reshard's output chunk of those
bytes needs no second pass over them for its own archive); once its last user is done, the
CRC-32s of the ranges (and of any bytes of its storage record nobody read) combine into the
record's, which must match the archive's. An item of several users whose record is small (a
piece at most) is read whole instead, once, and served from memory (a thousand reads of a row
each would cost a thousand calls). Its ranges are CRC'd and checked the same way where they
are large enough for joining their CRC-32s (microseconds each) to cost less than a pass over
them; a record cut into smaller ranges is checked whole at once.

An item under a stream codec such as zstd can only be read front to back, so it is decoded once
(and checked whole as it is: items.decode_stored_pieces) and read from there: in memory when
its chunk is small (a piece at most), else from a spool file on disk. A chunk saved as a dense
view with strides of its own (torch keeps a tensor's memory format when it saves it: a
channels_last weight, a transposed one) is laid out row-major once, the same way, its storage
record checked as it is read. Either goes when the last reader that needs it is done.
SAFETENSORS items are raw bytes already, with no CRC of their own. Every item must hold the
dtype and shape the metadata gives its chunk.
"""

from __future__ import annotations

import contextlib
import io
import os
import tempfile
import threading
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator

import numpy

from dcpctl.errors import DataError, DcpctlError, UnsupportedLayoutError, truncated_error
from dcpctl.format.checkpoint.items import DEFAULT_PIECE_BYTES, iter_item_pieces
from dcpctl.format.checkpoint.locations import ItemLocation
from dcpctl.format.checkpoint.problems import Problem, Rule, problems_error
from dcpctl.format.torch_save.crc32 import crc32_of_concatenation
from dcpctl.format.torch_save.layout import TorchSaveLayout, read_torch_save_layout
from dcpctl.format.torch_save.zip_records import ReadRange
from dcpctl.storage.local import naming_failures, scratch_directory_in
from dcpctl.storage.paths import RangedFile, StoragePath, is_remote, open_ranged

# Joining the CRC-32s of two ranges costs about what a CRC-32 of a few KiB does.
_MIN_JOINED_RANGE_BYTES = 8 << 10


class RecordCrc:
    """The CRC-32 of a storage record [start, start + size) of a file, from the ranges of it
    read, in any order, on any thread."""

    def __init__(self, start: int, size: int, expected: int, held: bytes | None = None) -> None:
        self.start, self.size, self.expected = start, size, expected
        self._held = held
        """The record's bytes, where it was read whole and is served from memory."""
        self._ranges: list[tuple[int, int, int]] = []  # start, length, CRC-32
        self._lock = threading.Lock()

    def add(self, start: int, data) -> int:
        """Take bytes read from the file at start; their CRC-32."""
        crc = zlib.crc32(data)
        with self._lock:
            self._ranges.append((start, len(data), crc))
        return crc

    def matches(self, read_range: ReadRange) -> bool:
        """Whether the record's CRC-32 is the archive's; bytes of it not read so far are read
        now with read_range(start, length), or taken from memory where the record is held."""
        if self._held is not None:
            read_range = self._read_held
        position, crc = self.start, 0
        for start, length, range_crc in sorted(self._ranges):
            if start < position:  # read twice: its ranges overlap, so read it whole
                return self._crc_of(self.start, self.size, read_range) == self.expected
            gap = start - position
            crc = crc32_of_concatenation(crc, self._crc_of(position, gap, read_range), gap)
            crc, position = crc32_of_concatenation(crc, range_crc, length), start + length
        end = self.start + self.size
        crc = crc32_of_concatenation(crc, self._crc_of(position, end - position, read_range),
                                     end - position)
        return crc == self.expected

    def _read_held(self, start: int, length: int) -> memoryview:
        return memoryview(self._held)[start - self.start:start - self.start + length]

    @staticmethod
    def _crc_of(start: int, length: int, read_range: ReadRange) -> int:
        crc = 0
        for offset in range(start, start + length, DEFAULT_PIECE_BYTES):
            crc = zlib.crc32(read_range(offset, min(DEFAULT_PIECE_BYTES, start + length - offset)),
                             crc)
        return crc


@dataclass(frozen=True)
class PayloadSource:
    """Where a chunk's raw row-major bytes are: at offset in the file at path, read by range,
    or, for bytes held in memory, in `data` (path None); and the CRC of the storage record they
    are read from, when it is to be checked as they are."""

    path: StoragePath | None
    offset: int
    """In the file at path; for bytes in memory, where `data` starts in the file they were
    read from (what a range read of them counts in crc), or in what they were decoded into."""
    nbytes: int
    data: memoryview | None = None
    crc: RecordCrc | None = None


class BytesWithCrc:
    """Bytes, and their CRC-32 where reading them worked it out (None where it did not): a
    torch.save record written of them needs no second pass for its own. Its length is that of
    its bytes (what a pipeline counts of the pieces it holds: pipeline.py)."""

    __slots__ = ("data", "crc")

    def __init__(self, data: bytearray | memoryview, crc: int | None = None) -> None:
        self.data, self.crc = data, crc

    def __len__(self) -> int:
        return len(self.data)


class _ItemState:
    """One stored item's payload, once found, and how many users it has left."""

    __slots__ = ("lock", "source", "users_left")

    def __init__(self, users: int) -> None:
        self.lock = threading.Lock()
        self.source: PayloadSource | None = None
        self.users_left = users


class PayloadReader:
    """Finds, reads and checks the payload of stored chunks; safe to share between threads."""

    def __init__(self, spool_directory: Path, users_by_item: dict[ItemLocation, int] | None = None,
                 memory_item_bytes: int = DEFAULT_PIECE_BYTES) -> None:
        """Payloads that must be decoded or laid out again are held in memory up to
        memory_item_bytes, in spool_directory above. An item has the users users_by_item
        gives it (one if it is not there): its payload is checked and goes once that many
        have released it."""
        self._spool_directory = spool_directory
        self._memory_item_bytes = memory_item_bytes
        # One state per known item, made up front: each use then costs one lookup, no lock.
        self._items = {location: _ItemState(users)
                       for location, users in (users_by_item or {}).items()}
        self._lock = threading.Lock()
        self._readers: dict[StoragePath, RangedFile] = {}

    def source_of(self, location: ItemLocation) -> PayloadSource:
        """The payload of the tensor chunk stored at location; raises DataError if the item
        holds anything but what location.expected says."""
        item = self._state(location)
        source = item.source
        if source is None:
            with item.lock:
                source = item.source
                if source is None:
                    source = item.source = self._locate(location, item.users_left)
        if source.nbytes != location.expected.nbytes:
            raise DataError(f"holds {source.nbytes} bytes of tensor data, the metadata implies "
                            f"{location.expected.nbytes}", **location.place)
        return source

    def read_into(self, source: PayloadSource, offset: int, out: memoryview) -> int | None:
        """Fill out with the payload's bytes from offset; the CRC-32 of those bytes where
        reading them worked it out (to check the item they come from), else None."""
        if offset + len(out) > source.nbytes:
            raise ValueError(f"bytes {offset}..{offset + len(out)} of a payload of "
                             f"{source.nbytes}")
        start = source.offset + offset
        if source.data is not None:
            out[:] = source.data[offset:offset + len(out)]
        else:
            count = self._reader(source.path).readinto(out, start)
            if count != len(out):
                raise truncated_error(source.path, None, start, start + len(out), start + count)
        return source.crc.add(start, out) if source.crc is not None else None

    def read_chunk(self, location: ItemLocation) -> BytesWithCrc:
        """The whole payload of the chunk at location, for one user, who is then done."""
        try:
            source = self.source_of(location)
            data = bytearray(source.nbytes)
            crc = self.read_into(source, 0, memoryview(data))
        except BaseException:
            self.release(location, completed=False)
            raise
        self.release(location)
        return BytesWithCrc(data, crc)

    def release(self, location: ItemLocation, completed: bool = True) -> None:
        """One user of the item is done; the last one checks what was read of a plain item
        against its CRC-32 (raising DataError if it does not match), unless completed is
        False (it failed, and its error says why), and frees what was decoded for it."""
        item = self._state(location)
        with item.lock:
            item.users_left -= 1
            if item.users_left or item.source is None:
                return
            source, item.source = item.source, None
        if source.path is not None and source.path.parent == self._spool_directory:
            self._forget(source.path)
        elif completed and source.crc is not None:
            if not source.crc.matches(
                    lambda start, length: self._reader(location.path).read(start, length)):
                raise _storage_crc_error(location)

    def close(self) -> None:
        """Close every file this reader opened."""
        with self._lock:
            for reader in self._readers.values():
                reader.close()
            self._readers.clear()

    def _state(self, location: ItemLocation) -> _ItemState:
        item = self._items.get(location)
        if item is None:
            with self._lock:
                item = self._items.setdefault(location, _ItemState(1))
        return item

    def _reader(self, path: StoragePath) -> RangedFile:
        with self._lock:
            reader = self._readers.get(path)
            if reader is None:
                reader = self._readers[path] = open_ranged(path)
            return reader

    def _forget(self, spool_path: Path) -> None:
        with self._lock:
            reader = self._readers.pop(spool_path, None)
        if reader is not None:
            reader.close()
        spool_path.unlink(missing_ok=True)

    def _locate(self, location: ItemLocation, users: int) -> PayloadSource:
        if location.raw:  # SAFETENSORS files store the bare bytes, never under a codec
            return PayloadSource(location.path, location.start, location.length)
        if not location.codec.descriptors:
            return self._locate_in_place(location, users)
        decoded = self._decode(location)
        if isinstance(decoded, Path):
            try:
                return self._locate_in_spool(location, decoded)
            except BaseException:
                self._forget(decoded)
                raise
        layout = _checked_layout(location, lambda offset, size: bytes(
            decoded[offset:offset + size]), len(decoded))
        start = layout.payload_offset
        if layout.tensor.is_contiguous:
            return PayloadSource(None, start, layout.tensor.nbytes,
                                 decoded[start:start + layout.tensor.nbytes])
        storage = layout.storage
        return self._row_major(layout, numpy.frombuffer(
            decoded[storage.data_offset:storage.data_end], dtype=numpy.uint8))

    def _locate_in_place(self, location: ItemLocation, users: int) -> PayloadSource:
        reader = self._reader(location.path)
        layout = _checked_layout(location, lambda offset, size: reader.read(
            location.start + offset, size), location.length)
        storage = layout.storage
        record_start = location.start + storage.data_offset
        payload_start = location.start + layout.payload_offset
        contiguous = layout.tensor.is_contiguous
        # read by several users, a range each (a thousand rows of a tensor resharded to a
        # thousand ranks): a small record is read once and served from memory
        shared = users > 1 and storage.size_bytes <= self._memory_item_bytes
        if contiguous and not shared:
            crc = RecordCrc(record_start, storage.size_bytes, storage.crc32)
            return PayloadSource(location.path, payload_start, layout.tensor.nbytes,
                                 crc=crc if storage.crc32 else None)
        if not contiguous:
            record = self._file_bytes(location.path, record_start, storage.size_bytes)
            if storage.crc32 and zlib.crc32(record) != storage.crc32:
                raise _storage_crc_error(location)
            return self._row_major(layout, record)
        record = _read_exactly(reader, location.path, record_start, storage.size_bytes)
        checked_from_ranges = (storage.crc32
                               and storage.size_bytes >= users * _MIN_JOINED_RANGE_BYTES)
        if storage.crc32 and not checked_from_ranges and zlib.crc32(record) != storage.crc32:
            raise _storage_crc_error(location)
        start = payload_start - record_start
        return PayloadSource(None, payload_start, layout.tensor.nbytes,
                             memoryview(record)[start:start + layout.tensor.nbytes],
                             crc=RecordCrc(record_start, storage.size_bytes, storage.crc32,
                                           held=record) if checked_from_ranges else None)

    def _locate_in_spool(self, location: ItemLocation, spool_path: Path) -> PayloadSource:
        reader = self._reader(spool_path)
        layout = _checked_layout(location, lambda offset, size: reader.read(offset, size),
                                 spool_path.stat().st_size)
        if layout.tensor.is_contiguous:
            return PayloadSource(spool_path, layout.payload_offset, layout.tensor.nbytes)
        source = self._row_major(layout, self._file_bytes(
            spool_path, layout.storage.data_offset, layout.storage.size_bytes))
        self._forget(spool_path)  # the row-major copy stands in for it
        return source

    def _decode(self, location: ItemLocation) -> memoryview | Path:
        """The item's decoded bytes, checked whole as they come (capped by the location at
        what its chunk can hold): in memory for a chunk of at most memory_item_bytes, else in
        a spool file."""
        pieces = iter_item_pieces(location)
        if location.expected.nbytes > self._memory_item_bytes:
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

    def _file_bytes(self, path: StoragePath, offset: int, length: int) -> numpy.ndarray:
        """Bytes [offset, offset + length) of a file, mapped, not read, where it is local (a
        view's elements are gathered from them a block at a time); an object's are read."""
        if not is_remote(path):
            return numpy.memmap(path, dtype=numpy.uint8, mode="r", offset=offset,
                                shape=(length,))
        return numpy.frombuffer(_read_exactly(self._reader(path), path, offset, length),
                                dtype=numpy.uint8)

    def _spool(self, pieces: Iterable[bytes]) -> Path:
        handle, name = tempfile.mkstemp(dir=self._spool_directory, suffix=".item")
        try:
            with naming_failures(name), os.fdopen(handle, "wb") as stream:
                for piece in pieces:
                    stream.write(piece)
        except BaseException:
            os.unlink(name)
            raise
        return Path(name)


@contextlib.contextmanager
def open_payload_reader(scratch: str | os.PathLike,
                        users_by_item: dict[ItemLocation, int] | None = None
                        ) -> Iterator[PayloadReader]:
    """A PayloadReader that spools into the scratch directory its coordinator made
    (storage/local.py scratch_directory_in), closed and its spool files removed afterwards."""
    with scratch_directory_in(scratch) as spool:
        reader = PayloadReader(spool, users_by_item)
        try:
            yield reader
        finally:
            reader.close()


def _read_exactly(reader: RangedFile, path: StoragePath, offset: int, length: int) -> bytes:
    """Bytes [offset, offset + length) of the file reader reads; raises if it ends first."""
    data = reader.read(offset, length)
    if len(data) != length:
        raise truncated_error(path, None, offset, offset + length, offset + len(data))
    return data


def _checked_layout(location: ItemLocation, read_range: ReadRange, length: int
                    ) -> TorchSaveLayout:
    """The item's torch.save layout, which must hold a tensor of the expected dtype and
    shape."""
    try:
        layout = read_torch_save_layout(read_range, length)
    except DcpctlError as error:
        raise error.located(**location.place) from None
    saved, expected = layout.tensor, location.expected
    where = location.place
    if saved.dtype != expected.dtype or saved.shape != expected.sizes:
        raise DataError(f"holds a {saved.dtype.name} tensor of shape {list(saved.shape)}, the "
                        f"metadata says {expected.dtype.name} {list(expected.sizes)}", **where)
    if saved.conjugated or saved.negated:
        raise UnsupportedLayoutError(
            f"holds a tensor saved as a {'conjugate' if saved.conjugated else 'negative'} view "
            "(torch's conj/neg bit): its values are not its stored bytes, which this command "
            "reads; save it with .resolve_conj().resolve_neg() first", **where)
    return layout


def _storage_crc_error(location: ItemLocation) -> DataError:
    return problems_error([Problem(Rule.CRC_MISMATCH, "the tensor's storage record does not "
                                   "match its CRC-32", None, location.start, location.end,
                                   (location.fqn,))], location.path)

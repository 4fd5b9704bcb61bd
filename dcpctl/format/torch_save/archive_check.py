"""Check a torch.save archive: its structure, its tensor (an object's: that torch.load reads its
data.pkl, storage_references.py), and the CRC-32 of every record.

Two ways in: `check_archive` reads a byte range at random (a plain item in a file), and
`ArchiveStreamCheck` is fed the archive once from front to back, for items that can only be
decoded in order (zstd) and for plain items read during a sequential scan of their file.

The streamed check holds memory to two windows. It keeps the first `window_bytes` of the
archive, the last `window_bytes` (a rolling window), and the running CRC-32 of everything before
that last window; each byte is CRC'd once as it leaves the rolling window. At the end the zip
central directory, the local headers and data.pkl are parsed out of the two windows. The CRC
of a record whose two ends both lie in one window is computed from that window; for a record
that starts in the first window and ends in the last one (the tensor data of a torch.save
archive), it follows from the running CRC at its two ends (see `crc32_of_span`). An archive
whose records or central directory lie outside both windows (several large records, a huge
central directory) falls back to a second pass through `open_random_access`.
"""

from __future__ import annotations

import collections
import contextlib
import os
import tempfile
import zlib
from dataclasses import dataclass, field
from typing import Callable, ContextManager, Iterable, Iterator

from dcpctl.errors import DataError
from dcpctl.format.torch_save.crc32 import crc32_of_span
from dcpctl.format.torch_save.layout import (TorchSaveLayout, build_torch_save_layout,
                                             check_torch_save_records, find_pickle_record,
                                             pickle_record_of)
from dcpctl.format.torch_save.storage_references import (MAX_OBJECT_PICKLE_BYTES,
                                                         referenced_storage_keys)
from dcpctl.format.torch_save.zip_records import ReadRange, ZipRecord, read_zip_records

DEFAULT_WINDOW_BYTES = 256 << 10
_CRC_PIECE_BYTES = 4 << 20

RandomAccessOpener = Callable[[], ContextManager[ReadRange]]
"""Opens the whole archive for random reads, for the rare archive a stream cannot check."""


@dataclass
class ArchiveCheck:
    """What checking one archive found. CRC mismatches name the record and the CRC-32 its data
    actually has; `crc_recorded` is False when torch.save ran with CRC-32s turned off (all
    zero). When a tensor was expected, `layout` describes it, or `layout_error` says why not."""

    length_bytes: int
    records: tuple[ZipRecord, ...]
    crc_recorded: bool = True
    crc_mismatches: list[tuple[ZipRecord, int]] = field(default_factory=list)
    layout: TorchSaveLayout | None = None
    layout_error: str | None = None


def check_archive(read_range: ReadRange, length_bytes: int, expect_tensor: bool) -> ArchiveCheck:
    """Check an archive read at random: records, every CRC-32, the tensor when expected."""

    def crc_of(record: ZipRecord) -> int:
        crc = 0
        for start in range(record.data_offset, record.data_end, _CRC_PIECE_BYTES):
            crc = zlib.crc32(read_range(start, min(_CRC_PIECE_BYTES, record.data_end - start)), crc)
        return crc

    records = tuple(read_zip_records(read_range, length_bytes))
    return _check_records(records, length_bytes, expect_tensor, read_range, crc_of)


def _check_records(records: tuple[ZipRecord, ...], length_bytes: int, expect_tensor: bool,
                   read_range: ReadRange, crc_of: Callable[[ZipRecord], int]) -> ArchiveCheck:
    check_torch_save_records(records)
    check = ArchiveCheck(length_bytes, records)
    check.crc_recorded = any(record.crc32 for record in records if record.size_bytes)
    for record in records:
        if check.crc_recorded:
            actual_crc = crc_of(record)
            if actual_crc != record.crc32:
                check.crc_mismatches.append((record, actual_crc))
    if expect_tensor:
        try:
            pickle_record = find_pickle_record(records)
            check.layout = build_torch_save_layout(
                records, read_range(pickle_record.data_offset, pickle_record.size_bytes))
        except DataError as error:
            check.layout_error = str(error)
    elif pickle_record_of(records) not in [record for record, _ in check.crc_mismatches]:
        _refuse_missing_storages(records, read_range)  # (one failing its CRC-32 is said so)
    return check


def _refuse_missing_storages(records: tuple[ZipRecord, ...], read_range: ReadRange) -> None:
    """Refuse an object's archive whose data.pkl is no pickle, or names a storage it holds no
    record of: torch.load fails on either (storage_references.py). One past
    MAX_OBJECT_PICKLE_BYTES, or with two records of one name (which torch reads is its zip
    reader's say), is let be."""
    pickle_record = pickle_record_of(records)
    names = {record.name for record in records}
    if pickle_record.size_bytes > MAX_OBJECT_PICKLE_BYTES or len(names) != len(records):
        return
    keys = referenced_storage_keys(read_range(pickle_record.data_offset,
                                              pickle_record.size_bytes))
    prefix = records[0].name.partition("/")[0]
    missing = sorted(key for key in keys if f"{prefix}/data/{key}" not in names)
    if missing:
        raise DataError(f"data.pkl names storage {missing[0]!r}, of which the archive holds no "
                        f"record {prefix}/data/{missing[0]} (torch.load fails on it)")


class _OutsideWindows(Exception):
    """A byte the streamed check needs lies in neither window."""


class ArchiveStreamCheck:
    """Fed an archive in order with `update`, checks it at `finish` (see the module docstring)."""

    def __init__(self, window_bytes: int = DEFAULT_WINDOW_BYTES) -> None:
        self._window_bytes = window_bytes
        self._head: list[bytes] = []
        self._head_bytes = 0
        self._tail: collections.deque[bytes] = collections.deque()
        self._tail_bytes = 0
        self._tail_start = 0
        self._crc_before_tail = 0
        self.length_bytes = 0

    def update(self, piece: bytes) -> None:
        """Take the next piece of the archive."""
        if not piece:
            return
        self.length_bytes += len(piece)
        if self._head_bytes < self._window_bytes:
            kept = memoryview(piece)[:self._window_bytes - self._head_bytes]  # no copy
            self._head.append(kept)
            self._head_bytes += len(kept)
        self._tail.append(piece)
        self._tail_bytes += len(piece)
        while self._tail_bytes - len(self._tail[0]) >= self._window_bytes:
            leaving = self._tail.popleft()
            self._crc_before_tail = zlib.crc32(leaving, self._crc_before_tail)
            self._tail_start += len(leaving)
            self._tail_bytes -= len(leaving)

    def starts_with(self, prefix: bytes) -> bool:
        """Whether what was fed so far starts with prefix."""
        return bytes(_joined(self._head)[:len(prefix)]) == prefix

    def finish(self, expect_tensor: bool, open_random_access: RandomAccessOpener) -> ArchiveCheck:
        """Check what was fed: records, the tensor when expected, every CRC-32."""
        head = _joined(self._head)
        # an archive the head holds whole (most items) needs no tail of its own
        tail = head if self._head_bytes == self.length_bytes else _joined(self._tail)
        read_window = self._window_reader(head, tail)
        try:
            records = tuple(read_zip_records(read_window, self.length_bytes))
            return _check_records(records, self.length_bytes, expect_tensor, read_window,
                                  lambda record: self._record_crc(record, head, tail))
        except _OutsideWindows:
            with open_random_access() as read_range:
                return check_archive(read_range, self.length_bytes, expect_tensor)

    def _window_reader(self, head: memoryview, tail: memoryview) -> ReadRange:
        def read_window(start: int, count: int) -> bytes:
            if start + count <= len(head):
                return bytes(head[start:start + count])
            if self._tail_start <= start and start + count <= self.length_bytes:
                return bytes(tail[start - self._tail_start:start - self._tail_start + count])
            raise _OutsideWindows

        return read_window

    def _record_crc(self, record: ZipRecord, head: memoryview, tail: memoryview) -> int:
        start, end, tail_start = record.data_offset, record.data_end, self._tail_start
        if end <= len(head):
            return zlib.crc32(head[start:end])
        if start >= tail_start:
            return zlib.crc32(tail[start - tail_start:end - tail_start])
        if start > len(head) or end < tail_start:
            raise _OutsideWindows
        crc_before = zlib.crc32(head[:start])
        crc_through = zlib.crc32(tail[:end - tail_start], self._crc_before_tail)
        return crc32_of_span(crc_before, crc_through, end - start)


def _joined(parts) -> memoryview:
    """The parts as one buffer: the one part itself when there is one, uncopied."""
    if len(parts) == 1:
        return memoryview(parts[0]).cast("B")
    return memoryview(b"".join(parts))


@contextlib.contextmanager
def spooled_read_range(pieces: Iterable[bytes]) -> Iterator[ReadRange]:
    """Random reads over a stream, spooled to a temporary file (never held in memory)."""
    with tempfile.TemporaryFile(prefix="dcpctl-") as spool:
        for piece in pieces:
            spool.write(piece)
        spool.flush()
        descriptor = spool.fileno()

        def read_range(start: int, count: int) -> bytes:
            return os.pread(descriptor, count, start)

        yield read_range

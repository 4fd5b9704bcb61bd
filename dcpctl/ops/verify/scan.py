"""The data pass of `verify`: each file read once, hashed against SHA256SUMS while every item in
it is checked as its bytes go by (decoded through its transforms, every torch.save record's
CRC-32, dtype and shape against the metadata).

Work is split into units run by a pool of threads: a file with a checksum to match is one unit
(a SHA-256 runs front to back), a file without one is cut into units of about 64 MiB of items.
hashlib, zlib.crc32 and zstd let go of the GIL, so the threads use the cores; each holds a few
pieces of at most 4 MiB, so memory is bounded by threads, not by checkpoint size.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
import os
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from dcpctl.errors import DataError, UnsafePathError, UnsupportedLayoutError
from dcpctl.format.torch_save.archive_check import ArchiveCheck, ArchiveStreamCheck, spooled_read_range
from dcpctl.format.checkpoint.view import resolve_inside
from dcpctl.format.codecs.registry import Codec, codec_for_descriptors
from dcpctl.format.checkpoint.items import read_safetensors_header
from dcpctl.format.torch_save.layout import max_tensor_archive_bytes
from dcpctl.ops.verify.structure import Problem, StoredItem

PIECE_BYTES = 4 << 20
_UNIT_BYTES = 64 << 20


@dataclass
class ScanUnit:
    """One thread's work: items of one file (sorted by offset), and the file's expected SHA-256
    when the whole file is to be hashed."""

    name: str
    path: Path
    expected_sha256: str | None = None
    archive_items: list[StoredItem] = field(default_factory=list)
    safetensors_items: list[StoredItem] = field(default_factory=list)
    read_bytes: int = 0


def plan_scan(directory: Path, archive_items: list[StoredItem],
              safetensors_items: list[StoredItem], sums: dict[str, str]) -> list[ScanUnit]:
    """The units that hash every file listed in `sums` and check the given items, largest
    first. Files that are missing or unsafe to open are left out (reported elsewhere)."""
    archives_by_file: dict[str, list[StoredItem]] = defaultdict(list)
    for item in archive_items:
        archives_by_file[item.storage.relative_path].append(item)
    safetensors_by_file: dict[str, list[StoredItem]] = defaultdict(list)
    for item in safetensors_items:
        safetensors_by_file[item.storage.relative_path].append(item)
    units = []
    for name in sorted({*sums, *archives_by_file, *safetensors_by_file}):
        try:
            path = resolve_inside(directory, name)
            size_bytes = path.stat().st_size
        except (OSError, UnsafePathError):
            continue
        items = sorted(archives_by_file[name], key=lambda item: item.storage.offset)
        if name in sums:
            units.append(ScanUnit(name, path, sums[name], items, safetensors_by_file[name],
                                  size_bytes))
            continue
        units += _split_into_units(name, path, items)
        if safetensors_by_file[name]:
            units.append(ScanUnit(name, path, safetensors_items=safetensors_by_file[name]))
    return sorted(units, key=lambda unit: -unit.read_bytes)


def _split_into_units(name: str, path: Path, items: list[StoredItem]) -> list[ScanUnit]:
    units: list[ScanUnit] = []
    for item in items:
        if not units or units[-1].read_bytes >= _UNIT_BYTES:
            units.append(ScanUnit(name, path))
        units[-1].archive_items.append(item)
        units[-1].read_bytes += item.storage.length
    return units


def run_scan(units: list[ScanUnit], threads: int,
             on_progress: Callable[[int, int], None] | None = None) -> list[Problem]:
    """Run the units on `threads` threads; the problems they found. on_progress(done_bytes,
    total_bytes) follows the reading."""
    total_bytes = sum(unit.read_bytes for unit in units)

    def advance(done_bytes: int) -> None:
        if on_progress is not None:
            on_progress(done_bytes, total_bytes)

    with ThreadPoolExecutor(max_workers=threads) as pool:
        found = list(pool.map(lambda unit: _scan_unit(unit, advance), units))
    return [problem for problems in found for problem in problems]


def _scan_unit(unit: ScanUnit, advance: Callable[[int], None]) -> list[Problem]:
    problems = []
    try:
        with open(unit.path, "rb", buffering=0) as stream:
            cursor = _FileCursor(stream.fileno(), unit.expected_sha256 is not None, advance)
            for item in unit.archive_items:
                problems += check_archive_item(item, unit.name, cursor)
            for item in unit.safetensors_items:
                problems += check_safetensors_item(item, unit.name, unit.path)
            if unit.expected_sha256 is not None:
                actual = cursor.hash_to_end()
                if actual != unit.expected_sha256:
                    problems.append(Problem(
                        "checksum-mismatch", f"SHA-256 is {actual}, SHA256SUMS says "
                        f"{unit.expected_sha256}", unit.name, 0, cursor.position,
                        tuple(dict.fromkeys(item.fqn for item in unit.archive_items))))
    except OSError as error:
        problems.append(Problem("read-error", f"cannot read: {error.strerror or error}",
                                unit.name))
    return problems


class _FileCursor:
    """Reads one file for a unit. When hashing, item ranges are read front to back and the
    bytes between and after them too, so each byte is read and hashed once."""

    def __init__(self, descriptor: int, hashing: bool, advance: Callable[[int], None]) -> None:
        self.descriptor = descriptor
        self.digest = hashlib.sha256() if hashing else None
        self.position = 0
        self.advance = advance

    def open_range(self, start: int, length: int) -> _RangeReader:
        """A reader of bytes [start, start + length); hashed in passing when it can be."""
        sequential = self.digest is not None and start >= self.position
        if sequential:
            self._hash_until(start)
        return _RangeReader(self, start, length, sequential)

    def hash_to_end(self) -> str:
        """Hash the rest of the file; its hex SHA-256."""
        self._hash_until(None)
        return self.digest.hexdigest()

    def _hash_until(self, offset: int | None) -> None:
        while offset is None or self.position < offset:
            wanted = PIECE_BYTES if offset is None else min(PIECE_BYTES, offset - self.position)
            piece = os.pread(self.descriptor, wanted, self.position)
            if not piece:
                return
            self.take(piece)

    def take(self, piece: bytes) -> None:
        """Count (and hash) bytes read in order at the current position."""
        self.digest.update(piece)
        self.position += len(piece)
        self.advance(len(piece))


class _RangeReader:
    """`read(size)` over a byte range of the cursor's file."""

    def __init__(self, cursor: _FileCursor, start: int, length: int, sequential: bool) -> None:
        self._cursor = cursor
        self._position = start
        self._end = start + length
        self._sequential = sequential

    def read(self, size: int = -1) -> bytes:
        wanted = self._end - self._position
        if size is not None and 0 <= size < wanted:
            wanted = size
        piece = os.pread(self._cursor.descriptor, wanted, self._position) if wanted else b""
        self._position += len(piece)
        if len(piece) < wanted:
            self._end = self._position
        if self._sequential:
            self._cursor.take(piece)
        elif self._cursor.digest is None:
            self._cursor.advance(len(piece))
        return piece


def check_archive_item(item: StoredItem, file_name: str, cursor: _FileCursor) -> list[Problem]:
    """Decode one torch.save item and check its records and tensor."""
    storage = item.storage
    where = dict(file=file_name, start=storage.offset, end=item.end, fqns=(item.fqn,))
    try:
        codec = codec_for_descriptors(storage.transform_descriptors)
    except UnsupportedLayoutError as error:
        return [Problem("unsupported-transform", f"item cannot be decoded: {error}", **where)]
    stream_check = ArchiveStreamCheck()
    decoded = codec.open_reader(cursor.open_range(storage.offset, storage.length))
    max_bytes = max_tensor_archive_bytes(item.chunk_nbytes) \
        if item.tensor is not None and codec.descriptors else math.inf
    decoded_bytes = 0
    try:
        while piece := decoded.read(PIECE_BYTES):
            decoded_bytes += len(piece)
            if decoded_bytes > max_bytes:
                raise DataError(f"more than {max_bytes} bytes come out, more than a torch.save "
                                "archive of its chunk holds")
            stream_check.update(piece)
    except DataError as error:
        return [Problem("decode", f"item does not decode: {error}", **where)]
    if item.tensor is None and not stream_check.starts_like_zip():
        return []  # raw bytes: nothing more to check
    try:
        archive = stream_check.finish(item.tensor is not None,
                                      lambda: _open_random_access(cursor, item, codec))
    except DataError as error:
        return [Problem("archive", f"item is not an intact torch.save archive: {error}", **where)]
    return _archive_problems(item, archive, codec, where)


@contextlib.contextmanager
def _open_random_access(cursor: _FileCursor, item: StoredItem, codec: Codec):
    """Random reads of the decoded item: straight from the file when stored plainly, else
    decoded once more into a temporary file."""
    storage = item.storage
    if not codec.descriptors:
        yield lambda start, count: os.pread(cursor.descriptor, count, storage.offset + start)
        return
    decoded = codec.open_reader(_RangeReader(cursor, storage.offset, storage.length, False))
    with spooled_read_range(iter(lambda: decoded.read(PIECE_BYTES), b"")) as read_range:
        yield read_range


def _archive_problems(item: StoredItem, archive: ArchiveCheck, codec: Codec,
                      where: dict) -> list[Problem]:
    problems = []
    decoded = "decoded " if codec.descriptors else ""
    for record, actual_crc in archive.crc_mismatches:
        place = dict(where)
        if not codec.descriptors:
            place.update(start=item.storage.offset + record.data_offset,
                         end=item.storage.offset + record.data_end)
        problems.append(Problem(
            "crc-mismatch", f"record {record.name!r} (bytes {record.data_offset}.."
            f"{record.data_end} of the {decoded}item) has CRC-32 {actual_crc:08x}, its archive "
            f"says {record.crc32:08x}", **place))
    if archive.layout_error is not None:
        problems.append(Problem("archive", f"tensor item is not a torch.save archive of one "
                                f"tensor: {archive.layout_error}", **where))
    layout = archive.layout
    if layout is None or item.tensor is None:
        return problems
    saved, expected_sizes = layout.tensor, tuple(item.chunk.sizes)
    if saved.dtype != item.tensor.dtype or saved.shape != expected_sizes:
        problems.append(Problem(
            "tensor-mismatch", f"item holds a {saved.dtype.name} tensor of shape "
            f"{list(saved.shape)}; the metadata says {item.tensor.dtype.name} "
            f"{list(expected_sizes)}", **where))
    elif layout.storage.size_bytes != item.chunk_nbytes:
        problems.append(Problem(
            "stored-length", f"storage record {layout.storage.name!r} holds "
            f"{layout.storage.size_bytes} bytes; the chunk has {item.chunk_nbytes}", **where))
    return problems


def check_safetensors_item(item: StoredItem, file_name: str, path: Path) -> list[Problem]:
    """Check a tensor of a SAFETENSORS-serialized file against its blob's header."""
    where = dict(file=file_name, start=item.storage.offset, end=item.end, fqns=(item.fqn,))
    try:
        header, data_start = read_safetensors_header(path, item.storage.offset)
        entry = header.get(item.fqn)
        begin, end = entry["data_offsets"]
        dtype_code, shape = entry["dtype"], tuple(entry["shape"])
    except DataError as error:
        return [Problem("safetensors-header", str(error).removeprefix(f"{path}: "), **where)]
    except (TypeError, KeyError, ValueError):
        return [Problem("safetensors-header", "the safetensors header has no valid entry for "
                        "this fqn", **where)]
    expected_sizes = tuple(item.chunk.sizes)
    if dtype_code != item.tensor.dtype.safetensors_code or shape != expected_sizes:
        return [Problem("tensor-mismatch", f"header gives {dtype_code} {list(shape)}; the "
                        f"metadata says {item.tensor.dtype.name} {list(expected_sizes)}", **where)]
    file_bytes = path.stat().st_size
    if end - begin != item.chunk_nbytes or data_start + end > file_bytes:
        return [Problem("stored-length", f"header places the tensor at bytes "
                        f"{data_start + begin}..{data_start + end} for a chunk of "
                        f"{item.chunk_nbytes} bytes in a file of {file_bytes}", **where)]
    return []

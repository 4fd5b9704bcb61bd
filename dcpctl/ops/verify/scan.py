"""The data pass of `verify`: each file read once, hashed against SHA256SUMS while every item in
it is checked as its bytes go by (decoded through its transforms, every torch.save record's
CRC-32, dtype and shape against the metadata).

Work is split into units run by a pool of threads: a file with a checksum to match is one unit
(a SHA-256 runs front to back), a file without one is cut into units of about 64 MiB of items.
hashlib, zlib.crc32 and zstd let go of the GIL, so the threads use the cores; each holds a few
pieces of at most 4 MiB, so memory is bounded by threads, not by checkpoint size.
"""

from __future__ import annotations

import dataclasses
import hashlib
import zlib
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Callable, Iterator

from dcpctl.errors import DcpctlError, UnsafePathError, UnsupportedLayoutError
from dcpctl.format.checkpoint.checksums import checksum_mismatch
from dcpctl.format.checkpoint.item_check import ItemCheck, NotAnArchiveError
from dcpctl.format.checkpoint.items import iter_decoded_item
from dcpctl.format.checkpoint.locations import ItemLocation, locate_item
from dcpctl.format.checkpoint.problems import Problem, Rule
from dcpctl.format.checkpoint.structure import (StoredItem, is_safetensors_tensor,
                                                safetensors_files)
from dcpctl.format.checkpoint.rank_metadata import ItemKey, replicated_keys
from dcpctl.format.checkpoint.view import Checkpoint, resolve_inside
from dcpctl.format.safetensors import read_safetensors_header
from dcpctl.storage.objects import StorageError
from dcpctl.storage.paths import RangedFile, StoragePath, open_ranged
from dcpctl.thread_pools import thread_pool

PIECE_BYTES = 4 << 20
_UNIT_BYTES = 64 << 20


@dataclass(slots=True)
class ArchiveItem:
    """An item read as a torch.save archive (or raw bytes): what the metadata says of it and
    where and how its bytes are stored."""

    item: StoredItem
    location: ItemLocation
    compared: bool = False
    """Whether what it holds is compared with another copy of it (a replica of a checkpoint
    read from its ranks' own metadata, or the copy kept of one): its content_crcs are kept."""


ItemPlace = tuple[str, int, str]
"""Where an item is stored: its file, the offset its storage entry gives and its fqn (the
tensors of a SAFETENSORS file all give the offset of the file's one blob)."""


@dataclass
class ScanUnit:
    """One thread's work: items of one file (sorted by offset); whether the whole file is
    hashed, and the SHA-256 it must have (None: none known). The scan fills in `sha256`."""

    name: str
    path: StoragePath
    hashing: bool = False
    expected_sha256: str | None = None
    archive_items: list[ArchiveItem] = field(default_factory=list)
    safetensors_items: list[StoredItem] = field(default_factory=list)
    read_bytes: int = 0
    sha256: str | None = None
    compared_safetensors: frozenset[str] = frozenset()
    """The fqns of its safetensors items that are compared (as ArchiveItem.compared)."""
    content_crcs: dict[ItemPlace, tuple | None] = field(default_factory=dict)
    """The scan fills in what each compared item holds (ItemCheck.content_crcs; a safetensors
    tensor's CRC-32), by place."""


def plan_scan(directory: StoragePath, archive_items: list[ArchiveItem],
              safetensors_items: list[StoredItem], sums: dict[str, str | None],
              compared: set[ItemKey] = frozenset()
              ) -> list[ScanUnit]:
    """The units that hash every file named in `sums` (against the digest given, if any) and
    check the given items, largest first, the safetensors tensors whose keys are compared
    (rank_metadata.replicated_keys) read to be compared. Files that are missing or unsafe to
    open are left out (reported elsewhere)."""
    archives_by_file: dict[str, list[ArchiveItem]] = defaultdict(list)
    for archive in archive_items:
        archives_by_file[archive.item.storage.relative_path].append(archive)
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
        archives = sorted(archives_by_file[name], key=lambda archive: archive.location.start)
        tensors = safetensors_by_file[name]
        compared_tensors = frozenset(item.fqn for item in tensors
                                     if compared and stored_item_key(item) in compared)
        if name in sums:
            units.append(ScanUnit(name, path, True, sums[name], archives, tensors, size_bytes,
                                  compared_safetensors=compared_tensors))
            continue
        units += _split_into_units(name, path, archives)
        if tensors:
            units.append(ScanUnit(name, path, safetensors_items=tensors,
                                  compared_safetensors=compared_tensors))
    return sorted(units, key=lambda unit: -unit.read_bytes)


def items_to_check(checkpoint: Checkpoint | None, items: list[StoredItem], deep: bool = True
                   ) -> tuple[list[ArchiveItem], list[StoredItem], list[Problem]]:
    """For a deep check, the items to read, in two kinds: torch.save items (or raw bytes) that
    lie whole inside a file that is there, and tensors of SAFETENSORS-serialized files; and
    the problems of items under transforms dcpctl cannot decode."""
    archive_items: list[ArchiveItem] = []
    safetensors_items: list[StoredItem] = []
    undecodable: list[Problem] = []
    if not deep or checkpoint is None:
        return archive_items, safetensors_items, undecodable
    safetensors_names = safetensors_files(checkpoint)
    compared = replicated_keys(checkpoint.replicas)  # each copy compared with the kept one
    for item in items:
        size_bytes = checkpoint.files[item.storage.relative_path].size_bytes
        if size_bytes is None:
            continue
        if is_safetensors_tensor(item, safetensors_names):
            safetensors_items.append(item)
        elif item.end <= size_bytes:
            try:
                location = locate_item(checkpoint, item.fqn, item.storage, item.expected)
            except UnsupportedLayoutError as error:
                undecodable.append(Problem(
                    Rule.UNSUPPORTED_TRANSFORM, f"item cannot be decoded: {error.message}",
                    item.storage.relative_path, item.storage.offset, item.end, (item.fqn,)))
                continue
            archive_items.append(ArchiveItem(item, location, stored_item_key(item) in compared))
    return archive_items, safetensors_items, undecodable


def stored_item_key(item: StoredItem) -> ItemKey:
    """The ItemKey (rank_metadata.py) of an item: what its copies share."""
    return item.fqn, None if item.chunk is None else tuple(item.chunk.offsets)


def _split_into_units(name: str, path: StoragePath, archives: list[ArchiveItem]) -> list[ScanUnit]:
    units: list[ScanUnit] = []
    for archive in archives:
        if not units or units[-1].read_bytes >= _UNIT_BYTES:
            units.append(ScanUnit(name, path))
        units[-1].archive_items.append(archive)
        units[-1].read_bytes += archive.location.length
    return units


def scan_units(units: list[ScanUnit], threads: int, advance: Callable[[int], None]
               ) -> list[Problem]:
    """Run the units on `threads` threads; the problems they found. advance(bytes) follows
    the reading."""
    with thread_pool(threads, "dcpctl-verify") as pool:
        found = list(pool.map(lambda unit: _scan_unit(unit, advance), units))
    return [problem for problems in found for problem in problems]


def _scan_unit(unit: ScanUnit, advance: Callable[[int], None]) -> list[Problem]:
    problems = []
    try:
        with open_ranged(unit.path) as reader:
            cursor = _FileCursor(reader, unit, advance)
            try:
                for archive in unit.archive_items:
                    problems += check_archive_item(archive, unit.name, cursor,
                                                   unit.content_crcs)
                for item in unit.safetensors_items:
                    problems += check_safetensors_item(
                        item, unit.name, unit.path, unit.content_crcs
                        if item.fqn in unit.compared_safetensors else None)
                if unit.hashing:
                    actual = unit.sha256 = cursor.hash_to_end()
                    if unit.expected_sha256 is not None and actual != unit.expected_sha256:
                        problems.append(checksum_mismatch(
                            unit.name, actual, unit.expected_sha256, cursor.position,
                            tuple(dict.fromkeys(archive.item.fqn
                                                for archive in unit.archive_items))))
            finally:
                cursor.close()
    except OSError as error:
        problems.append(Problem(Rule.READ_ERROR, f"cannot read: {error.strerror or error}",
                                unit.name))
    return problems


_SKIP_WITHOUT_READING_BYTES = 1 << 20
"""A gap between items (not hashed) past which the stream starts again after it rather than
reading through it."""


class _FileCursor:
    """Reads a unit's file as one stream, front to back (an object's pieces fetched ahead, so
    a thousand small items cost a few large GETs, not a thousand), and hands each item its
    bytes as the stream passes them. When hashing, the bytes between and after the items are
    read and hashed too, so each byte is read and hashed once. An item that starts behind the
    stream (one overlapping another) is read on its own."""

    def __init__(self, reader: RangedFile, unit: ScanUnit, advance: Callable[[int], None]
                 ) -> None:
        self.reader = reader
        self.digest = hashlib.sha256() if unit.hashing else None
        self.advance = advance
        if unit.hashing:
            self.position, self._end = 0, reader.size()
        else:
            self.position = min((archive.location.start for archive in unit.archive_items),
                                default=0)
            self._end = max((archive.location.end for archive in unit.archive_items),
                            default=0)
        self._pieces = reader.iter_pieces(self.position, self._end, PIECE_BYTES)
        self._piece = memoryview(b"")

    def iter_range(self, start: int, length: int, again: bool = False) -> Iterator[bytes]:
        """Bytes [start, start + length) in pieces, ending early where the file does.
        again: a second read of bytes already counted, not taken from the stream."""
        if again or start < self.position:
            for piece in self.reader.iter_pieces(start, start + length, PIECE_BYTES):
                if not again and self.digest is None:
                    self.advance(len(piece))
                yield piece
            return
        self._skip_to(start)
        remaining = length
        while remaining > 0:
            piece = self._next(remaining)
            if not piece:
                return
            remaining -= len(piece)
            self._count(piece, item_bytes=True)
            yield piece

    def hash_to_end(self) -> str:
        """Hash the rest of the file; its hex SHA-256."""
        self._skip_to(None)
        return self.digest.hexdigest()

    def close(self) -> None:
        """Stop the stream (an object's pieces still on their way are dropped)."""
        self._pieces.close()

    def _skip_to(self, offset: int | None) -> None:
        """Move the stream to offset (None: the end), hashing what it passes when hashing."""
        if (self.digest is None and offset is not None
                and offset - self.position > _SKIP_WITHOUT_READING_BYTES):
            self._pieces.close()
            self._pieces = self.reader.iter_pieces(offset, self._end, PIECE_BYTES)
            self._piece, self.position = memoryview(b""), offset
            return
        while offset is None or self.position < offset:
            piece = self._next(None if offset is None else offset - self.position)
            if not piece:
                return
            self._count(piece, item_bytes=False)

    def _next(self, at_most: int | None) -> bytes | memoryview:
        """The stream's next bytes, at most at_most of them (None: a whole piece); b"" at
        its end. Part of a piece is a view of it, not a copy (a thousand small items a
        gigabyte): it keeps that piece, read-only, alive while an item's check holds it."""
        if not self._piece:
            self._piece = memoryview(next(self._pieces, b""))
        taken = self._piece if at_most is None else self._piece[:at_most]
        self._piece = self._piece[len(taken):]
        self.position += len(taken)
        return taken if len(taken) < len(taken.obj) else taken.obj

    def _count(self, piece: bytes, item_bytes: bool) -> None:
        """Hash and count bytes read in order (bytes between items count only when hashed)."""
        if self.digest is not None:
            self.digest.update(piece)
        if self.digest is not None or item_bytes:
            self.advance(len(piece))


def check_archive_item(archive: ArchiveItem, file_name: str, cursor: _FileCursor,
                       content_crcs: dict[ItemPlace, tuple | None]) -> list[Problem]:
    """Decode one torch.save item and check it as every command does (item_check.py); a
    compared item's content_crcs go into content_crcs."""
    item, location = archive.item, archive.location
    check = ItemCheck(location)
    try:
        for piece in iter_decoded_item(location,
                                       cursor.iter_range(location.start, location.length)):
            check.feed(piece)
    except NotAnArchiveError as error:
        return [dataclasses.replace(error.problem, file=file_name)]
    except StorageError:  # the store failed, not the item: no problem of the checkpoint's
        raise
    except DcpctlError as error:
        return [Problem(Rule.DECODE, f"item does not decode: {error.message}", file_name,
                        location.start, location.end, (item.fqn,))]
    problems = check.problems(lambda: iter_decoded_item(
        location, cursor.iter_range(location.start, location.length, again=True)))
    if archive.compared:
        content_crcs[(file_name, item.storage.offset, item.fqn)] = check.content_crcs()
    return [dataclasses.replace(problem, file=file_name) for problem in problems]


def check_safetensors_item(item: StoredItem, file_name: str, path: StoragePath,
                           content_crcs: dict[ItemPlace, tuple | None] | None = None
                           ) -> list[Problem]:
    """Check a tensor of a SAFETENSORS-serialized file against its blob's header; given
    content_crcs, its header entry and the CRC-32 of its bytes go there, by place."""
    where = dict(file=file_name, start=item.storage.offset, end=item.end, fqns=(item.fqn,))
    try:
        header, data_start = read_safetensors_header(path, item.storage.offset)
        entry = header.get(item.fqn)
        begin, end = entry["data_offsets"]
        dtype_code, shape = entry["dtype"], tuple(entry["shape"])
    except StorageError:
        raise
    except DcpctlError as error:
        return [Problem(Rule.SAFETENSORS_HEADER, error.message, **where)]
    except (TypeError, KeyError, ValueError):
        return [Problem(Rule.SAFETENSORS_HEADER, "the safetensors header has no valid entry for "
                        "this fqn", **where)]
    expected_sizes = tuple(item.chunk.sizes)
    dtype = item.tensor.dtype
    if dtype_code != dtype.safetensors_code or shape != dtype.safetensors_shape(expected_sizes):
        return [Problem(Rule.TENSOR_MISMATCH, f"header gives {dtype_code} {list(shape)}; the "
                        f"metadata says {item.tensor.dtype.name} {list(expected_sizes)}", **where)]
    file_bytes = path.stat().st_size
    if end - begin != item.chunk_nbytes or data_start + end > file_bytes:
        return [Problem(Rule.STORED_LENGTH, f"header places the tensor at bytes "
                        f"{data_start + begin}..{data_start + end} for a chunk of "
                        f"{item.chunk_nbytes} bytes in a file of {file_bytes}", **where)]
    if content_crcs is not None:
        crc = 0
        with open_ranged(path) as reader:
            for piece in reader.iter_pieces(data_start + begin, data_start + end, PIECE_BYTES):
                crc = zlib.crc32(piece, crc)
        content_crcs[(file_name, item.storage.offset, item.fqn)] = ((dtype_code, shape), crc)
    return []

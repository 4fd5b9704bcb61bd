"""The files trainers keep in a DCP checkpoint directory beside torch's own.

Megatron-Core's `torch_dist` saver writes `common.pt` (the state common to all ranks, one
torch.save file) and `metadata.json` (its backend: without it Megatron's loader says the
directory "is not a distributed checkpoint") next to `.metadata` and the `.distcp` files.
Lightning's sharded checkpoints (Fabric's and the Trainer's FSDP and ModelParallel strategies)
hold `meta.pt`, a torch.save file of the state that is not the model's or the optimizers'
(step, loops, hyperparameters): Lightning takes a directory for a sharded checkpoint only where
it is there. They belong to the checkpoint: `verify` checks them against SHA256SUMS and does not
call them unknown, `checksum` hashes them, and every command that writes a new checkpoint
directory carries them over byte for byte (they do not depend on the layout of the DCP files).
`common.pt` and `meta.pt` are torch.save archives: their records are checked against their
CRC-32s as an item's are, and `metadata.json` must be what Megatron's loader reads
(side_file_problems), by verify, by checksum before it certifies them, and before they are
carried.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import stat
from pathlib import Path
from typing import Callable, Iterable, Iterator

from dcpctl.errors import ChangedWhileReadError, DataError, UnsafePathError
from dcpctl.format.checkpoint.hf_storage import hf_storage_extra_files
from dcpctl.format.checkpoint.problems import Problem, Rule, problems_error
from dcpctl.format.checkpoint.view import (Checkpoint, holds_a_regular_file,
                                           regular_file_inside)
from dcpctl.format.file_names import METADATA_FILE_NAME, rank_of_file_name
from dcpctl.format.torch_save.archive_check import (ArchiveCheck, ArchiveStreamCheck,
                                                    check_archive, spooled_read_range)
from dcpctl.format.torch_save.zip_records import ReadRange, read_central_directory
from dcpctl.storage.file_digests import HASH_PIECE_BYTES
from dcpctl.storage.local import is_temporary_name
from dcpctl.storage.objects import ObjectPath
from dcpctl.storage.paths import (LocalRangedFile, ObjectRangedFile, StoragePath,
                                  file_names_in, open_ranged)

MEGATRON_COMMON_STATE = "common.pt"
MEGATRON_CONFIG = "metadata.json"
LIGHTNING_STATE = "meta.pt"
_SAVER_OF_SIDE_FILE = {MEGATRON_COMMON_STATE: "Megatron-Core torch_dist",
                       MEGATRON_CONFIG: "Megatron-Core torch_dist", LIGHTNING_STATE: "Lightning"}
SIDE_FILE_NAMES = tuple(_SAVER_OF_SIDE_FILE)


def side_files_of(checkpoint: Checkpoint) -> list[str]:
    """The side files this checkpoint holds directly in its directory, that its metadata does
    not name as data files: regular files, or links to one that a data file's link may be
    (view.real_path_inside: inside the directory, or in its hub cache repository's blobs)."""
    return _names_held_by(checkpoint, _A_FILE)


def misplaced_side_files(checkpoint: Checkpoint) -> list[Problem]:
    """A problem for each side file's name that something else holds in the checkpoint's
    directory (a FIFO, a directory, a link out of it): the trainer would read what a link
    leads to, or wait on a FIFO for ever, where dcpctl reads, checks and carries neither, so
    the checkpoint is not the trainer's as saved."""
    return _misplaced(_names_held_by(checkpoint, _SOMETHING_ELSE))


def _misplaced(names: list[str]) -> list[Problem]:
    return [Problem(Rule.NOT_REGULAR_FILE, f"{_SAVER_OF_SIDE_FILE[name]}'s {name} is not a "
                    "regular file here (a FIFO, a directory, or a symlink out of the "
                    "checkpoint)", name)
            for name in names]


_NOTHING, _A_FILE, _SOMETHING_ELSE = "nothing", "a file", "something else"


def _holders(checkpoint: Checkpoint) -> dict[str, str]:
    """What holds each side file's name that the metadata does not name as a data file
    (_NOTHING, _A_FILE, _SOMETHING_ELSE), each name looked at once."""
    names = [name for name in SIDE_FILE_NAMES if name not in checkpoint.files]
    if isinstance(checkpoint.path, ObjectPath):  # an object is a file
        listing = checkpoint.listing or {}
        return {name: _A_FILE if name in listing else _NOTHING for name in names}
    return {name: _held_by(checkpoint.path, name) for name in names}


def _names_held_by(checkpoint: Checkpoint, holder: str) -> list[str]:
    return [name for name, held_by in _holders(checkpoint).items() if held_by == holder]


def _name_taken(directory: StoragePath, name: str) -> bool:
    """Whether anything holds the name in the checkpoint directory (a link too)."""
    if isinstance(directory, ObjectPath):
        return (directory / name).exists()
    return _held_by(directory, name) != _NOTHING


def _held_by(directory: Path, name: str) -> str:
    """What holds a side file's name in a local checkpoint directory (_NOTHING, _A_FILE,
    _SOMETHING_ELSE): a link counts as the file it leads to where a data file's link may lead
    there (view.real_path_inside)."""
    try:
        os.lstat(directory / name)
    except FileNotFoundError:
        return _NOTHING
    return _A_FILE if holds_a_regular_file(directory, name) else _SOMETHING_ELSE


def side_file_bytes(checkpoint: Checkpoint, side_files: Iterable[str]) -> int:
    """The bytes of these side files (side_files_of) that side_file_problems reads, deep:
    the archives whole, at most a MiB of `metadata.json`."""
    sizes = {}
    if isinstance(checkpoint.path, ObjectPath):
        listing = checkpoint.listing or {}
        sizes = {name: listing[name].size for name in side_files if name in listing}
    else:
        for name in side_files:
            with contextlib.suppress(OSError, UnsafePathError):  # gone or changed: not read
                sizes[name] = os.stat(regular_file_inside(checkpoint.path, name)).st_size
    return sum(min(size, _MAX_CONFIG_BYTES + 1) if name == MEGATRON_CONFIG else size
               for name, size in sizes.items())


def carried_side_files(checkpoint: Checkpoint) -> list[str]:
    """The side files a new checkpoint written from this one carries (side_files_of), refused
    (ProblemsError) where a side file's name holds something that is no regular file."""
    holders = _holders(checkpoint)
    misplaced = [name for name, held_by in holders.items() if held_by == _SOMETHING_ELSE]
    if misplaced:
        raise problems_error(_misplaced(misplaced), checkpoint.path)
    return [name for name, held_by in holders.items() if held_by == _A_FILE]


def open_side_file(directory: StoragePath, name: str) -> LocalRangedFile | ObjectRangedFile:
    """A reader of a side file of the checkpoint in directory, whatever was put in its place
    since it was checked: a link is followed only where it leads inside the checkpoint or to
    its hub cache blobs (view.regular_file_inside), and the file it leads to is opened as no
    link."""
    if isinstance(directory, ObjectPath):
        return open_ranged(directory / name)
    return open_ranged(regular_file_inside(directory, name), follow_symlinks=False)


def saver_of_side_files(side_files: Iterable[str]) -> str | None:
    """The trainer that writes these side files (side_files_of), if any."""
    return next((_SAVER_OF_SIDE_FILE[name] for name in side_files), None)


def files_beside_data(checkpoint: Checkpoint) -> list[str]:
    """The checkpoint's own files besides its data files: what `verify` knows and SHA256SUMS
    covers. `.metadata` and the side files; for one torch's HuggingFaceStorageWriter wrote,
    which has no `.metadata`, its index and the rank files consolidation left (hf_storage.py);
    for one saved with use_collectives=False, its ranks' own metadata in place of `.metadata`."""
    if checkpoint.hf_storage:
        names = (checkpoint.listing if checkpoint.listing is not None
                 else file_names_in(checkpoint.path))
        return hf_storage_extra_files(names)
    return [*(checkpoint.rank_metadata or [METADATA_FILE_NAME]), *side_files_of(checkpoint)]


def empty_writer_files(checkpoint: Checkpoint, names: set[str]) -> list[str]:
    """Those of names (files the metadata does not name) that torch's FileSystemWriter left
    empty: it opens a data file per writer thread, so a rank with fewer items than
    `thread_count` writes `__<rank>_<n>.distcp` files of 0 bytes. They hold nothing, so nothing
    checks or copies them, and they are not unknown files."""
    candidates = [name for name in sorted(names)
                  if rank_of_file_name(name) is not None and not is_temporary_name(name)]
    return [name for name, size in _regular_file_sizes(checkpoint, candidates).items()
            if size == 0]


def _regular_file_sizes(checkpoint: Checkpoint, names: list[str]) -> dict[str, int]:
    """The size of each of names that is a regular file of the checkpoint's directory (an
    object under its prefix): never a link, a directory or a missing name."""
    if isinstance(checkpoint.path, ObjectPath):
        listing = checkpoint.listing or {}
        return {name: listing[name].size for name in names if name in listing}
    sizes = {}
    for name in names:
        try:
            status = os.lstat(os.path.join(checkpoint.path, name))
        except FileNotFoundError:
            continue
        if stat.S_ISREG(status.st_mode):
            sizes[name] = status.st_size
    return sizes


def side_file_problems(directory: StoragePath, side_files: Iterable[str], deep: bool = True
                       ) -> list[Problem]:
    """What is wrong with a checkpoint's side files (side_files_of): `common.pt` and `meta.pt`
    must be torch.save archives whose records match their CRC-32s (torch.load does not check
    them) and whose data.pkl torch.load reads, `metadata.json` the UTF-8 JSON object of
    Megatron's fields its loader reads, with `common.pt` beside it. Not deep (the quick check
    of verify --quick, ls and prune), one read of an archive's last 64 KiB: all of a small
    one, checked whole; of a larger one, its end record and central directory, no CRC-32,
    which find a side file cut short (a save killed while writing it, Lightning's last
    file)."""
    side_files = sorted(side_files, key=SIDE_FILE_NAMES.index)
    problems = []
    if (MEGATRON_CONFIG in side_files and MEGATRON_COMMON_STATE not in side_files
            and not _name_taken(directory, MEGATRON_COMMON_STATE)):  # a link: misplaced
        problems.append(Problem(
            Rule.MISSING_FILE, f"missing, though {MEGATRON_CONFIG} is there: Megatron-Core's "
            f"torch_dist saver writes {MEGATRON_COMMON_STATE} first, and its loader reads the "
            "common state from it", MEGATRON_COMMON_STATE))
    for name in side_files:
        with open_side_file(directory, name) as file:
            problems += _problems_of(file, name, deep)
    return problems


def read_checked_side_file(directory: StoragePath, name: str,
                           take: Callable[[bytes], None] = lambda piece: None) -> str:
    """Read a side file of the checkpoint in directory once, front to back, giving each piece
    to take (to copy it), and check those very bytes as side_file_problems checks them (an
    archive streamed through ArchiveStreamCheck): refused (ProblemsError) where damaged, so
    that no bytes are copied or certified but those checked, whatever writes the file
    meanwhile. The hex SHA-256 of what was read. An archive whose records its two windows do
    not hold is checked from a second read, taken only where it hashes the same (else
    ChangedWhileReadError)."""
    digest = hashlib.sha256()
    config = bytearray()
    stream = None if name == MEGATRON_CONFIG else ArchiveStreamCheck()
    with open_side_file(directory, name) as file:
        length = 0
        for piece in file.iter_pieces(0, file.size(), HASH_PIECE_BYTES):
            take(piece)
            digest.update(piece)
            length += len(piece)
            if stream is not None:
                stream.update(piece)
            elif len(config) <= _MAX_CONFIG_BYTES:
                config += piece[:_MAX_CONFIG_BYTES + 1 - len(config)]
        if stream is None:
            problems = _config_problems_of(bytes(config), length)
        else:
            problems = _archive_check_problems(name, lambda: stream.finish(
                expect_tensor=False, open_random_access=lambda: _read_again(
                    file, length, digest.hexdigest(), directory, name)))
    if problems:
        raise problems_error(problems, directory)
    return digest.hexdigest()


@contextlib.contextmanager
def _read_again(file: LocalRangedFile | ObjectRangedFile, length: int, first_digest: str,
                directory: StoragePath, name: str) -> Iterator[ReadRange]:
    """Random reads of a second read of the first length bytes of file, spooled, refused
    unless they hash as the first read did."""
    digest = hashlib.sha256()

    def pieces() -> Iterator[bytes]:
        for piece in file.iter_pieces(0, length, HASH_PIECE_BYTES):
            digest.update(piece)
            yield piece

    with spooled_read_range(pieces()) as read_range:
        if digest.hexdigest() != first_digest:
            raise ChangedWhileReadError(f"{name} changed while dcpctl read it (a trainer "
                                        "writing it?): run the command again", path=directory)
        yield read_range


def _problems_of(file: LocalRangedFile | ObjectRangedFile, name: str, deep: bool = True
                 ) -> list[Problem]:
    if name == MEGATRON_CONFIG:
        return _config_problems(file)
    return _archive_problems(file, name) if deep else _archive_structure_problems(file, name)


_MAX_CONFIG_BYTES = 1 << 20  # Megatron's is a few lines


_CONFIG_FIELDS = {"sharded_backend": str, "sharded_backend_version": int,
                  "common_backend": str, "common_backend_version": int}
"""Megatron-Core's CheckpointingConfig, which its loader builds from the file's keys: the
backend is required; other keys a later Megatron may add are let be."""


def _config_problems(file: LocalRangedFile | ObjectRangedFile) -> list[Problem]:
    size = file.size()
    return _config_problems_of(file.read(0, min(size, _MAX_CONFIG_BYTES + 1)), size)


def _config_problems_of(data: bytes, size: int) -> list[Problem]:
    """What is wrong with a `metadata.json` of size bytes that starts with data (its first
    MiB and a byte)."""
    name = MEGATRON_CONFIG
    try:
        if size > _MAX_CONFIG_BYTES:
            raise ValueError("over 1 MiB")
        config = json.loads(data.decode("utf-8"))  # as Megatron opens it: no BOM, no UTF-16
        if not isinstance(config, dict) or "sharded_backend" not in config or any(
                type(config[key]) is not kind for key, kind in _CONFIG_FIELDS.items()
                if key in config):
            raise ValueError("not an object of Megatron's fields (sharded_backend, ...)")
    except (ValueError, UnicodeDecodeError, RecursionError) as error:
        return [Problem(Rule.DECODE, f"not the JSON object Megatron reads ({error})", name)]
    return []


def _archive_structure_problems(file: LocalRangedFile | ObjectRangedFile, name: str
                                ) -> list[Problem]:
    """The quick check of a side file's archive: one read of its last _TAIL_READ_ONCE_BYTES,
    which holds a small one (Lightning's meta.pt, Megatron's common.pt) whole, checked then
    as deep verify checks it; of a larger one, its zip end record and central directory."""
    try:
        size = file.size()
        if size <= _TAIL_READ_ONCE_BYTES:
            data = file.read(0, size)
            return _archive_check_problems(name, lambda: check_archive(
                lambda start, count: data[start:start + count], len(data),
                expect_tensor=False))
        read_central_directory(_with_tail_read_once(file, size), size)
    except DataError as error:
        return [Problem(Rule.ARCHIVE, f"not a torch.save archive: {error.message}", name)]
    return []


_TAIL_READ_ONCE_BYTES = 64 << 10
"""Where a side file's zip end record, zip64 records and central directory lie, at most, in
the archives trainers write (a few records): one read, not four requests to a store."""


def _with_tail_read_once(file: LocalRangedFile | ObjectRangedFile, size: int) -> ReadRange:
    """Ranged reads of file, those within its last _TAIL_READ_ONCE_BYTES from one read."""
    tail_start = max(0, size - _TAIL_READ_ONCE_BYTES)
    tail = file.read(tail_start, size - tail_start)

    def read_range(start: int, count: int) -> bytes:
        if tail_start <= start and start + count <= tail_start + len(tail):
            return tail[start - tail_start:start - tail_start + count]
        return file.read(start, count)

    return read_range


def _archive_problems(file: LocalRangedFile | ObjectRangedFile, name: str) -> list[Problem]:
    return _archive_check_problems(name, lambda: check_archive(file.read, file.size(),
                                                               expect_tensor=False))


def _archive_check_problems(name: str, check: Callable[[], ArchiveCheck]) -> list[Problem]:
    """What check() of a side file's archive found wrong: its structure, its CRC-32s."""
    try:
        checked = check()
    except ChangedWhileReadError:
        raise
    except DataError as error:
        return [Problem(Rule.ARCHIVE, f"not a torch.save archive: {error.message}", name)]
    return [Problem(Rule.CRC_MISMATCH, f"record {record.name!r} has CRC-32 {actual_crc:08x}, "
                    f"its archive says {record.crc32:08x}", name, record.data_offset,
                    record.data_end)
            for record, actual_crc in checked.crc_mismatches]

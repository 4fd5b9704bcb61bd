"""The checkpoint directories of a training run directory: which ones, their steps, sizes, ages
and state; `ls` lists them and `prune` decides over them."""

from __future__ import annotations

import os
import re
import stat
import time
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path

from dcpctl.errors import CheckpointNotFoundError
from dcpctl.format.file_names import (DATA_FILE_SUFFIX, METADATA_FILE_NAME,
                                      METADATA_TEMPORARY_FILE_NAME, SHA256SUMS_FILE_NAME)
from dcpctl.storage.objects import ObjectInfo, ObjectPath
from dcpctl.storage.paths import StoragePath, storage_path

# A checkpoint name is an optional word (letters, words joined by `_`), an optional `-` or `_`,
# then the step, and nothing after it: step-1000, step_2000, checkpoint-3000, global_step4000,
# 5000. A `-` inside the word or anything after the number (old-step-3-bak, step-3.tmp) means
# the name only looks like a step, so the entry is none of our business.
_CHECKPOINT_NAME = re.compile(r"(?:[A-Za-z]+(?:_[A-Za-z]+)*[-_]?)?([0-9]+)")
_PARTIAL_SAVE_FILES = (DATA_FILE_SUFFIX, METADATA_TEMPORARY_FILE_NAME)


def parse_step(name: str) -> int | None:
    """The step a checkpoint directory name stands for (its whole trailing number), or None."""
    match = _CHECKPOINT_NAME.fullmatch(name)
    return int(match.group(1)) if match else None


@dataclass
class CheckpointEntry:
    """A checkpoint directory of a run; age counts from the newest change anywhere inside it."""

    name: str
    path: StoragePath
    step: int
    complete: bool
    size_bytes: int
    modified_at: float
    age_seconds: float
    has_sha256sums: bool
    identity: tuple[int, int]
    """The directory's device and inode when scanned: what a deletion checks it still is
    ((0, 0) in an object store, which has no directories)."""

    def to_json(self) -> dict:
        """A JSON-ready dict with stable keys."""
        modified = datetime.fromtimestamp(self.modified_at, timezone.utc)
        return {"name": self.name, "path": str(self.path), "step": self.step,
                "complete": self.complete, "size_bytes": self.size_bytes,
                "modified_at": modified.isoformat(timespec="seconds"),
                "age_seconds": round(self.age_seconds), "sha256sums": self.has_sha256sums}


@dataclass
class IgnoredEntry:
    """An entry named like a checkpoint that is not one dcpctl may touch, and why."""

    name: str
    reason: str


@dataclass
class RunDirectoryScan:
    """The checkpoints directly under a run directory, sorted by step, and the look-alikes."""

    path: StoragePath
    checkpoints: list[CheckpointEntry] = field(default_factory=list)
    ignored: list[IgnoredEntry] = field(default_factory=list)

    def to_json(self) -> dict:
        """A JSON-ready dict with stable keys."""
        return {"run_dir": str(self.path),
                "checkpoints": [entry.to_json() for entry in self.checkpoints],
                "ignored": [asdict(entry) for entry in self.ignored]}


def check_run_directory(directory: StoragePath) -> None:
    """Refuse a run directory that is missing, not a directory, or itself a checkpoint."""
    if not directory.is_dir():
        raise CheckpointNotFoundError("no such directory; give the run directory "
                                      "that holds the checkpoint directories", path=directory)
    if (directory / METADATA_FILE_NAME).exists():
        raise CheckpointNotFoundError(f"is a checkpoint itself (holds {METADATA_FILE_NAME}); "
                                      "give the run directory above it", path=directory)


def scan_run_directory(run_dir: str | os.PathLike) -> RunDirectoryScan:
    """Find the checkpoint directories directly under run_dir; never follows a symlink. In an
    object store, one listing of everything under the run's prefix."""
    scan = RunDirectoryScan(storage_path(run_dir))
    check_run_directory(scan.path)
    now = time.time()
    if isinstance(scan.path, ObjectPath):
        _scan_prefixes(scan, now)
        return scan
    for name in sorted(os.listdir(scan.path)):
        step = parse_step(name)
        if step is None:
            continue
        path = scan.path / name
        try:
            reason = _reason_not_a_checkpoint(path)
            if reason is None:
                scan.checkpoints.append(_describe_checkpoint(path, step, now))
            else:
                scan.ignored.append(IgnoredEntry(name, reason))
        except FileNotFoundError:
            continue  # removed while we looked (a trainer purging its own old checkpoints)
    scan.checkpoints.sort(key=lambda entry: (entry.step, entry.name))
    return scan


def _scan_prefixes(scan: RunDirectoryScan, now: float) -> None:
    """The checkpoints under a run's prefix in an object store, from one listing."""
    by_checkpoint: dict[str, dict[str, ObjectInfo]] = {}
    for key, info in scan.path.store.list_tree(scan.path.key).items():
        name, slash, rest = key.partition("/")
        if slash and parse_step(name) is not None:
            by_checkpoint.setdefault(name, {})[rest] = info
    for name, objects in sorted(by_checkpoint.items()):
        reason = _reason_not_a_checkpoint_prefix(set(objects))
        if reason is not None:
            scan.ignored.append(IgnoredEntry(name, reason))
            continue
        modified_at = max(info.modified for info in objects.values())
        scan.checkpoints.append(CheckpointEntry(
            name=name, path=scan.path / name, step=parse_step(name),
            complete=METADATA_FILE_NAME in objects,
            size_bytes=sum(info.size for info in objects.values()), modified_at=modified_at,
            age_seconds=max(0.0, now - modified_at),
            has_sha256sums=SHA256SUMS_FILE_NAME in objects, identity=(0, 0)))
    scan.checkpoints.sort(key=lambda entry: (entry.step, entry.name))


def _reason_not_a_checkpoint_prefix(names: set[str]) -> str | None:
    if METADATA_FILE_NAME in names or any(name.endswith(_PARTIAL_SAVE_FILES) for name in names):
        return None
    return f"no {METADATA_FILE_NAME} and no .distcp files: not a DCP checkpoint"


def _reason_not_a_checkpoint(path: Path) -> str | None:
    mode = os.lstat(path).st_mode
    if stat.S_ISLNK(mode):
        return "a symlink: never followed, never deleted"
    if not stat.S_ISDIR(mode):
        return "not a directory"
    if (path / METADATA_FILE_NAME).is_file():
        return None
    names = os.listdir(path)
    # A save in progress (or one that died) holds data files or `.metadata.tmp`, or nothing yet.
    if not names or any(name.endswith(_PARTIAL_SAVE_FILES) for name in names):
        return None
    return f"no {METADATA_FILE_NAME} and no .distcp files: not a DCP checkpoint"


def _describe_checkpoint(path: Path, step: int, now: float) -> CheckpointEntry:
    status = os.lstat(path)
    size_bytes, modified_at = _measure_directory(path)
    return CheckpointEntry(
        name=path.name, path=path, step=step,
        complete=(path / METADATA_FILE_NAME).is_file(), size_bytes=size_bytes,
        modified_at=modified_at, age_seconds=max(0.0, now - modified_at),
        has_sha256sums=(path / SHA256SUMS_FILE_NAME).is_file(),
        identity=(status.st_dev, status.st_ino))


def _measure_directory(path: Path) -> tuple[int, float]:
    """Bytes of the regular files under path and the newest mtime of path and anything in it;
    symlinks inside count as themselves and are not followed."""
    size_bytes, newest = 0, os.lstat(path).st_mtime
    pending = [os.fspath(path)]  # no recursion: a tree planted deep inside is only long
    while pending:
        try:
            with os.scandir(pending.pop()) as entries:
                for entry in entries:
                    try:
                        status = entry.stat(follow_symlinks=False)
                    except FileNotFoundError:
                        continue  # a save in progress renames its temporary files
                    newest = max(newest, status.st_mtime)
                    if stat.S_ISREG(status.st_mode):
                        size_bytes += status.st_size
                    elif stat.S_ISDIR(status.st_mode):
                        pending.append(entry.path)
        except OSError:
            continue  # gone or replaced since it was listed, or not ours to read
    return size_bytes, newest

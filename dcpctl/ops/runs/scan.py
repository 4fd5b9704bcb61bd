"""The checkpoint directories of a training run directory: which ones, their steps, sizes, ages
and state; `ls` lists them and `prune` decides over them."""

from __future__ import annotations

import contextlib
import json
import os
import posixpath
import re
import stat
import time
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Mapping

from dcpctl.errors import CheckpointNotFoundError
from dcpctl.format.file_names import METADATA_FILE_NAME, rank_metadata_file_name
from dcpctl.ops.runs.layouts import (LIGHTNING_CHECKPOINT_NAME, MEGATRON_TRACKER,
                                     MEGATRON_TRACKER_MAX_BYTES, METADATA_IS_A_DIRECTORY,
                                     TRAINER_LAST_WRITTEN, CheckpointShape, checkpoint_shape,
                                     parse_tracked_iteration,
                                     refuse_a_checkpoint_as_run_directory)
from dcpctl.storage.local import mount_points_at_or_inside
from dcpctl.storage.objects import ObjectInfo, ObjectPath
from dcpctl.storage.paths import StoragePath, file_names_in, open_ranged, read_whole, storage_path

# A checkpoint directory is named by a word trainers name one by (torchtitan's step-1000,
# step_2000, the HF Trainer's checkpoint-3000, accelerate's checkpoint_3, DeepSpeed's
# global_step4000, Megatron's iter_0000100, torchtune's dist_epoch_3), an optional `-` or `_`,
# then the number and nothing after it; or by the number alone (5000); or as Lightning names
# its checkpoints by default (epoch=2-step=300.ckpt: layouts.LIGHTNING_CHECKPOINT_NAME). Any
# other name is none of our business, whatever it holds: llama3 or ckpt_v2 (a model's or a
# version's number, the user's own weights), old-step-3-bak, step-3.tmp.
_STEP_WORDS = ("step", "steps", "global_step", "checkpoint", "checkpoints", "ckpt", "iter",
               "iteration")
_EPOCH_WORDS = ("epoch", "dist_epoch")
_CHECKPOINT_NAME = re.compile(
    rf"(?:(?P<word>{'|'.join(_STEP_WORDS + _EPOCH_WORDS)})[-_]?)?(?P<number>[0-9]+)",
    re.IGNORECASE | re.ASCII)  # ASCII: Unicode case folding takes `ſtep-3` (long s) for step
STEPS, EPOCHS = "steps", "epochs"


def parse_step(name: str) -> int | None:
    """The step a checkpoint directory name stands for (its whole trailing number, or
    Lightning's step=), or None."""
    match = _CHECKPOINT_NAME.fullmatch(name) or LIGHTNING_CHECKPOINT_NAME.fullmatch(name)
    return int(match.group("number")) if match else None


def numbered_by(name: str) -> str:
    """What a checkpoint directory name's number counts: EPOCHS (torchtune's epoch_3,
    dist_epoch_3) or STEPS (every other name)."""
    match = _CHECKPOINT_NAME.fullmatch(name)
    word = (match.group("word") or "").lower() if match else ""
    return EPOCHS if word in _EPOCH_WORDS else STEPS


@dataclass
class CheckpointEntry:
    """A checkpoint directory of a run; age counts from the newest change anywhere inside it.
    Its parts are the DCP directories in it where it is not one itself (layouts.py)."""

    name: str
    path: StoragePath
    step: int
    complete: bool
    size_bytes: int
    modified_at: float | None
    """Its newest file's last write, in seconds since the epoch; None where the store does not
    say for every object (prune then takes it for one that may have changed just now)."""
    age_seconds: float | None
    has_sha256sums: bool
    identity: tuple[int, int]
    """The directory's device and inode when scanned: what a deletion checks it still is
    ((0, 0) in an object store, which has no directories)."""
    parts: tuple[str, ...] = ()
    linked_by: tuple[str, ...] = ()
    """The symlinks of the run directory that point to it (`latest -> step-200`), and those
    inside other checkpoints that lead into it (`iter_0000003/metadata.json`)."""
    links_inside: tuple[str, ...] = field(default=(), repr=False, compare=False)
    """Locally, the symlinks inside it, by their paths relative to it: one leading into
    another checkpoint of the run keeps that one (a trainer's side file linked to a step
    before)."""
    custom_objects: int = 0
    """Of an accelerate checkpoint: the objects registered for checkpointing it holds."""
    doubt: str | None = None
    """Why it may be complete or a save cut short, where its files cannot tell: it then
    counts as incomplete, and prune never deletes it."""
    trainers_best: bool = False
    """Whether the transformers Trainer names it its best checkpoint (best_model_checkpoint
    in the newest complete checkpoint's trainer_state.json)."""
    objects: Mapping[str, ObjectInfo] = field(default_factory=dict, repr=False, compare=False)
    """In an object store, the objects the scan listed under it, by name relative to it: all
    that a deletion may remove, and only as they were then."""
    rank_metadata: tuple[str, ...] = ()
    """Of a save with use_collectives=False: its ranks' own metadata files (layouts.py)."""

    @property
    def dcp_directories(self) -> list[StoragePath]:
        """The DCP checkpoint directories it is made of: its parts, or itself."""
        return [self.path / part for part in self.parts] if self.parts else [self.path]

    @property
    def metadata_files(self) -> list[str]:
        """The `.metadata` files that make it complete (what a deletion removes first)."""
        return CheckpointShape(self.parts, self.complete,
                               rank_metadata=self.rank_metadata).metadata_files

    def to_json(self) -> dict:
        """A JSON-ready dict with stable keys."""
        modified = None if self.modified_at is None else datetime.fromtimestamp(
            self.modified_at, timezone.utc).isoformat(timespec="seconds")
        return {"name": self.name, "path": str(self.path), "step": self.step,
                "complete": self.complete, "size_bytes": self.size_bytes,
                "modified_at": modified,
                "age_seconds": None if self.age_seconds is None else round(self.age_seconds),
                "sha256sums": self.has_sha256sums,
                "parts": list(self.parts), "linked_by": list(self.linked_by),
                "doubt": self.doubt, "trainers_best": self.trainers_best}


@dataclass
class IgnoredEntry:
    """An entry named like a checkpoint that is not one dcpctl may touch, and why."""

    name: str
    reason: str


@dataclass
class RunDirectoryScan:
    """The checkpoints directly under a run directory, sorted by step, the look-alikes, and
    the step the trainer's tracker file names as the one it resumes from (layouts.py)."""

    path: StoragePath
    checkpoints: list[CheckpointEntry] = field(default_factory=list)
    ignored: list[IgnoredEntry] = field(default_factory=list)
    tracked_step: int | None = None
    runs_below: list[str] = field(default_factory=list)
    """Where it holds no checkpoint: its directories that do (torchtitan's dump folder holds
    `checkpoint/`, the run directory), which were likely meant."""
    named_otherwise: list[str] = field(default_factory=list)
    """Where it holds no checkpoint: its DCP directories not named by a step (`llama3/`,
    `final/`), which ls and prune never take for checkpoints of the run."""

    def to_json(self) -> dict:
        """A JSON-ready dict with stable keys."""
        return {"run_dir": str(self.path),
                "checkpoints": [entry.to_json() for entry in self.checkpoints],
                "ignored": [asdict(entry) for entry in self.ignored],
                "tracked_step": self.tracked_step, "runs_below": self.runs_below,
                "named_otherwise": self.named_otherwise}


def no_checkpoints_said(run_dir: str | StoragePath, runs_below: list[str],
                        named_otherwise: list[str]) -> str:
    """What ls and prune say of a run directory without checkpoints (RunDirectoryScan)."""
    said = f"{run_dir}: no checkpoint directories"
    if runs_below:
        shown = ", ".join(f"{name}/" for name in runs_below[:3])
        one = len(runs_below) == 1
        said += (f"; {shown} below it {'holds' if one else 'hold'} some: give "
                 f"{'it' if one else 'one'} as the run directory")
    if named_otherwise:
        shown = ", ".join(f"{name}/" for name in named_otherwise[:3])
        more = f" and {len(named_otherwise) - 3} more" if len(named_otherwise) > 3 else ""
        said += (f"; {shown}{more} in it {'is a' if len(named_otherwise) == 1 else 'are'} DCP "
                 f"checkpoint{'' if len(named_otherwise) == 1 else 's'} not named by a step "
                 "(step-N, checkpoint-N, iter_N, ...), which ls and prune never take for the "
                 "run's")
    return said


def check_run_directory(directory: StoragePath) -> None:
    """Refuse a run directory that is missing or not a directory (one that is a checkpoint
    itself is refused from its listing: refuse_a_checkpoint_as_run_directory)."""
    if not directory.is_dir():
        if isinstance(directory, ObjectPath):
            directory.store.list_tree(directory.key)  # says where the bucket itself is missing
        what = "not a directory" if directory.exists() else "no such directory"
        raise CheckpointNotFoundError(f"{what}; give the run directory that holds the "
                                      "checkpoint directories", path=directory)


def scan_run_directory(run_dir: str | os.PathLike) -> RunDirectoryScan:
    """Find the checkpoint directories directly under run_dir; never follows a symlink. In an
    object store, one listing of everything under the run's prefix."""
    scan = RunDirectoryScan(storage_path(run_dir))
    check_run_directory(scan.path)
    now = time.time()
    if isinstance(scan.path, ObjectPath):
        _scan_prefixes(scan, now)
        return scan
    names = sorted(os.listdir(scan.path))
    refuse_a_checkpoint_as_run_directory(scan.path, names)
    if MEGATRON_TRACKER in names:
        scan.tracked_step = _read_tracker(scan.path / MEGATRON_TRACKER)
    for name in names:
        step = parse_step(name)
        if step is None:
            continue
        path = scan.path / name
        try:
            shape = _checkpoint_shape(path)
            mounted = (mount_points_at_or_inside(path) if isinstance(shape, CheckpointShape)
                       else [])
            if mounted:  # deleting it would delete what another file system holds
                scan.ignored.append(IgnoredEntry(name, mounted_reason(mounted[0])))
            elif isinstance(shape, CheckpointShape):
                scan.checkpoints.append(_describe_checkpoint(path, step, shape, now))
            else:
                scan.ignored.append(IgnoredEntry(name, shape))
        except FileNotFoundError:
            continue  # removed while we looked (a trainer purging its own old checkpoints)
        except OSError as error:  # not ours to read: not ours to judge or delete either
            scan.ignored.append(IgnoredEntry(name, f"cannot be read ({error.strerror})"))
    links = _symlinks_by_target(scan.path, names)
    _add_links_between_checkpoints(scan.path, scan.checkpoints, links)
    for entry in scan.checkpoints:
        entry.linked_by = tuple(links.get(entry.name, ()))
    scan.checkpoints.sort(key=lambda entry: (entry.step, entry.name))
    _doubt_those_short_of_custom_objects(scan.checkpoints)
    _mark_the_trainers_best(scan.checkpoints)
    if not scan.checkpoints:
        scan.runs_below = [name for name in names if _holds_checkpoints(scan.path / name)]
        scan.named_otherwise = [name for name in names if parse_step(name) is None
                                and _is_dcp_directory(scan.path / name)]
    return scan


def mounted_reason(mount_point: str) -> str:
    """Why a checkpoint with this mount point (relative to it, `.` for itself) is never
    deleted."""
    where = "it is" if mount_point == os.curdir else f"{mount_point} in it is"
    return f"{where} a mount point (another file system): never deleted"


def _is_dcp_directory(path: Path) -> bool:
    """Whether path is a directory (not a link) holding `.metadata`, or rank 0's own (a save
    with use_collectives=False)."""
    try:
        return stat.S_ISDIR(os.lstat(path).st_mode) and any(
            (path / name).is_file() for name in (METADATA_FILE_NAME, rank_metadata_file_name(0)))
    except OSError:
        return False


def _holds_checkpoints(path: Path) -> bool:
    """Whether path is a directory (not a link) holding a complete checkpoint directory."""
    try:
        if not stat.S_ISDIR(os.lstat(path).st_mode):
            return False
        return any(parse_step(name) is not None and (path / name / METADATA_FILE_NAME).is_file()
                   for name in os.listdir(path))
    except OSError:
        return False


def _symlinks_by_target(run_dir: Path, names: list[str]) -> dict[str, list[str]]:
    """The symlinks among names (entries of run_dir) by the entry of run_dir each leads to or
    into, through any chain of links: `latest -> step-200` is how a user or a script marks the
    checkpoint to resume from."""
    links: dict[str, list[str]] = {}
    real_run_dir = os.path.realpath(run_dir)
    for name in names:
        path = os.path.join(run_dir, name)
        if os.path.islink(path):
            target = os.path.relpath(os.path.realpath(path), real_run_dir)
            entry = target.split(os.sep, 1)[0]
            if entry not in (os.curdir, os.pardir):
                links.setdefault(entry, []).append(name)
    return links


def _add_links_between_checkpoints(run_dir: Path, checkpoints: list[CheckpointEntry],
                                   links: dict[str, list[str]]) -> None:
    """To links (symlinks_by_target's), the symlinks inside each checkpoint that lead into
    another entry of run_dir, as `<checkpoint>/<path>`: deleting that one would leave the
    linking checkpoint's file dangling."""
    real_run_dir = os.path.realpath(run_dir)
    for entry in checkpoints:
        for inside in entry.links_inside:
            target = os.path.relpath(os.path.realpath(run_dir / entry.name / inside),
                                     real_run_dir)
            top = target.split(os.sep, 1)[0]
            if top not in (os.curdir, os.pardir, entry.name):
                links.setdefault(top, []).append(f"{entry.name}/{inside}")


def _read_tracker(path: Path) -> int | None:
    """The step a local tracker file names; None unless it is a small regular file (a
    symlink is never followed)."""
    try:
        descriptor = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        status = os.fstat(descriptor)
        if not stat.S_ISREG(status.st_mode) or status.st_size > MEGATRON_TRACKER_MAX_BYTES:
            return None  # a directory is opened too, and then no file to read
        with open(descriptor, "rb", closefd=False) as stream:
            return parse_tracked_iteration(stream.read(MEGATRON_TRACKER_MAX_BYTES))
    finally:
        os.close(descriptor)


def _scan_prefixes(scan: RunDirectoryScan, now: float) -> None:
    """The checkpoints under a run's prefix in an object store, from one listing."""
    by_checkpoint: dict[str, dict[str, ObjectInfo]] = {}
    listing = scan.path.store.list_tree(scan.path.key)
    refuse_a_checkpoint_as_run_directory(scan.path, listing)
    tracker = listing.get(MEGATRON_TRACKER)
    if tracker is not None and tracker.size <= MEGATRON_TRACKER_MAX_BYTES:
        with contextlib.suppress(FileNotFoundError), \
                open_ranged(scan.path / MEGATRON_TRACKER) as tracker_file:
            # one ranged read, of the object listed: never more than the cap, whatever came
            scan.tracked_step = parse_tracked_iteration(
                tracker_file.read(0, MEGATRON_TRACKER_MAX_BYTES))
    step_named_objects = []
    for key, info in listing.items():
        name, slash, rest = key.partition("/")
        if parse_step(name) is None:
            continue
        if slash:
            by_checkpoint.setdefault(name, {})[rest] = info
        else:
            step_named_objects.append(name)
    # an object named like a step is no checkpoint, as a file is none locally
    scan.ignored += [IgnoredEntry(name, "not a directory") for name in sorted(step_named_objects)
                     if name not in by_checkpoint]
    # what a save in progress is writing is in no listing yet: its unfinished uploads tell it
    uploading: dict[str, list[float | None]] = {}
    if by_checkpoint:
        for name, written in scan.path.store.unfinished_uploads(scan.path.key).items():
            uploading.setdefault(name.partition("/")[0], []).append(written)
    for name, objects in sorted(by_checkpoint.items()):
        shape = checkpoint_shape(objects.keys(), name)
        if not isinstance(shape, CheckpointShape):
            scan.ignored.append(IgnoredEntry(name, shape))
            continue
        times = [info.modified for info in objects.values()] + uploading.get(name, [])
        modified_at = max(times) if all(times) else None  # 0, None: the store does not say
        scan.checkpoints.append(CheckpointEntry(
            name=name, path=scan.path / name, step=parse_step(name), complete=shape.complete,
            size_bytes=sum(info.size for info in objects.values()), modified_at=modified_at,
            age_seconds=None if modified_at is None else max(0.0, now - modified_at),
            has_sha256sums=all(file in objects for file in shape.sha256sums_files),
            identity=(0, 0), parts=shape.parts, custom_objects=shape.custom_objects,
            objects=objects, rank_metadata=shape.rank_metadata, doubt=shape.doubt))
    scan.checkpoints.sort(key=lambda entry: (entry.step, entry.name))
    _doubt_those_short_of_custom_objects(scan.checkpoints)
    _mark_the_trainers_best(scan.checkpoints)
    if not scan.checkpoints:
        scan.runs_below = sorted({key.split("/")[0] for key in listing
                                  if key.count("/") == 2 and key.endswith(f"/{METADATA_FILE_NAME}")
                                  and parse_step(key.split("/")[1]) is not None})
        scan.named_otherwise = sorted({name for name, slash, rest in (
            key.partition("/") for key in listing)
            if rest in (METADATA_FILE_NAME, rank_metadata_file_name(0))
            and parse_step(name) is None})


TRAINER_STATE_MAX_BYTES = 256 << 20
"""A trainer_state.json holds the run's log history; past this it is not one to parse."""


def _mark_the_trainers_best(checkpoints: list[CheckpointEntry]) -> None:
    """The transformers Trainer (load_best_model_at_end) names its best checkpoint in each
    checkpoint's trainer_state.json, and its own rotation never deletes that one: nor does
    prune. The newest complete checkpoint's state is the one that counts."""
    newest = next((entry for entry in reversed(checkpoints) if entry.complete), None)
    if newest is None or (newest.objects and TRAINER_LAST_WRITTEN not in newest.objects):
        return  # (in an object store, the listing tells without a request)
    best = _best_model_checkpoint(newest.path / TRAINER_LAST_WRITTEN)
    for entry in checkpoints:
        entry.trainers_best = entry.name == best


def _best_model_checkpoint(path: StoragePath) -> str | None:
    """The name of the checkpoint a trainer_state.json names best_model_checkpoint (its last
    path part), or None where there is no such file, or it says none."""
    try:
        if path.stat().st_size > TRAINER_STATE_MAX_BYTES:
            return None
        state = json.loads(read_whole(path))
    except (OSError, ValueError, RecursionError):  # none there, unreadable, no JSON: no name
        return None
    best = state.get("best_model_checkpoint") if isinstance(state, dict) else None
    if not isinstance(best, str):
        return None
    return posixpath.basename(best.replace("\\", "/").rstrip("/"))


def _doubt_those_short_of_custom_objects(checkpoints: list[CheckpointEntry]) -> None:
    """accelerate writes the objects registered for checkpointing (custom_checkpoint_<i>.pkl)
    last, and its load_state refuses a checkpoint that holds another number of them than are
    registered now. A complete accelerate checkpoint (sorted by step) holding fewer of them than
    the one before it is a save cut short, or the first since fewer were registered: files
    cannot tell which. It does not count as complete (so the one before stays the newest), and
    it is never deleted."""
    before = None
    for entry in checkpoints:
        if not (entry.parts and entry.complete):
            continue
        if before is not None and entry.custom_objects < before.custom_objects:
            entry.complete = False
            entry.doubt = (f"holds {entry.custom_objects} of the {before.custom_objects} objects "
                           f"registered for checkpointing (custom_checkpoint_<i>.pkl) that "
                           f"{before.name} holds: a save cut short, or the first since fewer "
                           "were registered; never deleted by prune (delete it by hand if it "
                           "is not wanted)")
        before = entry


def _checkpoint_shape(path: Path) -> CheckpointShape | str:
    """The shape of a local entry named like a checkpoint (layouts.py), or why it is none."""
    mode = os.lstat(path).st_mode
    if stat.S_ISLNK(mode):
        return "a symlink: never followed, never deleted"
    if not stat.S_ISDIR(mode):
        return "not a directory"
    if (path / METADATA_FILE_NAME).is_dir() and not (path / METADATA_FILE_NAME).is_symlink():
        return METADATA_IS_A_DIRECTORY  # empty, it lists no name below it
    return checkpoint_shape(file_names_in(path), path.name)


def _describe_checkpoint(path: Path, step: int, shape: CheckpointShape, now: float
                         ) -> CheckpointEntry:
    status = os.lstat(path)
    size_bytes, modified_at, links_inside = _measure_directory(path)
    return CheckpointEntry(
        name=path.name, path=path, step=step, complete=shape.complete, size_bytes=size_bytes,
        modified_at=modified_at, age_seconds=max(0.0, now - modified_at),
        has_sha256sums=all((path / name).is_file() for name in shape.sha256sums_files),
        identity=(status.st_dev, status.st_ino), parts=shape.parts,
        custom_objects=shape.custom_objects, rank_metadata=shape.rank_metadata,
        doubt=shape.doubt, links_inside=links_inside)


def changed_since_scanned(entry: CheckpointEntry) -> bool:
    """Whether a local checkpoint was written since the scan that described it: its bytes, or
    the newest time of anything in it, are not what the scan found."""
    return _measure_directory(Path(entry.path))[:2] != (entry.size_bytes, entry.modified_at)


def _measure_directory(path: Path) -> tuple[int, float, tuple[str, ...]]:
    """Bytes of the regular files under path, the newest mtime of path and anything in it, and
    the symlinks in it (their paths relative to it), which count as themselves and are not
    followed."""
    size_bytes, newest, links = 0, os.lstat(path).st_mtime, []
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
                    elif stat.S_ISLNK(status.st_mode):
                        links.append(os.path.relpath(entry.path, path))
        except OSError:
            continue  # gone or replaced since it was listed, or not ours to read
    return size_bytes, newest, tuple(sorted(links))

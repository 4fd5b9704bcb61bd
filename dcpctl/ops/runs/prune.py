"""Delete the checkpoints of a run directory that no retention rule keeps, safely and under a lock.

A complete checkpoint is kept when any rule keeps it: it is the newest complete one (always),
the one the trainer's tracker file names or a symlink in the run directory points to (always,
complete or not: Megatron resumes from it; `latest -> step-200`), the transformers Trainer's
best_model_checkpoint (always), one of the last
`keep_last` complete ones, its step is a multiple of `keep_every_steps`, its name matches a
`keep_globs` pattern, or it changed within `older_than_seconds` (newest and last go by step:
checkpoints of one step are kept together). An incomplete
one (no `.metadata`) is deleted only when `incomplete_older_than_seconds` is given, nothing in
it changed for longer than that, and no `keep_globs` pattern matches it.

Complete means sound as far as `verify --quick` sees (quick_check.py): a checkpoint whose
`.metadata` is there but which that check calls damaged, or cannot read, is not one to resume
from as far as dcpctl can tell, so it never counts as the newest or among the last. One whose
damage is data files missing or short (as in one being copied `.metadata` first, or a save cut
short) is treated as incomplete, and kept unless that rule lets it go; one damaged otherwise,
or whose `.metadata` dcpctl cannot read (a class it does not know, a layout it does not read
yet, a store that refuses it: torch may read it all the same), is never deleted. Deciding this
reads every complete checkpoint's `.metadata`, as `ls` does.
"""

from __future__ import annotations

import contextlib
import errno
import fnmatch
import functools
import os
from dataclasses import asdict, dataclass, field
from typing import Callable, Iterator

from dcpctl.errors import (TRY_AGAIN_EXIT_CODE, DcpctlError, InvalidOptionError, UnsafePathError,
                           UnsupportedLayoutError, describe_os_error)
from dcpctl.failpoints import Failpoint, failpoint
from dcpctl.format.file_names import METADATA_FILE_NAME
from dcpctl.ops.runs.layouts import MEGATRON_TRACKER
from dcpctl.ops.runs.quick_check import QuickCheck, quick_check, state_of
from dcpctl.ops.runs.scan import (EPOCHS, STEPS, CheckpointEntry, IgnoredEntry,
                                  changed_since_scanned, check_run_directory, mounted_reason,
                                  numbered_by, scan_run_directory)
from dcpctl.storage.local import (empty_directory, mount_points_at_or_inside,
                                  open_directory_at)
from dcpctl.storage.locks import lock_descriptor, locked_directory
from dcpctl.storage.objects import ObjectPath
from dcpctl.storage.paths import StoragePath, storage_path
from dcpctl.storage.staging import delete_checkpoint_objects

KEPT, WOULD_DELETE, DELETED, FAILED = "kept", "would delete", "deleted", "failed"
GONE = "gone"
"""The status of a checkpoint deleted meanwhile by another process (a trainer's own rotation)."""


@dataclass(frozen=True)
class RetentionRules:
    """What prune keeps; see the module docstring for how the rules combine."""

    keep_last: int
    keep_every_steps: int | None = None
    keep_globs: tuple[str, ...] = ()
    older_than_seconds: float | None = None
    incomplete_older_than_seconds: float | None = None

    def __post_init__(self):
        if self.keep_last < 1 or (self.keep_every_steps is not None and self.keep_every_steps < 1):
            raise InvalidOptionError(f"--keep-last and --keep-every must be at least 1, not "
                                     f"{self.keep_last} and {self.keep_every_steps}")


@dataclass
class PruneDecision:
    """One checkpoint: whether the plan deletes it, why, and what became of it (status)."""

    checkpoint: CheckpointEntry
    delete: bool
    reasons: list[str]
    status: str = KEPT
    error: str | None = None
    try_again: bool = False
    """Of a failed deletion: whether it failed as another dcpctl was using the checkpoint,
    which a later prune may well not meet."""
    check: QuickCheck | None = None
    """The quick check of a complete checkpoint that did not pass it."""

    @property
    def state(self) -> str:
        return state_of(self.checkpoint, self.check)

    @property
    def damage(self) -> str | None:
        """What the quick check found wrong, or why it could not read the checkpoint."""
        return self.check and self.check.problem

    def to_json(self) -> dict:
        """A JSON-ready dict with stable keys."""
        return {**self.checkpoint.to_json(), "state": self.state, "delete": self.delete,
                "reasons": self.reasons, "status": self.status, "error": self.error,
                "damage": self.damage}


@dataclass
class PruneReport:
    """Everything `dcpctl prune` shows: each checkpoint's decision and status, the look-alikes
    left alone, and the bytes planned for deletion and actually freed."""

    run_dir: str
    rules: RetentionRules
    dry_run: bool
    decisions: list[PruneDecision] = field(default_factory=list)
    ignored: list[IgnoredEntry] = field(default_factory=list)
    tracked_step: int | None = None
    """The step Megatron's tracker file names (always kept), as ls gives it."""
    runs_below: list[str] = field(default_factory=list)
    """As ls gives it (RunDirectoryScan.runs_below)."""
    named_otherwise: list[str] = field(default_factory=list)
    """As ls gives it (RunDirectoryScan.named_otherwise)."""

    def with_status(self, status: str) -> list[PruneDecision]:
        """The decisions whose status is status (kept, would delete, deleted or failed)."""
        return [decision for decision in self.decisions if decision.status == status]

    @property
    def to_delete(self) -> list[PruneDecision]:
        """The decisions of the plan that delete their checkpoint."""
        return [decision for decision in self.decisions if decision.delete]

    @property
    def delete_bytes(self) -> int:
        """Bytes of the checkpoints the plan deletes."""
        return sum(decision.checkpoint.size_bytes for decision in self.to_delete)

    @property
    def freed_bytes(self) -> int:
        """Bytes of the checkpoints actually deleted (0 in a dry run)."""
        return sum(decision.checkpoint.size_bytes for decision in self.with_status(DELETED))

    def to_json(self) -> dict:
        """A JSON-ready dict with stable keys."""
        return {"run_dir": self.run_dir, "dry_run": self.dry_run,
                "rules": {**asdict(self.rules), "keep_globs": list(self.rules.keep_globs)},
                "checkpoints": [decision.to_json() for decision in self.decisions],
                "ignored": [asdict(entry) for entry in self.ignored],
                "tracked_step": self.tracked_step, "runs_below": self.runs_below,
                "named_otherwise": self.named_otherwise, "delete_bytes": self.delete_bytes,
                "freed_bytes": self.freed_bytes, "failed": len(self.with_status(FAILED))}


def plan_prune(checkpoints: list[CheckpointEntry], rules: RetentionRules,
               tracked_step: int | None = None, checks: dict[str, QuickCheck] | None = None
               ) -> list[PruneDecision]:
    """Decide for each checkpoint (sorted by step) whether to delete it, and why; the ones of
    tracked_step (the step the trainer's tracker file names) are always kept. checks: the
    quick check of complete checkpoints, by name (one not there passed it)."""
    checks = checks or {}
    passed = QuickCheck()
    sound = [entry for entry in checkpoints
             if entry.complete and checks.get(entry.name, passed).sound]
    # by step: two checkpoints of one step (`step-400`, `checkpoint-400`) have no order
    sound_steps = sorted({entry.step for entry in sound})
    last_steps = set(sound_steps[-rules.keep_last:])
    decisions = []
    for entry in checkpoints:
        reasons = [f"matches --keep {glob!r}" for glob in rules.keep_globs
                   if fnmatch.fnmatchcase(entry.name, glob)]
        if entry.step == tracked_step:
            reasons.append(f"named by {MEGATRON_TRACKER}: the trainer resumes from it")
        if entry.linked_by:
            reasons.append(f"symlink {', '.join(entry.linked_by)} points to it")
        if entry.doubt is not None:
            reasons.append(f"unsure: {entry.doubt}")
        if entry.trainers_best:
            reasons.append("the Trainer's best_model_checkpoint (trainer_state.json)")
        check = checks.get(entry.name, passed)
        problem = check.damage
        if check.unreadable is not None:
            reasons.append(f"cannot be read ({check.unreadable}): never deleted")
        elif problem is not None and check.lacks_bytes:
            reasons += _incomplete_keep_reasons(entry, rules, f"damaged ({problem})")
        elif problem is not None:
            reasons.append(f"damaged ({problem}): deleted only where data files are missing "
                           "or short")
        elif entry.complete:
            reasons += _complete_keep_reasons(entry, rules, entry.step == sound_steps[-1],
                                              entry.step in last_steps)
        elif entry.doubt is None:  # one in doubt is kept whatever its age: said above
            reasons += _incomplete_keep_reasons(entry, rules, "incomplete")
        decisions.append(PruneDecision(entry, delete=not reasons,
                                       reasons=reasons or [_delete_reason(entry, problem)],
                                       check=checks.get(entry.name)))
    return decisions


def checked_checkpoints(checkpoints: list[CheckpointEntry]) -> dict[str, QuickCheck]:
    """The quick check (the one ls makes) of each complete checkpoint that does not pass it,
    by name: one another dcpctl is changing passes."""
    checks = {}
    for entry in checkpoints:
        if entry.complete:
            check = quick_check(entry)
            check.parts.clear()  # one checkpoint's opened parts held at a time
            if check.damage is not None or check.unreadable is not None:
                checks[entry.name] = check
    return checks


def _complete_keep_reasons(entry: CheckpointEntry, rules: RetentionRules, newest: bool,
                           among_last: bool) -> list[str]:
    reasons = []
    if newest:
        reasons.append("newest complete")
    if among_last:
        reasons.append(f"one of the last {rules.keep_last} complete")
    if rules.keep_every_steps and entry.step % rules.keep_every_steps == 0:
        reasons.append(f"step is a multiple of {rules.keep_every_steps}")
    if rules.older_than_seconds is not None:
        if entry.age_seconds is None:
            reasons.append(f"age unknown ({_NO_TIMES})")
        elif entry.age_seconds <= rules.older_than_seconds:
            reasons.append("changed within --older-than")
    return reasons


_NO_TIMES = "the store does not say when its objects were written"


def _incomplete_keep_reasons(entry: CheckpointEntry, rules: RetentionRules, state: str
                             ) -> list[str]:
    if rules.incomplete_older_than_seconds is None:
        return [f"{state}: deleted only with --incomplete-older-than"]
    if entry.age_seconds is None:
        return [f"{state}, age unknown ({_NO_TIMES}): may be a save or copy in progress"]
    if entry.age_seconds <= rules.incomplete_older_than_seconds:
        return [f"{state}, changed within --incomplete-older-than: may be a save or copy in "
                "progress"]
    return []


def _delete_reason(entry: CheckpointEntry, problem: str | None) -> str:
    if entry.complete and problem is None:
        return "no rule keeps it"
    state = "incomplete" if problem is None else "damaged"
    return f"{state}, unchanged for longer than --incomplete-older-than"


def prune_run_directory(run_dir: str | os.PathLike, rules: RetentionRules,
                        dry_run: bool = False) -> PruneReport:
    """Delete the checkpoints under run_dir that no rule keeps, holding a lock on run_dir; with
    dry_run, plan only and change nothing. Deletion failures are recorded, not raised."""
    directory = storage_path(run_dir)
    check_run_directory(directory)
    if dry_run:
        return _planned(directory, rules, dry_run=True)
    if isinstance(directory, ObjectPath):  # no locks there; .metadata goes first
        report = _planned(directory, rules, dry_run=False)
        for decision in report.to_delete:
            _carry_out(decision, functools.partial(delete_checkpoint_objects,
                                                   decision.checkpoint.path,
                                                   decision.checkpoint.metadata_files,
                                                   decision.checkpoint.objects))
        return report
    with locked_directory(directory, exclusive=True,
                          what="another dcpctl prune is pruning this run directory"
                          ) as run_descriptor:
        report = _planned(directory, rules, dry_run=False)
        for decision in report.to_delete:
            _carry_out(decision, functools.partial(delete_checkpoint_directory, run_descriptor,
                                                   decision.checkpoint),
                       gone=functools.partial(_gone_from, run_descriptor, decision.checkpoint))
    return report


def _planned(directory: StoragePath, rules: RetentionRules, dry_run: bool) -> PruneReport:
    scan = scan_run_directory(directory)
    _refuse_mixed_numbering(directory, scan.checkpoints)
    report = PruneReport(str(directory), rules, dry_run,
                         plan_prune(scan.checkpoints, rules, scan.tracked_step,
                                    checked_checkpoints(scan.checkpoints)), scan.ignored,
                         scan.tracked_step, scan.runs_below, scan.named_otherwise)
    for decision in report.to_delete:
        decision.status = WOULD_DELETE
    return report


def _refuse_mixed_numbering(directory: StoragePath, checkpoints: list[CheckpointEntry]) -> None:
    """Complete checkpoints numbered by epoch (dist_epoch_2) beside ones numbered by step
    (step-100) have no order: epoch 2 is not older than step 100. (Incomplete ones go by age
    alone.)"""
    by_numbering: dict[str, list[str]] = {}
    for entry in checkpoints:
        if entry.complete:
            by_numbering.setdefault(numbered_by(entry.name), []).append(entry.name)
    if len(by_numbering) > 1:
        raise UnsupportedLayoutError(
            f"numbers some complete checkpoints by epoch "
            f"({', '.join(by_numbering[EPOCHS][:3])}) and others by step "
            f"({', '.join(by_numbering[STEPS][:3])}): prune cannot tell which are the newest, "
            "so it deletes nothing; keep each numbering in a run directory of its own",
            path=directory)


def _carry_out(decision: PruneDecision, delete: Callable[[], None],
               gone: Callable[[], bool] = lambda: False) -> None:
    """Delete as planned; a deletion that failed because another process deleted the
    checkpoint meanwhile (gone()) is no failure."""
    try:
        delete()
    except (OSError, DcpctlError) as error:
        if gone():
            decision.status = GONE
            decision.reasons.append("deleted meanwhile by another process")
        else:
            decision.status = FAILED
            decision.error = (describe_os_error(error) if isinstance(error, OSError)
                              else str(error))
            decision.try_again = getattr(error, "exit_code", 1) == TRY_AGAIN_EXIT_CODE
    else:
        decision.status = DELETED


def _gone_from(run_descriptor: int, entry: CheckpointEntry) -> bool:
    """Whether nothing is left in the run directory under the checkpoint's name."""
    try:
        os.stat(entry.name, dir_fd=run_descriptor, follow_symlinks=False)
    except FileNotFoundError:
        return True
    return False


def delete_checkpoint_directory(run_descriptor: int, entry: CheckpointEntry) -> None:
    """Delete a checkpoint directory of the run directory open as run_descriptor, its
    `.metadata` files first (each part's, where it has parts; each rank's own, of a save with
    use_collectives=False), so that a deletion cut short
    leaves an incomplete checkpoint rather than one that looks complete. Everything goes
    through descriptors: the entry must still be the directory the scan saw (not a symlink,
    not another directory swapped in), and no other dcpctl may be using it or its parts."""
    descriptor = _open_real_directory(run_descriptor, entry.name, entry.path, "not deleted")
    try:
        status = os.fstat(descriptor)
        if (status.st_dev, status.st_ino) != entry.identity:
            raise UnsafePathError("is no longer the directory that was scanned; not deleted",
                                  path=entry.path)
        # mounted since the scan, as the scan tells it (a btrfs subvolume has a device of its
        # own and is no mount); what is mounted below after this, empty_directory stops at
        mounted = mount_points_at_or_inside(entry.path)
        if mounted:
            raise UnsafePathError(mounted_reason(mounted[0]), path=entry.path)
        lock_descriptor(descriptor, exclusive=True, path=entry.path,
                        what="another dcpctl is using this checkpoint; not deleted")
        with contextlib.ExitStack() as parts_held:
            # every part held before any `.metadata` goes: one in use stops it all
            holders = [parts_held.enter_context(_held_part(descriptor, entry, part))
                       for part in entry.parts] or [descriptor]
            if changed_since_scanned(entry):
                raise DcpctlError("was written since prune looked at it (a save at work "
                                  "there?); not deleted", path=entry.path)
            first = [METADATA_FILE_NAME] if entry.parts else entry.metadata_files
            for holder in (holder for holder in holders if holder is not None):
                for name in first:
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(name, dir_fd=holder)
        failpoint(Failpoint.AFTER_METADATA_REMOVED)
        empty_directory(descriptor)
    finally:
        os.close(descriptor)
    os.rmdir(entry.name, dir_fd=run_descriptor)


def _open_real_directory(parent_descriptor: int, name: str, path: StoragePath,
                         consequence: str) -> int:
    """A descriptor of directory name in the open parent, refused (UnsafePathError naming the
    consequence) when a symlink or a file has taken its place."""
    try:
        return open_directory_at(parent_descriptor, name)
    except OSError as error:
        if error.errno in (errno.ELOOP, errno.ENOTDIR):
            raise UnsafePathError(f"no longer a real directory (a symlink or file now?); "
                                  f"{consequence}", path=path) from None
        raise


@contextlib.contextmanager
def _held_part(descriptor: int, entry: CheckpointEntry, part: str
               ) -> Iterator[int | None]:
    """A descriptor of one part of a checkpoint open as descriptor, held under the part's own
    lock (a dcpctl working on the part holds it) while the block runs; None for a part gone."""
    try:
        part_descriptor = _open_real_directory(descriptor, part, entry.path / part,
                                               "nothing deleted")
    except FileNotFoundError:
        yield None
        return
    try:
        lock_descriptor(part_descriptor, exclusive=True, path=entry.path / part,
                        what="another dcpctl is using this part of the checkpoint; nothing "
                             "deleted")
        yield part_descriptor
    finally:
        os.close(part_descriptor)

"""Delete the checkpoints of a run directory that no retention rule keeps, safely and under a lock.

A complete checkpoint is kept when any rule keeps it: it is the newest complete one (always),
one of the last `keep_last` complete ones, its step is a multiple of `keep_every_steps`, its
name matches a `keep_globs` pattern, or it changed within `older_than_seconds`. An incomplete
one (no `.metadata`) is deleted only when `incomplete_older_than_seconds` is given, nothing in
it changed for longer than that, and no `keep_globs` pattern matches it.
"""

from __future__ import annotations

import contextlib
import fcntl
import fnmatch
import os
import shutil
import stat
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Iterator

from dcpctl.errors import (DcpctlError, InvalidOptionError, LockHeldError, UnsafePathError,
                           describe_os_error)
from dcpctl.format.file_names import METADATA_FILE_NAME
from dcpctl.ops.runs.scan import (CheckpointEntry, IgnoredEntry, check_run_directory,
                                  scan_run_directory)

LOCK_FILE_NAME = ".dcpctl-prune.lock"
KEPT, WOULD_DELETE, DELETED, FAILED = "kept", "would delete", "deleted", "failed"


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

    def to_json(self) -> dict:
        """A JSON-ready dict with stable keys."""
        return {**self.checkpoint.to_json(), "delete": self.delete, "reasons": self.reasons,
                "status": self.status, "error": self.error}


@dataclass
class PruneReport:
    """Everything `dcpctl prune` shows: each checkpoint's decision and status, the look-alikes
    left alone, and the bytes planned for deletion and actually freed."""

    run_dir: str
    rules: RetentionRules
    dry_run: bool
    decisions: list[PruneDecision] = field(default_factory=list)
    ignored: list[IgnoredEntry] = field(default_factory=list)

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
                "delete_bytes": self.delete_bytes, "freed_bytes": self.freed_bytes,
                "failed": len(self.with_status(FAILED))}


def plan_prune(checkpoints: list[CheckpointEntry], rules: RetentionRules) -> list[PruneDecision]:
    """Decide for each checkpoint (sorted by step) whether to delete it, and why."""
    complete = [entry for entry in checkpoints if entry.complete]
    newest_name = complete[-1].name if complete else None
    last_names = {entry.name for entry in complete[-rules.keep_last:]}
    decisions = []
    for entry in checkpoints:
        reasons = [f"matches --keep {glob!r}" for glob in rules.keep_globs
                   if fnmatch.fnmatchcase(entry.name, glob)]
        if entry.complete:
            reasons += _complete_keep_reasons(entry, rules, entry.name == newest_name,
                                              entry.name in last_names)
        else:
            reasons += _incomplete_keep_reasons(entry, rules)
        decisions.append(PruneDecision(entry, delete=not reasons,
                                       reasons=reasons or [_delete_reason(entry)]))
    return decisions


def _complete_keep_reasons(entry: CheckpointEntry, rules: RetentionRules, newest: bool,
                           among_last: bool) -> list[str]:
    reasons = []
    if newest:
        reasons.append("newest complete")
    if among_last:
        reasons.append(f"one of the last {rules.keep_last} complete")
    if rules.keep_every_steps and entry.step % rules.keep_every_steps == 0:
        reasons.append(f"step is a multiple of {rules.keep_every_steps}")
    if rules.older_than_seconds is not None and entry.age_seconds <= rules.older_than_seconds:
        reasons.append("changed within --older-than")
    return reasons


def _incomplete_keep_reasons(entry: CheckpointEntry, rules: RetentionRules) -> list[str]:
    if rules.incomplete_older_than_seconds is None:
        return ["incomplete: deleted only with --incomplete-older-than"]
    if entry.age_seconds <= rules.incomplete_older_than_seconds:
        return ["incomplete, changed within --incomplete-older-than: may be a save in progress"]
    return []


def _delete_reason(entry: CheckpointEntry) -> str:
    if entry.complete:
        return "no rule keeps it"
    return "incomplete, unchanged for longer than --incomplete-older-than"


def prune_run_directory(run_dir: str | os.PathLike, rules: RetentionRules,
                        dry_run: bool = False) -> PruneReport:
    """Delete the checkpoints under run_dir that no rule keeps; with dry_run, plan only and
    change nothing (no lock file either). Deletion failures are recorded, not raised."""
    directory = Path(run_dir)
    check_run_directory(directory)
    with contextlib.nullcontext() if dry_run else hold_prune_lock(directory):
        scan = scan_run_directory(directory)
        report = PruneReport(str(directory), rules, dry_run, plan_prune(scan.checkpoints, rules),
                             scan.ignored)
        for decision in report.to_delete:
            _carry_out(decision, dry_run)
    return report


def _carry_out(decision: PruneDecision, dry_run: bool) -> None:
    if dry_run:
        decision.status = WOULD_DELETE
        return
    try:
        delete_checkpoint_directory(decision.checkpoint.path)
    except OSError as error:
        decision.status, decision.error = FAILED, describe_os_error(error)
    except DcpctlError as error:
        decision.status, decision.error = FAILED, str(error)
    else:
        decision.status = DELETED


def delete_checkpoint_directory(path: Path) -> None:
    """Remove a checkpoint directory, `.metadata` first, so that a deletion cut short leaves an
    incomplete checkpoint rather than one that looks complete. Refuses a symlink."""
    # Checked again here, not only when scanning: the entry may have been swapped since.
    if not stat.S_ISDIR(os.lstat(path).st_mode):
        raise UnsafePathError("no longer a real directory (a symlink or file now?); "
                              "not deleted", path=path)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path / METADATA_FILE_NAME)
    # rmtree refuses a symlink given to it and unlinks (never follows) symlinks inside.
    shutil.rmtree(path)


@contextlib.contextmanager
def hold_prune_lock(run_dir: Path) -> Iterator[None]:
    """Hold an exclusive lock on run_dir/.dcpctl-prune.lock; fail at once if another process
    holds it. The kernel drops the lock when the process dies, so no lock is ever stale."""
    path = run_dir / LOCK_FILE_NAME
    # The file stays after we are done: removing it would let a waiting process lock a file
    # that a third one can no longer see.
    with open(path, "a+") as stream:
        try:
            fcntl.flock(stream, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            stream.seek(0)
            holder = stream.read().strip() or "unknown"
            raise LockHeldError(f"another dcpctl prune (pid {holder}) is pruning this run "
                                "directory; nothing was changed, try again later",
                                path=path) from None
        stream.truncate(0)
        stream.write(f"{os.getpid()}\n")
        stream.flush()
        yield

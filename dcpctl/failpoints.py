"""Named points where a test can have the process killed, to prove that a crash there is safe.

Every point is a member of Failpoint, the one list of them. Set DCPCTL_FAILPOINT=<name> in the
environment of a dcpctl process and it sends itself SIGKILL the first time it reaches that
point, or `<name>@<n>` for the n-th time; `<name>[@<n>]:SIGTERM` (or another signal's name)
sends that signal instead, which the process may handle. With DCPCTL_FAILPOINT_SCOPE=workers it
is armed only in the processes `--workers` starts (execution/processes.py) and in the ranks of
a torchrun job but rank 0, with DCPCTL_FAILPOINT_SCOPE=coordinator only in the command's own
process (rank 0's), which runs a share of its own. DCPCTL_FAILPOINT_TRACE=<file>
appends the name of every point reached to that file, so a test can learn where and how often a
command passes, then kill it at each of those moments. Unset, a failpoint costs one comparison.
"""

from __future__ import annotations

import enum
import os
import signal
import threading
from collections import Counter


class Failpoint(enum.Enum):
    """Where dcpctl can be killed on purpose. Data writes come many times a run; the others
    once or a few times."""

    AFTER_DATA_WRITE = "after-data-write"
    """The pipeline wrote out one task's bytes (a run of items, a chunk, a tensor)."""
    AFTER_DATA_FILE = "after-data-file"
    """An output file (data, safetensors, or the new `.metadata` or SHA256SUMS beside its name)
    was synced and closed."""
    BEFORE_ATOMIC_RENAME = "before-atomic-rename"
    """A small file (`.metadata`, SHA256SUMS) was written beside its name, not renamed yet (in
    an object store: is about to be PUT under its name)."""
    AFTER_FIRST_METADATA_SWITCH = "after-first-metadata-switch"
    """In place: `.metadata` names the new data files by their temporary names."""
    AFTER_FINAL_NAME = "after-final-name"
    """In place: one new data file was given its final name, replacing the old file."""
    AFTER_SECOND_METADATA_SWITCH = "after-second-metadata-switch"
    """In place: `.metadata` names the new data files by their final names."""
    BEFORE_PUBLISH = "before-publish"
    """A new output (directory or file) is whole under its temporary name."""
    AFTER_METADATA_REMOVED = "after-metadata-removed"
    """A checkpoint being deleted (by prune, or an output in an object store replaced with
    --overwrite) has lost its `.metadata`, not yet the rest."""


def _armed(setting: str | None) -> tuple[str | None, int, signal.Signals]:
    if not setting:
        return None, 0, signal.SIGKILL
    moment, _, signal_name = setting.partition(":")
    name, _, hit = moment.partition("@")
    if (name not in {point.value for point in Failpoint} or not (hit or "1").isdigit()
            or signal_name not in {"", *signal.Signals.__members__}):
        raise ValueError(f"DCPCTL_FAILPOINT={setting!r}: not one of "
                         f"{', '.join(point.value for point in Failpoint)}, with an optional "
                         "@n and :SIGNAME")
    return name, int(hit or 1), signal.Signals[signal_name or "SIGKILL"]


_SCOPES = ("all", "workers", "coordinator")
_SCOPE = os.environ.get("DCPCTL_FAILPOINT_SCOPE") or "all"
if _SCOPE not in _SCOPES:
    raise ValueError(f"DCPCTL_FAILPOINT_SCOPE={_SCOPE!r}: not one of {', '.join(_SCOPES)}")
_SETTING = _armed(os.environ.get("DCPCTL_FAILPOINT"))  # checked in every process
_ARMED_NAME, _ARMED_HIT, _ARMED_SIGNAL = _SETTING if _SCOPE != "workers" else _armed(None)
_TRACE_PATH = os.environ.get("DCPCTL_FAILPOINT_TRACE") or None
_hits: Counter[str] = Counter()
_lock = threading.Lock()


def arm_in_worker() -> None:
    """Called as a process `--workers` started, or a torchrun rank but 0, begins to serve:
    arm a failpoint scoped to workers, disarm one scoped to the coordinator."""
    global _ARMED_NAME, _ARMED_HIT, _ARMED_SIGNAL
    if _SCOPE != "all":
        _ARMED_NAME, _ARMED_HIT, _ARMED_SIGNAL = (_SETTING if _SCOPE == "workers"
                                                  else _armed(None))


def failpoint(point: Failpoint) -> None:
    """Die here, as if killed, when DCPCTL_FAILPOINT names this point and this hit of it (or
    receive the signal it names)."""
    if _ARMED_NAME is None and _TRACE_PATH is None:
        return
    with _lock:
        _hits[point.value] += 1
        hit = _hits[point.value]
        if _TRACE_PATH is not None:
            with open(_TRACE_PATH, "a") as trace:
                trace.write(f"{point.value}\n")
    if point.value == _ARMED_NAME and hit == _ARMED_HIT:
        os.kill(os.getpid(), _ARMED_SIGNAL)

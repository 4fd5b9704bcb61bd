"""`ls`: the checkpoints of a run directory, each with its compression read from `.metadata`."""

from __future__ import annotations

import os
from collections import Counter
from dataclasses import dataclass

from dcpctl.format.checkpoint.view import Checkpoint
from dcpctl.ops.inspection.report import build_inspect_report
from dcpctl.ops.runs.quick_check import QuickCheck, quick_check, state_of
from dcpctl.ops.runs.scan import CheckpointEntry, RunDirectoryScan, scan_run_directory


@dataclass
class ListedCheckpoint:
    """A checkpoint of the run with its compression (codec name to item count), when it passed
    its quick check; else what the check found (damaged, unreadable, in use)."""

    entry: CheckpointEntry
    compression: dict[str, int] | None = None
    check: QuickCheck | None = None

    @property
    def state(self) -> str:
        return state_of(self.entry, self.check)

    @property
    def problem(self) -> str | None:
        return self.check and self.check.problem

    @property
    def in_use(self) -> str | None:
        """That another dcpctl is changing it."""
        return self.check and self.check.in_use


@dataclass
class ListReport:
    """Everything `dcpctl ls` shows."""

    scan: RunDirectoryScan
    checkpoints: list[ListedCheckpoint]

    def to_json(self) -> dict:
        """A JSON-ready dict with stable keys."""
        payload = self.scan.to_json()
        for entry, listed in zip(payload["checkpoints"], self.checkpoints):
            entry.update(state=listed.state, compression=listed.compression,
                         problem=listed.problem, in_use=listed.in_use)
        return payload


def list_run_directory(run_dir: str | os.PathLike) -> ListReport:
    """The checkpoints under run_dir; complete ones also with their compression, read from
    `.metadata` (summed over its parts where it has several) as the quick check prune makes
    opens it: a damaged or unreadable one is listed with its problem instead, one another
    dcpctl is changing as in use."""
    scan = scan_run_directory(run_dir)
    listed = []
    for entry in scan.checkpoints:
        if not entry.complete:
            listed.append(ListedCheckpoint(entry))
            continue
        check = quick_check(entry)
        compression = _compression(check.parts) if check.sound else None
        check.parts.clear()  # one checkpoint's opened parts held at a time
        listed.append(ListedCheckpoint(entry, compression, check))
    return ListReport(scan, listed)


def _compression(parts: list[Checkpoint]) -> dict[str, int]:
    """Item counts by codec name, most used first, over the checkpoint's parts."""
    counts: Counter[str] = Counter()
    for part in parts:
        counts.update(build_inspect_report(part).compression)
    return dict(counts.most_common())

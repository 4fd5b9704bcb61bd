"""`ls`: the checkpoints of a run directory, each with its compression read from `.metadata`."""

from __future__ import annotations

import os
from collections import Counter
from dataclasses import dataclass

from dcpctl.cycle_collector import paused_cycle_collector
from dcpctl.errors import DcpctlError, describe_os_error
from dcpctl.format.checkpoint.structure import open_quickly_verified
from dcpctl.ops.inspection.report import build_inspect_report
from dcpctl.ops.runs.scan import CheckpointEntry, RunDirectoryScan, scan_run_directory
from dcpctl.storage.locks import locked_checkpoint


@dataclass
class ListedCheckpoint:
    """A checkpoint of the run with its compression (codec name to item count), when readable."""

    entry: CheckpointEntry
    compression: dict[str, int] | None = None
    problem: str | None = None


@dataclass
class ListReport:
    """Everything `dcpctl ls` shows."""

    scan: RunDirectoryScan
    checkpoints: list[ListedCheckpoint]

    def to_json(self) -> dict:
        """A JSON-ready dict with stable keys."""
        payload = self.scan.to_json()
        for entry, listed in zip(payload["checkpoints"], self.checkpoints):
            entry.update(compression=listed.compression, problem=listed.problem)
        return payload


def list_run_directory(run_dir: str | os.PathLike) -> ListReport:
    """The checkpoints under run_dir; complete ones also with their compression, read from
    `.metadata` (summed over its parts where it has several; a damaged one is listed with its
    problem instead)."""
    scan = scan_run_directory(run_dir)
    listed = []
    for entry in scan.checkpoints:
        if not entry.complete:
            listed.append(ListedCheckpoint(entry))
            continue
        try:
            listed.append(ListedCheckpoint(entry, _compression(entry)))
        except DcpctlError as error:
            listed.append(ListedCheckpoint(entry, problem=str(error)))
        except OSError as error:
            listed.append(ListedCheckpoint(entry, problem=describe_os_error(error)))
    return ListReport(scan, listed)


def _compression(entry: CheckpointEntry) -> dict[str, int]:
    """Item counts by codec name, most used first, over the checkpoint's parts; raises what
    makes one of them damaged, as prune finds it (damaged_checkpoints)."""
    counts: Counter[str] = Counter()
    for directory in entry.dcp_directories:
        with paused_cycle_collector(), locked_checkpoint(directory, exclusive=False):
            counts.update(build_inspect_report(open_quickly_verified(directory)).compression)
    return dict(counts.most_common())

"""Sharing a command's work among processes, for the command line (execution/): the ranks of a
torchrun job, and the worker processes `--workers` starts by default."""

from __future__ import annotations

from dcpctl.execution.torchrun import join_torchrun, launched_by_torchrun
from dcpctl.execution.worker_count import automatic_workers
from dcpctl.storage.paths import REMOTE_THREADS, storage_path

__all__ = ["REMOTE_THREADS", "default_workers", "join_torchrun", "launched_by_torchrun"]


def default_workers(checkpoint: str, output: str | None = None) -> int:
    """The processes a command on checkpoint, writing to output, shares its work among when
    `--workers` is not given (execution/worker_count.py)."""
    return automatic_workers(storage_path(checkpoint),
                             storage_path(output) if output is not None else None)

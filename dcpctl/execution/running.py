"""Running a job's shares (jobs.py): in this process alone, on `workers` local processes (this
one and workers - 1 it starts: processes.py), or, when the command runs under torchrun, on every
rank (torchrun.py).

A command starts its worker processes first thing (workers_started), and sends its job's
planning ahead (plan_ahead) when it knows it before reading, so that the workers start up and
plan while it checks and plans itself; every job it runs within is shared with them.
"""

from __future__ import annotations

import contextlib
import functools
import os
from typing import Callable, Iterator

from dcpctl.errors import InvalidOptionError
from dcpctl.execution import torchrun
from dcpctl.execution.jobs import Plan, Planning, Result, ShareJob, run_share_of
from dcpctl.execution.processes import LocalWorkers
from dcpctl.format.checkpoint.structure import checked_checkpoint
from dcpctl.format.checkpoint.view import Checkpoint
from dcpctl.storage.paths import StoragePath, default_threads_for, storage_path

_local_workers: LocalWorkers | None = None


@contextlib.contextmanager
def workers_started(workers: int) -> Iterator[None]:
    """Within: the processes that share this command's jobs started (`workers` local ones, this
    one among them, unless started already; a torchrun job's ranks are)."""
    global _local_workers
    if torchrun.current_team() is not None and workers > 1:
        raise InvalidOptionError("--workers starts processes on this machine; under torchrun "
                                 "each rank is one worker (set torchrun's --nproc-per-node)")
    if _local_workers is not None and workers > 1 and _local_workers.count != workers:
        raise RuntimeError(f"{_local_workers.count} workers are running, not {workers}")
    starting = workers > 1 and torchrun.current_team() is None and _local_workers is None
    if starting:
        _local_workers = LocalWorkers(workers)
    try:
        yield
    finally:
        if starting:
            local, _local_workers = _local_workers, None
            local.stop()


def plan_ahead(planning: Planning) -> None:
    """Have the other processes started to share this command's jobs (if any) plan `planning`
    now, ahead of the job that has it. Send it once what it reads is held (storage/locks.py), as
    the command's own planning reads it."""
    team = torchrun.current_team() or _local_workers
    if team is not None:
        team.plan_ahead(planning)


def run_job(job: ShareJob[Plan, Result], plan: Plan, workers: int = 1,
            on_progress: Callable[[int, int], None] | None = None) -> list[Result]:
    """Run every share of the job and return their results, in share order: under torchrun,
    one share per rank (this process is rank 0); otherwise on `workers` local processes, this
    one among them; a job of no work in this process alone, as one share. on_progress(
    units_done, total_units) follows the work."""
    total = sum(job.lane_sizes(plan))

    def advance(units: int) -> None:
        if on_progress is not None:
            on_progress(units, total)

    with workers_started(workers):
        team = _current_team(workers)
        if team is None or total == 0:  # nothing to share: the others need not even plan it
            return [run_share_of(job, 0, 1, advance, plan)]
        return team.run(job, plan, advance)


def _current_team(workers: int) -> torchrun.Team | LocalWorkers | None:
    """The processes that share a job of `workers` workers (None: this one alone)."""
    return torchrun.current_team() or (_local_workers if workers > 1 else None)


def sharing_processes(workers: int) -> int:
    """How many processes run_job(workers=workers) shares a job among: a torchrun job's ranks,
    or `workers`."""
    team = torchrun.current_team()
    return team.size if team is not None else max(1, workers)


def threads_per_worker(threads: int | None, path: StoragePath, workers: int) -> int:
    """Threads each worker runs: as asked, or the default for where path lies (storage/paths)
    shared among the workers of this machine (a torchrun job's ranks on this node)."""
    if threads:
        return threads
    return max(1, default_threads_for(path) // _workers_on_this_machine(workers))


@contextlib.contextmanager
def checked_job_source(path: str | os.PathLike, planning: Planning | None, threads: int | None,
                       workers: int, on_progress: Callable[[int, int], None] | None = None,
                       exclusive: bool = False) -> Iterator[Checkpoint]:
    """The checkpoint a job of `workers` workers of `threads` threads reads, held (exclusively
    to change it) and checked while the block runs (checked_checkpoint). Once it is held, the
    workers are sent `planning` (plan_ahead; None sends nothing). While they wait, it is hashed
    against SHA256SUMS on every thread the job runs on this machine, threads_per_worker's for
    each of its processes, not on this process's share of them."""
    hashing_threads = (threads_per_worker(threads, storage_path(path), workers)
                       * _workers_on_this_machine(workers))
    ahead = None if planning is None else functools.partial(plan_ahead, planning)
    with checked_checkpoint(path, exclusive=exclusive, threads=hashing_threads,
                            on_progress=on_progress, once_held=ahead) as checkpoint:
        yield checkpoint


def _workers_on_this_machine(workers: int) -> int:
    """The processes of a job of `workers` workers on this machine: those, or a torchrun job's
    ranks on this node."""
    return max(1, torchrun.local_world_size() if torchrun.current_team() else workers)

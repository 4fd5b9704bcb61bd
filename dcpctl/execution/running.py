"""Running a job's shares (jobs.py): in this process alone, on `workers` local processes (this
one and workers - 1 it starts: processes.py), or, when the command runs under torchrun, on every
rank (torchrun.py)."""

from __future__ import annotations

from typing import Callable

from dcpctl.errors import InvalidOptionError
from dcpctl.execution import torchrun
from dcpctl.execution.jobs import Plan, Result, ShareJob, run_share_of
from dcpctl.execution.processes import run_in_processes
from dcpctl.storage.paths import StoragePath, default_threads_for


def run_job(job: ShareJob[Plan, Result], plan: Plan, workers: int = 1,
            on_progress: Callable[[int, int], None] | None = None) -> list[Result]:
    """Run every share of the job and return their results, in share order: under torchrun,
    one share per rank (this process is rank 0); otherwise on `workers` local processes, this
    one among them. on_progress(units_done, total_units) follows the work."""
    total = sum(job.lane_sizes(plan))

    def advance(units: int) -> None:
        if on_progress is not None:
            on_progress(units, total)

    team = torchrun.current_team()
    if team is not None:
        if workers > 1:
            raise InvalidOptionError("--workers starts processes on this machine; under torchrun "
                                     "each rank is one worker (set torchrun's --nproc-per-node)")
        return team.run(job, plan, advance)
    if workers <= 1:
        return [run_share_of(job, 0, 1, advance, plan)]
    return run_in_processes(job, plan, workers, advance)


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
    local_workers = torchrun.local_world_size() if torchrun.current_team() else workers
    return max(1, default_threads_for(path) // max(1, local_workers))

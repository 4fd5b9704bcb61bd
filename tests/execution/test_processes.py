"""--workers N on local processes: share 0 runs in the coordinator on its own plan, shares 1 to
N - 1 on spawned workers, which serve every job of the command and plan a planning sent ahead
of its job; a worker done early takes lanes left of the others' shares; the first failure,
wherever it happens, stops the rest promptly and is raised naming its worker."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from dataclasses import dataclass

import pytest

from dcpctl.errors import DataError
from dcpctl.execution.jobs import WorkerError
from dcpctl.execution.processes import LocalWorkers

_LONG_SECONDS = 60  # a share that is not stopped runs this long; the tests end far sooner


@dataclass(frozen=True)
class _Planning:
    name: str

    def plan(self) -> str:
        return f"{self.name} planned in {os.getpid()} at {time.time()!r}"


class _Job:
    """`lanes` lanes of one unit each; `failing` says which lane fails at once. The others step
    through their work for _LONG_SECONDS unless stopped (when a lane fails), or take
    `seconds` each; those of `slow_elsewhere` take 60 times as long outside the coordinator
    (`coordinator`, its pid)."""

    def __init__(self, failing: int | None, planning: str = "the job", lanes: int = 2,
                 seconds: float = 0.0, slow_elsewhere: tuple[int, ...] = (),
                 coordinator: int = 0) -> None:
        self.failing = failing
        self.planning = _Planning(planning)
        self.lanes = lanes
        self.seconds = seconds
        self.slow_elsewhere = slow_elsewhere
        self.coordinator = coordinator

    def lane_sizes(self, plan: str) -> list[int]:
        return [1] * self.lanes

    def run_share(self, plan: str, lanes: list[int], advance) -> tuple:
        for lane in lanes:
            if lane == self.failing:
                raise DataError(f"lane {lane} is damaged")
            if self.failing is not None:
                deadline = time.monotonic() + _LONG_SECONDS
                while time.monotonic() < deadline:
                    advance(0)
                    time.sleep(0.01)
            slow = lane in self.slow_elsewhere and os.getpid() != self.coordinator
            time.sleep(self.seconds * (60 if slow else 1))
            advance(1)
        return tuple(lanes), plan, os.getpid()


@contextlib.contextmanager
def _workers(count: int):
    workers = LocalWorkers(count)
    try:
        yield workers
    finally:
        workers.stop()


def _made_at(plan: str) -> float:
    return float(plan.rpartition(" at ")[2])


def test_share_0_runs_here_on_the_coordinators_plan_and_results_come_in_lane_order():
    done = []
    with _workers(2) as workers:
        time.sleep(2)  # started, so that the worker claims its lane at once
        results = workers.run(_Job(None, seconds=1.0), "the coordinator's plan", done.append)
    assert results[0] == ((0,), "the coordinator's plan", os.getpid())
    lanes, plan, worker = results[1]
    assert lanes == (1,) and worker != os.getpid()
    assert plan.startswith(f"the job planned in {worker} at ")
    assert sorted(done) == [1, 1]


def test_a_worker_done_early_takes_the_lanes_left_of_a_slow_ones_share():
    """Shares of 4 lanes each: the worker claims half of its own (4 and 5) and is slow at
    them; the coordinator, done with 0 to 3, takes 7 and 6 from the back of the worker's
    share. Every lane runs once, and the results come in lane order."""
    with _workers(2) as workers:
        workers.plan_ahead(_Planning("the job"))  # the worker imports this module meanwhile
        time.sleep(2)
        job = _Job(None, lanes=8, seconds=0.2, slow_elsewhere=(4, 5, 6, 7),
                   coordinator=os.getpid())
        started = time.monotonic()
        results = workers.run(job, "plan", lambda units: None)
        took = time.monotonic() - started
    ran = {lane: pid for lanes, _, pid in results for lane in lanes}
    assert [lane for lanes, _, _ in results for lane in lanes] == list(range(8))
    worker = ran[4]
    assert worker != os.getpid() and ran[5] == worker
    assert [ran[lane] for lane in (0, 1, 2, 3, 6, 7)] == [os.getpid()] * 6
    assert took < 3 * 60 * 0.2  # the worker ran its 2 slow lanes, not 4


def test_workers_plan_ahead_and_serve_every_job_of_the_command():
    with _workers(3) as workers:
        workers.plan_ahead(_Planning("the job"))
        time.sleep(2)  # the coordinator checks and plans meanwhile
        sent = time.time()
        first = workers.run(_Job(None, "the job", 3, seconds=1.0), "plan",
                            lambda units: None)[1:]
        second = workers.run(_Job(None, "another job", 3, seconds=1.0), "plan",
                             lambda units: None)[1:]
    assert [lanes for lanes, _, _ in first] == [(1,), (2,)] == [lanes for lanes, _, _ in second]
    for (_, plan, worker), (_, next_plan, next_worker) in zip(first, second):
        # planned before the job came, the job run on that plan
        assert plan.startswith(f"the job planned in {worker} at ") and _made_at(plan) < sent
        # the same worker serves the next job, whose planning was not sent ahead: planned anew
        assert next_worker == worker and next_plan.startswith("another job planned in ")
        assert _made_at(next_plan) > sent


@pytest.mark.parametrize("failing,named", [(1, "worker 2 of 2"), (0, "worker 1 of 2")],
                         ids=["worker", "coordinator"])
def test_the_first_failure_stops_every_share_and_names_its_worker(failing, named):
    started = time.monotonic()
    with _workers(2) as workers, pytest.raises(WorkerError) as raised:
        workers.run(_Job(failing), "plan", lambda units: None)
    assert str(raised.value).startswith(f"{named}: lane {failing} is damaged")
    assert time.monotonic() - started < _LONG_SECONDS / 2


def test_a_worker_dead_before_its_job_fails_the_job_naming_it():
    with _workers(2) as workers:
        (_, process, _), = workers._workers
        os.kill(process.pid, signal.SIGKILL)
        process.join()
        ended = r"^worker 2 of 2 ended without finishing its share \(killed by SIGKILL\)"
        with pytest.raises(WorkerError, match=ended):
            workers.run(_Job(None), "plan", lambda units: None)
        with pytest.raises(WorkerError, match="stopped by an earlier failure"):
            workers.run(_Job(None), "plan", lambda units: None)


class _NoWork:
    """Two lanes of nothing: run as one share, in the coordinator."""

    planning = _Planning("nothing")

    def lane_sizes(self, plan: str) -> list[int]:
        return [0, 0]

    def run_share(self, plan: str, lanes: list[int], advance) -> tuple:
        return tuple(lanes), plan, os.getpid()


def test_a_job_of_no_work_runs_here_alone():
    from dcpctl.execution.running import run_job
    assert run_job(_NoWork(), "plan", workers=2) == [((0, 1), "plan", os.getpid())]

"""--workers N on local processes: share 0 runs in the coordinator on its own plan, shares 1 to
N - 1 on spawned workers, which serve every job of the command and plan a planning sent ahead
of its job; the first failure, wherever it happens, stops the rest promptly and is raised naming
its worker."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from dataclasses import dataclass

import pytest

from dcpctl.errors import DataError, DcpctlError
from dcpctl.execution.jobs import WorkerError
from dcpctl.execution.processes import LocalWorkers

_LONG_SECONDS = 60  # a share that is not stopped runs this long; the tests end far sooner


@dataclass(frozen=True)
class _Planning:
    name: str

    def plan(self) -> str:
        return f"{self.name} planned in {os.getpid()} at {time.time()!r}"


class _Job:
    """`lanes` lanes of one unit each, so share i does lane i; `failing` says which share
    fails at once. The others step through their work for _LONG_SECONDS unless stopped."""

    def __init__(self, failing: int | None, planning: str = "the job", lanes: int = 2) -> None:
        self.failing = failing
        self.planning = _Planning(planning)
        self.lanes = lanes

    def lane_sizes(self, plan: str) -> list[int]:
        return [1] * self.lanes

    def run_share(self, plan: str, lanes: list[int], advance) -> tuple:
        (lane,) = lanes
        if lane == self.failing:
            raise DataError(f"lane {lane} is damaged")
        if self.failing is not None:
            deadline = time.monotonic() + _LONG_SECONDS
            while time.monotonic() < deadline:
                advance(0)
                time.sleep(0.01)
        advance(1)
        return lane, plan, os.getpid()


@contextlib.contextmanager
def _workers(count: int):
    workers = LocalWorkers(count)
    try:
        yield workers
    finally:
        workers.stop()


def _made_at(plan: str) -> float:
    return float(plan.rpartition(" at ")[2])


def test_share_0_runs_here_on_the_coordinators_plan_and_results_come_in_share_order():
    done = []
    with _workers(2) as workers:
        results = workers.run(_Job(None), "the coordinator's plan", done.append)
    assert results[0] == (0, "the coordinator's plan", os.getpid())
    lane, plan, worker = results[1]
    assert lane == 1 and worker != os.getpid()
    assert plan.startswith(f"the job planned in {worker} at ")
    assert sorted(done) == [1, 1]


def test_workers_plan_ahead_and_serve_every_job_of_the_command():
    with _workers(3) as workers:
        workers.plan_ahead(_Planning("the job"))
        time.sleep(2)  # the coordinator checks and plans meanwhile
        sent = time.time()
        first = workers.run(_Job(None, "the job", 3), "plan", lambda units: None)[1:]
        second = workers.run(_Job(None, "another job", 3), "plan", lambda units: None)[1:]
    assert [lane for lane, _, _ in first] == [1, 2] == [lane for lane, _, _ in second]
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


_WORKER_IN_ITS_SHARE = threading.Event()  # set by the coordinator's advance


class _SlowToStopJob(_Job):
    """_Job whose worker share, stopped, takes _LONG_SECONDS over its clean-up (as one whose
    store stopped answering); the coordinator's share fails once the worker's has begun."""

    def run_share(self, plan: str, lanes: list[int], advance) -> tuple:
        if lanes == [0]:
            assert _WORKER_IN_ITS_SHARE.wait(_LONG_SECONDS)
            raise DataError("lane 0 is damaged")
        advance(1)
        try:
            return super().run_share(plan, lanes, advance)
        finally:
            time.sleep(_LONG_SECONDS)


def test_a_worker_slow_to_stop_is_killed_after_worker_stop_seconds(monkeypatch):
    """Terminated workers stop their shares and abort their uploads; one still at it after
    WORKER_STOP_SECONDS is killed, so the failure is raised and the output aborted."""
    from dcpctl.execution import processes

    monkeypatch.setattr(processes, "WORKER_STOP_SECONDS", 2.0)
    with _workers(2) as workers:
        (_, process, _), = workers._workers
        _WORKER_IN_ITS_SHARE.clear()
        started = time.monotonic()
        with pytest.raises(WorkerError, match="^worker 1 of 2: lane 0 is damaged"):
            workers.run(_SlowToStopJob(0), "plan", lambda units: _WORKER_IN_ITS_SHARE.set())
        assert time.monotonic() - started < _LONG_SECONDS / 2
        assert process.exitcode == -signal.SIGKILL  # still in its clean-up after 2 s


class _LocatingJob(_Job):
    """_Job whose shares step through their work inside an item, as decoding does: a
    DcpctlError raised there is given the item's place (iter_decoded_item)."""

    def run_share(self, plan: str, lanes: list[int], advance) -> tuple:
        try:
            return super().run_share(plan, lanes, advance)
        except DcpctlError as error:
            raise error.located(path="__0_0.distcp", fqn="w", start=0, end=8) from None


def test_a_workers_failure_is_not_taken_for_one_of_the_item_the_coordinator_was_in():
    """`Error: ckd/__0_1.distcp: item 'model.layers.2.weight' at bytes 0..10491433: worker 2
    of 2 ended without finishing its share`: the worker's failure, raised into the
    coordinator's own share to stop it, was given the place of the item it was decoding."""
    with _workers(2) as workers, pytest.raises(WorkerError) as raised:
        workers.run(_LocatingJob(1), "plan", lambda units: None)
    assert str(raised.value) == ("worker 2 of 2: __0_0.distcp: item 'w' at bytes 0..8: lane 1 "
                                 "is damaged")  # where the worker was, not the coordinator


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

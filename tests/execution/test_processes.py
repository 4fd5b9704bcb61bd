"""--workers N on local processes: share 0 runs in the coordinator on its own plan, shares 1 to
N - 1 on spawned workers; the first failure, wherever it happens, stops the rest promptly and is
raised naming its worker."""

from __future__ import annotations

import os
import time

import pytest

from dcpctl.errors import DataError
from dcpctl.execution.jobs import WorkerError
from dcpctl.execution.processes import run_in_processes

_LONG_SECONDS = 60  # a share that is not stopped runs this long; the tests end far sooner


class _Job:
    """Two lanes of one unit each, so share i does lane i; `failing` says which share fails
    at once. The others step through their work for _LONG_SECONDS unless stopped."""

    def __init__(self, failing: int | None) -> None:
        self.failing = failing

    def plan(self) -> str:
        return f"planned in {os.getpid()}"

    def lane_sizes(self, plan: str) -> list[int]:
        return [1, 1]

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


def test_share_0_runs_here_on_the_coordinators_plan_and_results_come_in_share_order():
    done = []
    results = run_in_processes(_Job(None), "the coordinator's plan", 2, done.append)
    assert results[0] == (0, "the coordinator's plan", os.getpid())
    lane, plan, worker = results[1]
    assert lane == 1 and worker != os.getpid() and plan == f"planned in {worker}"
    assert sorted(done) == [1, 1]


@pytest.mark.parametrize("failing,named", [(1, "worker 2 of 2"), (0, "worker 1 of 2")],
                         ids=["worker", "coordinator"])
def test_the_first_failure_stops_every_share_and_names_its_worker(failing, named):
    started = time.monotonic()
    with pytest.raises(WorkerError) as raised:
        run_in_processes(_Job(failing), "plan", 2, lambda units: None)
    assert str(raised.value).startswith(f"{named}: lane {failing} is damaged")
    assert time.monotonic() - started < _LONG_SECONDS / 2

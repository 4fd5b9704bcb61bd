"""Jobs: work described so that any process can do a share of it.

A job is a picklable description of an operation's work (what to read, where to write, with
how many threads). Its plan is a pure function of the job's planning (what to read and what to
make of it), so a worker process that receives the job plans it again and gets the plan the
coordinator has, without the plan crossing a process boundary. A planning can be sent ahead of
its job, as soon as the command knows it, so that the workers plan while the coordinator checks
and plans, rather than after (PlansMadeAhead). The plan's lanes (output files, or files to
read) are split into shares balanced by size and dealt out as the work goes (shares.py): each
worker runs the lanes it claims, a batch at a time, and returns for each batch what the
coordinator needs to publish (storage records, digests, problems found); the coordinator
publishes once every lane is done, the batches' results taken in lane order. Output bytes never
depend on how many workers wrote them, or which: each lane is written whole by one worker, from
the same plan.
"""

from __future__ import annotations

import pickle
import threading
import time
from typing import Any, Callable, Generic, Iterable, Protocol, TypeVar

from dcpctl.errors import DcpctlError
from dcpctl.execution.shares import ClaimCounters, claimed_lanes

Plan = TypeVar("Plan")
Result = TypeVar("Result")


class Planning(Protocol, Generic[Plan]):
    """What a job's plan is a pure function of (see the module docstring); picklable."""

    def plan(self) -> Plan:
        """Open what the job reads and plan its work: the same plan in every process."""


class ShareJob(Protocol, Generic[Plan, Result]):
    """Work that can be split into shares (see the module docstring)."""

    planning: Planning[Plan]

    def lane_sizes(self, plan: Plan) -> list[int]:
        """The size of each lane of the plan, in the units its progress is counted in."""

    def run_share(self, plan: Plan, lanes: list[int], advance: Callable[[int], None]
                  ) -> Result:
        """Do the work of the lanes given (indexes into lane_sizes); advance(units) as it goes."""


class WorkerError(DcpctlError):
    """A worker process or torchrun rank failed: its error, named by the worker."""


LaneResults = list[tuple[int, Any]]
"""What a worker did of a job: each batch of lanes it ran, as its first lane and its result."""


def run_alone(job: ShareJob[Plan, Result], plan: Plan, advance: Callable[[int], None]
              ) -> Result:
    """Every lane of the job, in this process alone."""
    return job.run_share(plan, list(range(len(job.lane_sizes(plan)))), advance)


def run_share_of(job: ShareJob, index: int, count: int, claims: ClaimCounters,
                 advance: Callable[[int], None], plan: Any = None) -> LaneResults:
    """What worker `index` of `count` does: plan the job (unless given its plan) and run the
    lanes it claims (shares.claimed_lanes), a batch at a time."""
    plan = job.planning.plan() if plan is None else plan
    return [(lanes[0], job.run_share(plan, lanes, advance))
            for lanes in claimed_lanes(job.lane_sizes(plan), index, count, claims)]


def in_lane_order(done: Iterable[LaneResults]) -> list[Any]:
    """The results of every worker's batches (run_share_of), in the order of their lanes: the
    same list however many workers ran them, and whichever."""
    batches = sorted((batch for results in done for batch in results), key=lambda batch: batch[0])
    return [result for _, result in batches]


def packed(value: ShareJob | Planning) -> bytes:
    """A job or a planning as bytes for another process, with the storage options in force:
    they must be in force there before its paths are unpickled (each opens its store)."""
    from dcpctl.storage.stores import storage_options
    return pickle.dumps((storage_options(), pickle.dumps(value)))


def unpacked(data: bytes) -> Any:
    """A job or planning `packed` packed, its storage options put in force here first."""
    from dcpctl.storage.stores import add_storage_options
    options, payload = pickle.loads(data)
    add_storage_options(options)
    return pickle.loads(payload)


class PlansMadeAhead:
    """In a process that serves shares (a worker, a torchrun rank): the plans of plannings sent
    ahead of their jobs, by the planning's bytes (`packed`). A job whose planning was planned
    ahead runs on that plan, which serves it alone; any other job is planned when it comes."""

    def __init__(self) -> None:
        self._plans: dict[bytes, Any] = {}

    def make(self, planning_data: bytes) -> None:
        """Plan a planning sent ahead. A planning that fails is forgotten: its job plans again
        when it comes, and reports the failure as its own."""
        self._plans.pop(planning_data, None)
        try:
            self._plans[planning_data] = unpacked(planning_data).plan()
        except Exception:  # noqa: BLE001 - see above
            return

    def run_share(self, job_data: bytes, planning_data: bytes, index: int, count: int,
                  claims: ClaimCounters, advance: Callable[[int], None]) -> LaneResults:
        """Be worker `index` of `count` of the job packed in job_data, whose planning packs
        into planning_data (run_share_of)."""
        job = unpacked(job_data)
        return run_share_of(job, index, count, claims, advance,
                            self._plans.pop(planning_data, None))


def describe_failure(error: BaseException) -> str:
    """An error raised in a worker as the one line its coordinator reports."""
    if isinstance(error, DcpctlError):
        return str(error)
    return f"internal error: {type(error).__name__}: {error}"


class BatchedProgress:
    """Progress made in a worker, handed to send() in batches at most every interval_seconds
    (each send crosses a process boundary), from any thread; flush() sends the rest."""

    def __init__(self, send: Callable[[int], None], interval_seconds: float) -> None:
        self._send_units = send
        self._interval_seconds = interval_seconds
        self._pending = 0
        self._sent_at = time.monotonic()
        self._lock = threading.Lock()

    def advance(self, units: int) -> None:
        with self._lock:
            self._pending += units
            if time.monotonic() - self._sent_at >= self._interval_seconds:
                self._send()

    def flush(self) -> None:
        with self._lock:
            self._send()

    def _send(self) -> None:
        if self._pending:
            self._send_units(self._pending)
        self._pending, self._sent_at = 0, time.monotonic()

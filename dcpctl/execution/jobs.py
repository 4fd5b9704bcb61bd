"""Jobs: work described so that any process can do a share of it.

A job is a picklable description of an operation's work (what to read, where to write, with
how many threads). Its plan is a pure function of the job's planning (what to read and what to
make of it), so a worker process that receives the job plans it again and gets the plan the
coordinator has, without the plan crossing a process boundary. A planning can be sent ahead of
its job, as soon as the command knows it, so that the workers plan while the coordinator checks
and plans, rather than after (PlansMadeAhead). The plan's lanes (output files, or files to
read) are split into shares balanced by size (shares.py); each worker runs its share and returns
what the coordinator needs to publish (storage records, digests, problems found; with the ETags
its objects were given: ShareOutcome), and the coordinator publishes once every share is done.
Output bytes never depend on how many workers wrote them: each lane is written whole by one
worker, from the same plan.
"""

from __future__ import annotations

import pickle
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Generic, Protocol, TypeVar

from dcpctl.errors import DcpctlError, describe_os_error, name_and_message
from dcpctl.execution.shares import split_by_size
from dcpctl.storage.stores import adopt_etags_written, etags_written

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


def run_share_of(job: ShareJob, index: int, count: int, advance: Callable[[int], None],
                 plan: Any = None) -> Any:
    """What worker `index` of `count` does: plan the job (unless given its plan) and run its
    share."""
    plan = job.planning.plan() if plan is None else plan
    share = split_by_size(job.lane_sizes(plan), count)[index]
    return job.run_share(plan, share, advance)


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
                  advance: Callable[[int], None]) -> ShareOutcome:
        """Run share `index` of `count` of the job packed in job_data, whose planning packs
        into planning_data."""
        job = unpacked(job_data)
        plan = self._plans.pop(planning_data, None)
        earlier = etags_written()
        result = run_share_of(job, index, count, advance, plan)
        return ShareOutcome(result, etags_written(since=earlier))


@dataclass
class ShareOutcome:
    """What a worker process hands its coordinator for a share: the share's result, and the
    ETags the objects it wrote for the share were given (not those of earlier shares, which
    the coordinator may have written over since), which the coordinator's checks of the
    output it publishes compare (storage/staging.py)."""

    result: Any
    etags_written: dict[str, dict[str, str]]

    def adopted(self) -> Any:
        """The result, once the ETags are taken as this process's own writes'."""
        adopt_etags_written(self.etags_written)
        return self.result


def describe_failure(error: BaseException) -> str:
    """An error raised in a worker as the one line its coordinator reports."""
    if isinstance(error, DcpctlError):
        return str(error)
    if isinstance(error, OSError):  # as the CLI words one raised in its own process
        return describe_os_error(error)
    return f"internal error: {name_and_message(error)}"


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

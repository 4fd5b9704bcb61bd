"""A bounded multithreaded pipeline of byte pieces, ordered per output lane; it knows nothing
about DCP.

Each task belongs to a lane (an output file, say). `threads` threads take tasks in order and
each does all the work of its task: it produces the task's pieces (reading and coding: file
reads, zstd and hashlib release the GIL) and consumes them (writing and hashing). Consumption is
ordered within a lane: a task's pieces reach `consume` only after every earlier task of its lane
was consumed, so each lane's output is the same whatever the thread count. Lanes proceed side by
side. A thread whose task must wait for its turn holds what it produces meanwhile; a task
produced whole before its turn is parked, and the thread that consumes its predecessor consumes
it next, so no thread idles waiting for a turn. Held pieces share one budget of
`bytes_in_flight`, so memory is bounded by bytes in flight (plus a piece per thread), not by the
number or size of tasks. The earliest unfinished task is always
its lane's turn and never waits, so the pipeline always makes progress. With one thread,
everything runs in the calling thread, one task after another. The first error anywhere
(or Ctrl-C, SIGTERM in the calling thread) cancels the rest and is raised in the calling
thread once every thread stopped, or after STOP_SECONDS for threads that did not.
"""

from __future__ import annotations

import collections
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Generic, Hashable, Iterable, Iterator, Sequence, TypeVar

from dcpctl.failpoints import Failpoint, failpoint

Task = TypeVar("Task")

DEFAULT_BYTES_IN_FLIGHT = 64 << 20
STOP_SECONDS = 10.0
"""After a failure or a stop, how long the calling thread waits for the other threads to reach
their next step before it raises anyway. A thread stuck in a call that never returns (a block
upload to a store that stopped answering, which adlfs gives no timeout) would otherwise hold
the command, and the removal of what it wrote, until it is killed; what such a thread still
has open, the caller discards as it unwinds."""


def coalesce(pieces: Iterable[bytes], min_bytes: int) -> Iterator[bytes]:
    """The same bytes in fewer, larger pieces: small pieces are joined until min_bytes."""
    pending: list = []
    pending_bytes = 0
    for piece in pieces:
        if not pending and len(piece) >= min_bytes:
            yield piece
            continue
        pending.append(piece)
        pending_bytes += len(piece)
        if pending_bytes >= min_bytes:
            yield b"".join(pending)
            pending, pending_bytes = [], 0
    if pending:
        yield b"".join(pending)


@dataclass(slots=True)
class Run(Generic[Task]):
    """Neighbouring tasks of one lane run as one task: a small task costs a round of locks,
    system calls and GIL hand-overs of its own otherwise."""

    tasks: list[Task]
    lane: Hashable
    size_bytes: int
    produced_bytes: list[int] = field(default_factory=list)
    """Filled as the run is produced: how many bytes each task produced."""


def group_into_runs(tasks: Iterable[Task], lane_of: Callable[[Task], Hashable],
                    size_of: Callable[[Task], int], max_bytes: int,
                    neighbours: Callable[[Task, Task], bool] = lambda before, after: True
                    ) -> list[Run[Task]]:
    """Consecutive tasks of one lane into runs of at most max_bytes (by size_of), each task a
    `neighbours` of the one before it; a task larger than max_bytes is a run of its own."""
    runs: list[Run[Task]] = []
    for task in tasks:
        lane, size = lane_of(task), size_of(task)
        if runs:
            run = runs[-1]
            if (run.lane == lane and run.size_bytes + size <= max_bytes
                    and neighbours(run.tasks[-1], task)):
                run.tasks.append(task)
                run.size_bytes += size
                continue
        runs.append(Run([task], lane, size))
    return runs


def produce_run(run: Run[Task], produce: Callable[[Task], Iterable[bytes]]) -> Iterator[bytes]:
    """The pieces of every task of the run in order, counting each task's bytes into
    run.produced_bytes."""
    for task in run.tasks:
        produced = 0
        for piece in produce(task):
            produced += len(piece)
            yield piece
        run.produced_bytes.append(produced)


def default_thread_count() -> int:
    """The number of cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


class PipelineCancelled(Exception):
    """Raised inside a thread of the pipeline when another part of it failed."""


def _one_lane(task) -> None:
    return None


def _lane_neighbours(lanes: Sequence[Hashable]) -> tuple[list[int], list[int]]:
    """For each task, the index of the previous and of the next task of its lane, or -1."""
    last: dict[Hashable, int] = {}
    predecessors = []
    successors = [-1] * len(lanes)
    for index, lane in enumerate(lanes):
        predecessor = last.get(lane, -1)
        predecessors.append(predecessor)
        if predecessor >= 0:
            successors[predecessor] = index
        last[lane] = index
    return predecessors, successors


class _PipelineState:
    def __init__(self, lanes: Sequence[Hashable], capacity_bytes: int) -> None:
        self.condition = threading.Condition()
        self.error: BaseException | None = None
        self.next_task = 0
        self.predecessors, self.successors = _lane_neighbours(lanes)
        self.consumed = [False] * len(lanes)
        self.parked: dict[int, tuple] = {}  # produced whole, waiting for their lane's turn
        # set once every thread stopped or one failed; the calling thread waits on this, not
        # on the condition, which is notified several times per task
        self.finished = threading.Event()
        self.capacity_bytes = capacity_bytes
        self.held_bytes = 0
        self.running = 0

    def wait(self) -> None:
        """Wait for a change; raise PipelineCancelled once something failed."""
        if self.error is not None:
            raise PipelineCancelled()
        self.condition.wait()
        if self.error is not None:
            raise PipelineCancelled()

    def is_turn(self, index: int) -> bool:
        """Whether every earlier task of the task's lane was consumed (call under the lock)."""
        predecessor = self.predecessors[index]
        return predecessor < 0 or self.consumed[predecessor]

    def fail(self, error: BaseException) -> None:
        with self.condition:
            if self.error is None:
                self.error = error
            self.condition.notify_all()
        self.finished.set()


class Pipeline(Generic[Task]):
    """Runs `produce(task)` and `consume(task, pieces)` for every task on `threads` threads,
    consuming the tasks of each lane in task order."""

    def __init__(self, produce: Callable[[Task], Iterable[bytes]], threads: int | None = None,
                 bytes_in_flight: int = DEFAULT_BYTES_IN_FLIGHT) -> None:
        self.produce = produce
        self.threads = max(1, threads or default_thread_count())
        self.bytes_in_flight = bytes_in_flight

    def run(self, tasks: Sequence[Task], consume: Callable[[Task, Iterator[bytes]], None],
            lane_of: Callable[[Task], Hashable] = _one_lane) -> None:
        """Process every task; tasks with the same `lane_of` are consumed in order, one at a
        time. Raises the first error from any thread."""
        if self.threads == 1 or len(tasks) <= 1:
            for task in tasks:
                _consume_all(consume, task, iter(self.produce(task)))
            return
        state = _PipelineState([lane_of(task) for task in tasks], self.bytes_in_flight)
        workers = [threading.Thread(target=self._work, args=(tasks, consume, state),
                                    name=f"dcpctl-worker-{n}", daemon=True)
                   for n in range(min(self.threads, len(tasks)))]
        state.running = len(workers)
        for worker in workers:
            worker.start()
        try:
            state.finished.wait()
        except BaseException as error:  # KeyboardInterrupt while waiting
            state.fail(error)
        finally:
            state.fail(PipelineCancelled())  # stops workers that are still going
            _join_within(workers, STOP_SECONDS)
        if not isinstance(state.error, PipelineCancelled):
            raise state.error

    def _work(self, tasks: Sequence[Task], consume: Callable, state: _PipelineState) -> None:
        try:
            while True:
                with state.condition:
                    if state.error is not None or state.next_task >= len(tasks):
                        return
                    index = state.next_task
                    state.next_task += 1
                self._run_task(index, tasks[index], consume, state)
        except PipelineCancelled:
            return
        except BaseException as error:
            state.fail(error)
        finally:
            with state.condition:
                state.running -= 1
                if not state.running:
                    state.finished.set()

    def _run_task(self, index: int, task: Task, consume: Callable,
                  state: _PipelineState) -> None:
        pieces = iter(self.produce(task))
        try:
            held = _hold_until_turn(index, task, pieces, state)
            if held is not None:
                _consume_lane(index, task, held, pieces, consume, state)
        finally:
            close = getattr(pieces, "close", None)
            if close is not None:
                close()


def _join_within(threads: list[threading.Thread], seconds: float) -> None:
    """Join the threads, giving up on those still running after `seconds` in all."""
    deadline = time.monotonic() + seconds
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))


def _hold_until_turn(index: int, task, pieces: Iterator[bytes], state: _PipelineState
                     ) -> collections.deque | None:
    """Produce and hold the task's pieces while earlier tasks of its lane are being consumed,
    within the shared budget. Returns what was held, as (piece, counted against the budget),
    once it is the task's turn; None when the task was parked whole, for the thread that
    consumes its predecessor to take over."""
    held: collections.deque = collections.deque()
    with state.condition:
        if state.is_turn(index):
            return held
    for piece in pieces:
        with state.condition:
            while not state.is_turn(index) and (
                    state.held_bytes + len(piece) > state.capacity_bytes):
                state.wait()
            if state.is_turn(index):
                held.append((piece, False))
                return held
            held.append((piece, True))
            state.held_bytes += len(piece)
    with state.condition:
        if state.is_turn(index):
            return held
        state.parked[index] = (task, held)
        return None


def _consume_lane(index: int, task, held: collections.deque, pieces: Iterator[bytes],
                  consume: Callable, state: _PipelineState) -> None:
    """Consume the task, then each parked task after it in its lane."""
    while True:
        _consume_all(consume, task, _cancellable(held, pieces, state))
        with state.condition:
            state.consumed[index] = True
            state.condition.notify_all()
            index = state.successors[index]
            task, held = state.parked.pop(index, (None, None))
        if held is None:
            return
        pieces = iter(())


def _cancellable(held: collections.deque, pieces: Iterator[bytes],
                 state: _PipelineState) -> Iterator[bytes]:
    """The held pieces, each leaving the budget once consumed, then the rest as produced;
    stops once another thread failed."""
    while held:
        piece, counted = held.popleft()
        yield piece
        if counted:
            with state.condition:
                state.held_bytes -= len(piece)
                state.condition.notify_all()
    for piece in pieces:
        if state.error is not None:
            raise PipelineCancelled()
        yield piece


def _consume_all(consume: Callable, task, pieces: Iterator[bytes]) -> None:
    """consume(task, pieces), then drain what it left unread so the task's work completes."""
    consume(task, pieces)
    for _ in pieces:
        pass
    failpoint(Failpoint.AFTER_DATA_WRITE)

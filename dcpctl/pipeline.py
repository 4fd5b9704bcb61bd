"""A bounded, ordered, multithreaded pipeline of byte pieces; it knows nothing about DCP.

Worker threads take tasks in order and turn each into a stream of output pieces (reading and
coding happen there: file reads, zstd and hashlib release the GIL). The calling thread consumes
the tasks' outputs strictly in task order, so results land in a deterministic order whatever the
thread count. Pieces waiting for the consumer share one budget of `bytes_in_flight`, so memory
is bounded by bytes in flight (plus one piece per thread), not by the number or size of tasks:
a worker that runs
ahead of the consumer blocks. The lowest unfinished task always has a running worker (tasks are
taken in order) that may always hand over a piece, so the consumer always makes progress. The first error anywhere cancels the
rest and is raised in the calling thread.
"""

from __future__ import annotations

import collections
import os
import threading
from typing import Callable, Generic, Iterable, Iterator, Sequence, TypeVar

Task = TypeVar("Task")

DEFAULT_BYTES_IN_FLIGHT = 64 << 20
_END = object()


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


def default_thread_count() -> int:
    """The number of cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


class PipelineCancelled(Exception):
    """Raised inside a worker or the consumer when another part of the pipeline failed."""


class _TaskOutput:
    """The output pieces of one task, waiting for the consumer."""

    def __init__(self, state: "_PipelineState", index: int) -> None:
        self._state = state
        self._index = index
        self._pieces: collections.deque = collections.deque()

    def put(self, piece) -> None:
        state = self._state
        with state.condition:
            # The task the consumer waits on may always add to an empty buffer, however large
            # the piece, so the pipeline never stalls; everything else waits for room.
            while (state.buffered_bytes + len(piece) > state.capacity_bytes
                   and not (self._index == state.consuming_index and not self._pieces)):
                state.wait()
            self._pieces.append(piece)
            state.buffered_bytes += len(piece)
            state.condition.notify_all()

    def close(self) -> None:
        with self._state.condition:
            self._pieces.append(_END)
            self._state.condition.notify_all()

    def take(self):
        state = self._state
        with state.condition:
            while not self._pieces:
                state.wait()
            piece = self._pieces.popleft()
            if piece is not _END:
                state.buffered_bytes -= len(piece)
                state.condition.notify_all()
            return piece


class _PipelineState:
    def __init__(self, capacity_bytes: int) -> None:
        self.condition = threading.Condition()
        self.error: BaseException | None = None
        self.next_task = 0
        self.consuming_index = 0
        self.capacity_bytes = capacity_bytes
        self.buffered_bytes = 0
        self.outputs: dict[int, _TaskOutput] = {}

    def wait(self) -> None:
        """Wait for a change; raise PipelineCancelled once something failed."""
        if self.error is not None:
            raise PipelineCancelled()
        self.condition.wait()
        if self.error is not None:
            raise PipelineCancelled()

    def fail(self, error: BaseException) -> None:
        with self.condition:
            if self.error is None:
                self.error = error
            self.condition.notify_all()


class Pipeline(Generic[Task]):
    """Runs `produce(task)` on worker threads and hands each task's pieces, in task order, to
    `consume(task, pieces)` on the calling thread."""

    def __init__(self, produce: Callable[[Task], Iterable[bytes]], threads: int | None = None,
                 bytes_in_flight: int = DEFAULT_BYTES_IN_FLIGHT) -> None:
        self.produce = produce
        self.threads = max(1, threads or default_thread_count())
        self.bytes_in_flight = bytes_in_flight

    def run(self, tasks: Sequence[Task], consume: Callable[[Task, Iterator[bytes]], None]) -> None:
        """Process every task; raises the first error from any thread."""
        state = _PipelineState(self.bytes_in_flight)
        workers = [threading.Thread(target=self._work, args=(tasks, state),
                                    name=f"dcpctl-worker-{n}", daemon=True)
                   for n in range(min(self.threads, len(tasks)))]
        for worker in workers:
            worker.start()
        try:
            for index, task in enumerate(tasks):
                pieces = self._pieces_of(index, state)
                consume(task, pieces)
                for _ in pieces:  # what consume left unread must not block its worker
                    pass
        except BaseException as error:
            state.fail(error)
        finally:
            state.fail(PipelineCancelled())  # stops workers that are still ahead
            for worker in workers:
                worker.join()
        if not isinstance(state.error, PipelineCancelled):
            raise state.error

    def _pieces_of(self, index: int, state: _PipelineState) -> Iterator[bytes]:
        with state.condition:
            state.consuming_index = index
            state.condition.notify_all()
            while index not in state.outputs:
                state.wait()
            output = state.outputs[index]
        while (piece := output.take()) is not _END:
            yield piece
        with state.condition:
            del state.outputs[index]

    def _work(self, tasks: Sequence[Task], state: _PipelineState) -> None:
        try:
            while True:
                with state.condition:
                    if state.error is not None or state.next_task >= len(tasks):
                        return
                    index = state.next_task
                    state.next_task += 1
                    output = state.outputs[index] = _TaskOutput(state, index)
                    state.condition.notify_all()
                pieces = iter(self.produce(tasks[index]))
                try:
                    for piece in pieces:
                        output.put(piece)
                finally:
                    close = getattr(pieces, "close", None)
                    if close is not None:
                        close()
                output.close()
        except PipelineCancelled:
            return
        except BaseException as error:
            state.fail(error)

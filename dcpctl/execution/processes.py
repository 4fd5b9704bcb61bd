"""Shares of a job run by local processes (`--workers N`): share 0 in this process, the
coordinator, on the plan it has made already; shares 1 to N - 1 on worker processes.

Workers are started with `spawn` (a fresh interpreter: no threads or locks inherited from the
coordinator; dcpctl's modules import in a fraction of a second, torch not at all), receive the
job and the storage options in force, plan the job themselves and run their share. Each sends
its progress and then its result or its error, one line, back through a pipe, which a thread of
the coordinator reads while the coordinator runs its own share. The first failure (a worker's,
a worker that ends without a result because it was killed, or the coordinator's own share)
stops the rest and is raised here naming the worker: the coordinator's share stops at its next
step of progress. So the caller aborts its output after every worker has stopped writing.
Workers ignore Ctrl-C (the coordinator stops them) and die with the coordinator.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import threading
from multiprocessing.connection import Connection, wait
from typing import Any, Callable

from dcpctl.execution.jobs import (BatchedProgress, ShareJob, WorkerError, describe_failure,
                                   packed_job, run_share_of, unpacked_job)

_PROGRESS_INTERVAL_SECONDS = 0.2

_Worker = tuple[int, multiprocessing.Process, Connection]  # share index, process, its pipe


def run_in_processes(job: ShareJob, plan: Any, count: int, advance: Callable[[int], None]
                     ) -> list[Any]:
    """Every share of job: share 0 here on `plan`, share i on worker process i; their results
    in share order."""
    context = multiprocessing.get_context("spawn")
    payload = packed_job(job)
    workers: list[_Worker] = []
    gathering: _Gathering | None = None
    try:
        for index in range(1, count):
            receiving, sending = context.Pipe(duplex=False)
            process = context.Process(
                target=_work, args=(payload, index, count, sending),
                name=f"dcpctl-worker-{index + 1}", daemon=True)
            process.start()
            sending.close()
            workers.append((index, process, receiving))
        advance = _serialized(advance)  # called by this share's threads and the pipe reader
        gathering = _Gathering(workers, count, advance)
        gathering.start()
        own = _run_own_share(job, plan, count, gathering, advance)
        gathering.join()
        if gathering.failure is not None:
            raise gathering.failure
        return [own, *gathering.results]
    finally:
        for _, process, _ in workers:
            if process.is_alive():
                process.terminate()
        for _, process, connection in workers:
            process.join()
        if gathering is not None:
            gathering.join()  # it ends once every worker's pipe is closed
        for _, _, connection in workers:
            connection.close()


def _run_own_share(job: ShareJob, plan: Any, count: int, gathering: _Gathering,
                   advance: Callable[[int], None]) -> Any:
    """Share 0, in this process; stopped, with the workers' failure raised, at its first step
    of progress after a worker failed."""
    def advance_unless_failed(units: int) -> None:
        if gathering.failure is not None:
            raise gathering.failure
        advance(units)

    try:
        return run_share_of(job, 0, count, advance_unless_failed, plan)
    except Exception as error:  # noqa: BLE001 - named as the workers' failures are
        if gathering.failure is not None:
            raise gathering.failure from None
        raise WorkerError(f"worker 1 of {count}: {describe_failure(error)}") from error


def _serialized(function: Callable[[int], None]) -> Callable[[int], None]:
    lock = threading.Lock()

    def call(units: int) -> None:
        with lock:
            function(units)
    return call


class _Gathering(threading.Thread):
    """Reads the workers' pipes: progress goes to advance, results into `results` (in share
    order), and the first failure into `failure`, which ends the reading."""

    def __init__(self, workers: list[_Worker], count: int,
                 advance: Callable[[int], None]) -> None:
        super().__init__(name="dcpctl-worker-pipes", daemon=True)
        self._advance = advance
        self.failure: WorkerError | None = None
        self.results: list[Any] = []
        self._workers = workers
        self._count = count

    def run(self) -> None:
        try:
            self.results = _gather(self._workers, self._count, self._advance)
        except WorkerError as error:
            self.failure = error
        except Exception as error:  # noqa: BLE001 - the coordinator raises it
            self.failure = WorkerError(f"reading the workers' results failed: "
                                       f"{describe_failure(error)}")


def _gather(workers: list[_Worker], count: int, advance: Callable[[int], None]) -> list[Any]:
    results: dict[int, Any] = {}
    pending = {connection: (index, process) for index, process, connection in workers}
    while pending:
        for connection in wait(list(pending)):
            index, process = pending[connection]
            try:
                kind, value = connection.recv()
            except (EOFError, OSError):
                process.join()
                raise WorkerError(f"worker {index + 1} of {count} ended without finishing its "
                                  f"share ({_how_it_ended(process.exitcode)})") from None
            if kind == "progress":
                advance(value)
            elif kind == "done":
                results[index] = value
                del pending[connection]
            else:
                raise WorkerError(f"worker {index + 1} of {count}: {value}")
    return [results[index] for index, _, _ in workers]


def _how_it_ended(exit_code: int | None) -> str:
    if exit_code is not None and exit_code < 0:
        return f"killed by {signal.Signals(-exit_code).name}"
    return f"exit status {exit_code}"


def _work(payload: bytes, index: int, count: int, connection: Connection) -> None:
    """A worker process: plan the job, run share `index`, send the result or the error."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the coordinator decides when to stop
    _die_with_parent()
    from dcpctl.allocator import reuse_large_buffers
    from dcpctl.failpoints import arm_in_worker

    reuse_large_buffers()
    arm_in_worker()
    progress = BatchedProgress(lambda units: connection.send(("progress", units)),
                               _PROGRESS_INTERVAL_SECONDS)
    try:
        result = run_share_of(unpacked_job(payload), index, count, progress.advance)
        progress.flush()
        connection.send(("done", result))
    except BaseException as error:  # noqa: BLE001 - every failure goes to the coordinator
        connection.send(("failed", describe_failure(error)))
    finally:
        connection.close()


def _die_with_parent() -> None:
    """Have the kernel kill this process when its parent dies (Linux), so a coordinator
    killed with SIGKILL leaves no worker writing on."""
    try:
        import ctypes
        libc = ctypes.CDLL(None)
        pr_set_pdeathsig = 1
        libc.prctl(pr_set_pdeathsig, signal.SIGKILL)
    except (OSError, AttributeError):
        return
    if os.getppid() == 1:  # the parent died before that took effect
        os._exit(1)

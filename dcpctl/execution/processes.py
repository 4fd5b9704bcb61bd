"""Shares of a job run by local worker processes (`--workers N`).

Workers are started with `spawn` (a fresh interpreter: no threads or locks inherited from the
coordinator; dcpctl's modules import in a fraction of a second, torch not at all), receive the
job and the storage options in force, plan the job themselves and run their share. Each sends
its progress and then its result or its error, one line, back through a pipe. The first failure,
or a worker that ends without a result (killed), stops the others and is raised here naming the
worker, so the caller aborts its output after every worker has stopped writing. Workers ignore
Ctrl-C (the coordinator stops them) and die with the coordinator.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
from multiprocessing.connection import Connection, wait
from typing import Any, Callable

from dcpctl.execution.jobs import (BatchedProgress, ShareJob, WorkerError, describe_failure,
                                   packed_job, run_share_of, unpacked_job)

_PROGRESS_INTERVAL_SECONDS = 0.2


def run_in_processes(job: ShareJob, count: int, advance: Callable[[int], None]) -> list[Any]:
    """Every share of job, share i on worker process i; their results in share order."""
    context = multiprocessing.get_context("spawn")
    payload = packed_job(job)
    workers: list[tuple[multiprocessing.Process, Connection]] = []
    try:
        for index in range(count):
            receiving, sending = context.Pipe(duplex=False)
            process = context.Process(
                target=_work, args=(payload, index, count, sending),
                name=f"dcpctl-worker-{index + 1}", daemon=True)
            process.start()
            sending.close()
            workers.append((process, receiving))
        return _gather(workers, advance)
    finally:
        for process, _ in workers:
            if process.is_alive():
                process.terminate()
        for process, connection in workers:
            process.join()
            connection.close()


def _gather(workers: list[tuple[multiprocessing.Process, Connection]],
            advance: Callable[[int], None]) -> list[Any]:
    count = len(workers)
    results: list[Any] = [None] * count
    pending = {connection: index for index, (_, connection) in enumerate(workers)}
    while pending:
        for connection in wait(list(pending)):
            index = pending[connection]
            try:
                kind, value = connection.recv()
            except (EOFError, OSError):
                process = workers[index][0]
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
    return results


def _how_it_ended(exit_code: int | None) -> str:
    if exit_code is not None and exit_code < 0:
        return f"killed by {signal.Signals(-exit_code).name}"
    return f"exit status {exit_code}"


def _work(payload: bytes, index: int, count: int, connection: Connection) -> None:
    """A worker process: plan the job, run share `index`, send the result or the error."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the coordinator decides when to stop
    _die_with_parent()
    from dcpctl.allocator import reuse_large_buffers

    reuse_large_buffers()
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

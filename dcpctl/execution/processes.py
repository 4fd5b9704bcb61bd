"""Shares of jobs run by local processes (`--workers N`): share 0 in this process, the
coordinator, on the plan it has made already; shares 1 to N - 1 on worker processes.

The workers are started with `spawn` (a fresh interpreter: no threads or locks inherited from
the coordinator; dcpctl's modules import in a fraction of a second, torch not at all) when the
command starts, before it checks and plans, so that their start-up overlaps that work; and
when the command knows its job's planning that early, it sends it ahead (plan_ahead), and the
workers plan while the coordinator does (jobs.PlansMadeAhead). They serve every job of the
command: each receives the job and the storage options in force, runs its share, and sends its
progress and then its result or its error back through its pipe, which a thread of the
coordinator reads while the coordinator runs its own share. The first failure (a worker's, a
worker that ends without a result because it was killed, or the coordinator's own share) stops
the rest and is raised here naming the worker: the coordinator's share stops at its next step
of progress, and the workers are terminated. So the caller aborts its output after every worker
has stopped writing. Workers ignore Ctrl-C (the coordinator stops them) and die with the
coordinator.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal
import threading
import time
from multiprocessing.connection import Connection, wait
from typing import Any, Callable

from dcpctl.execution.jobs import (BatchedProgress, Planning, PlansMadeAhead, ShareJob,
                                   WorkerError, describe_failure, packed, run_share_of)
from dcpctl.execution.parent_death import die_with_parent
from dcpctl.stopping import (Terminated, describe_stop, end_quietly_when_stopped,
                             stop_once_on_signals)
from dcpctl.storage.stores import abort_open_uploads

_PROGRESS_INTERVAL_SECONDS = 0.2
_WAIT_SECONDS = 0.1  # how often a worker waiting for its next job looks for a stop
WORKER_STOP_SECONDS = 20.0
"""How long terminated workers get to stop their shares (at most pipeline.STOP_SECONDS) and
abort their uploads before they are killed."""

_Worker = tuple[int, multiprocessing.Process, Connection]  # share index, process, its pipe


class LocalWorkers:
    """The worker processes of `--workers count`, started at once (see the module docstring);
    stop() ends them."""

    def __init__(self, count: int) -> None:
        self.count = count
        self._workers: list[_Worker] = []
        self._stopped = False
        context = multiprocessing.get_context("spawn")
        try:
            for index in range(1, count):
                ours, theirs = context.Pipe()
                process = context.Process(target=_serve, args=(index, count, theirs),
                                          name=f"dcpctl-worker-{index + 1}", daemon=True)
                process.start()
                theirs.close()
                self._workers.append((index, process, ours))
        except BaseException:
            self.stop()
            raise

    def plan_ahead(self, planning: Planning) -> None:
        """Have every worker plan `planning` now, ahead of the job that has it."""
        data = packed(planning)
        for _, _, connection in self._workers:
            try:
                connection.send(("plan", data))
            except OSError:  # a worker that died says so when its job is sent
                continue

    def run(self, job: ShareJob, plan: Any, advance: Callable[[int], None]) -> list[Any]:
        """Every share of job: share 0 here on `plan`, share i on worker i; their results in
        share order. After a failure the workers are stopped, and so is this team."""
        if self._stopped:
            raise WorkerError("the workers were stopped by an earlier failure")
        message = ("job", (packed(job), packed(job.planning)))
        advance = _serialized(advance)  # called by this share's threads and the pipe reader
        gathering = _Gathering(self._workers, self.count, message, advance)
        gathering.start()
        try:
            own = _run_own_share(job, plan, self.count, gathering, advance)
            gathering.join()
            if gathering.failure is not None:
                raise gathering.failure
            return [own, *gathering.results]
        except BaseException:
            self._end_processes()
            raise
        finally:
            gathering.join()  # it ends once every worker's pipe is closed

    def stop(self) -> None:
        """End every worker (terminating any still at work) and close their pipes."""
        self._end_processes()
        for _, _, connection in self._workers:
            connection.close()

    def _end_processes(self) -> None:
        """Terminate the workers still at work, and wait for them: each stops its share and
        aborts its uploads (_serve), and is killed where that takes past WORKER_STOP_SECONDS
        (a store that stopped answering)."""
        self._stopped = True
        for _, process, _ in self._workers:
            if process.is_alive():
                process.terminate()
        deadline = time.monotonic() + WORKER_STOP_SECONDS
        for _, process, _ in self._workers:
            process.join(max(deadline - time.monotonic(), 0))
            if process.is_alive():
                process.kill()
                process.join()


def _run_own_share(job: ShareJob, plan: Any, count: int, gathering: _Gathering,
                   advance: Callable[[int], None]) -> Any:
    """Share 0, in this process; stopped, with the workers' failure raised, at its first step
    of progress after a worker failed."""
    def advance_unless_failed(units: int) -> None:
        if gathering.failure is not None:
            raise _AnotherShareFailed()
        advance(units)

    try:
        return run_share_of(job, 0, count, advance_unless_failed, plan)
    except Exception as error:  # noqa: BLE001 - named as the workers' failures are
        if gathering.failure is not None:
            raise gathering.failure from None
        raise WorkerError(f"worker 1 of {count}: {describe_failure(error)}") from error


class _AnotherShareFailed(Exception):
    """What stops this process's own share once a worker failed: not a DcpctlError, so that
    nothing on the way up takes it for a failure of its own (gives it the place of the item
    it was in, reports it as that item's problem); the worker's failure is raised instead."""


def _serialized(function: Callable[[int], None]) -> Callable[[int], None]:
    lock = threading.Lock()

    def call(units: int) -> None:
        with lock:
            function(units)
    return call


class _Gathering(threading.Thread):
    """Hands a job to the workers, then reads their pipes: progress goes to advance, results
    into `results` (in share order), and the first failure into `failure`, which ends the
    reading. The job is sent from this thread so that the coordinator's own share starts at
    once, whatever a worker still planning ahead leaves unread."""

    def __init__(self, workers: list[_Worker], count: int, message: tuple,
                 advance: Callable[[int], None]) -> None:
        super().__init__(name="dcpctl-worker-pipes", daemon=True)
        self._advance = advance
        self.failure: WorkerError | None = None
        self.results: list[Any] = []
        self._workers = workers
        self._count = count
        self._message = message

    def run(self) -> None:
        try:
            for index, process, connection in self._workers:
                try:
                    connection.send(self._message)
                except OSError:
                    raise _ended(index, self._count, process) from None
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
                raise _ended(index, count, process) from None
            if kind == "progress":
                advance(value)
            elif kind == "done":
                results[index] = value.adopted()
                del pending[connection]
            else:
                raise WorkerError(f"worker {index + 1} of {count}: {value}")
    return [results[index] for index, _, _ in workers]


def _ended(index: int, count: int, process: multiprocessing.Process) -> WorkerError:
    """The failure of a worker whose pipe closed before it finished its share."""
    process.join()
    exit_code = process.exitcode
    if exit_code is not None and exit_code < 0:
        how = f"killed by {signal.Signals(-exit_code).name}"
    else:
        how = f"exit status {exit_code}"
    return WorkerError(f"worker {index + 1} of {count} ended without finishing its share "
                       f"({how})")


def _serve(index: int, count: int, connection: Connection) -> None:
    """A worker process: plan what is sent ahead, run share `index` of each job sent, send
    each result or error; end when the coordinator closes the pipe. A share that fails, or
    that SIGTERM or SIGHUP stops (the coordinator ending it), aborts the uploads it left open
    first: its coordinator's clean-up reaches only its own."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the coordinator decides when to stop
    die_with_parent()  # a coordinator killed with SIGKILL leaves no worker writing on
    from dcpctl.allocator import reuse_large_buffers
    from dcpctl.cycle_collector import freeze_built_objects_on_resume
    from dcpctl.failpoints import arm_in_worker
    from dcpctl.library_logs import quiet_library_logs
    from dcpctl.unpickling_memory import bound_unpickling_memory

    # as the command's own process does (cli/main.py)
    reuse_large_buffers()
    quiet_library_logs()
    bound_unpickling_memory()
    freeze_built_objects_on_resume()
    stop_once_on_signals()
    arm_in_worker()
    with connection:
        try:
            _serve_jobs(index, count, connection)
            end_quietly_when_stopped()  # the coordinator is done with it: nothing to abort
        except Terminated as stop:
            abort_open_uploads()
            with contextlib.suppress(OSError):  # the coordinator may have stopped reading
                connection.send(("failed", describe_stop(stop)))
            os._exit(128 + stop.signal_number)  # not waiting for threads stuck on a store


def _serve_jobs(index: int, count: int, connection: Connection) -> None:
    plans = PlansMadeAhead()
    progress = BatchedProgress(lambda units: connection.send(("progress", units)),
                               _PROGRESS_INTERVAL_SECONDS)
    while True:
        try:
            # a wait in Python, not a read that blocks on the pipe: a stop whose handler ran
            # just before such a read was acted on only once the read returned
            while not connection.poll(_WAIT_SECONDS):
                pass
            kind, value = connection.recv()
        except EOFError:
            return
        if kind == "plan":
            plans.make(value)
            continue
        try:
            result = plans.run_share(*value, index, count, progress.advance)
            progress.flush()
            connection.send(("done", result))
        except Terminated:
            raise
        except BaseException as error:  # noqa: BLE001 - every failure goes to the coordinator
            abort_open_uploads()
            connection.send(("failed", describe_failure(error)))
            return

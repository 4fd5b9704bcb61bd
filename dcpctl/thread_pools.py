"""Thread pools that do not hold up a failure, nor the end of the process.

concurrent.futures' ThreadPoolExecutor waits for its threads twice: when a `with` block of it
ends, even by an error or a stop (Ctrl-C, SIGTERM), and when Python exits, for every pool ever
made. A thread stuck in a call to a store that stopped answering then holds the command, after
its error was said, until the store's client gives up: minutes on S3 (8 tries of up to 60 s).
DaemonThreadPool's threads are daemon threads, which Python's exit does not wait for, and
thread_pool waits for them only when its block succeeds; after a failure it cancels what has
not started and lets the rest run on unwaited (what they read or write, the failing command
discards as it unwinds).
"""

from __future__ import annotations

import contextlib
import queue
import threading
from concurrent.futures import Future
from typing import Any, Callable, Iterable, Iterator


class DaemonThreadPool:
    """submit() and map() as ThreadPoolExecutor has them, on at most max_workers daemon
    threads started as work comes (see the module docstring)."""

    def __init__(self, max_workers: int, name: str) -> None:
        self._max_workers = max(1, max_workers)
        self._name = name
        self._work: queue.SimpleQueue = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []
        self._idle = threading.Semaphore(0)  # released by a thread that finished its item
        self._lock = threading.Lock()
        self._shut_down = False

    def submit(self, function: Callable, *args: Any) -> Future:
        future: Future = Future()
        with self._lock:
            if self._shut_down:
                raise RuntimeError("cannot submit work to a pool that was shut down")
            self._work.put((future, function, args))
            if not self._idle.acquire(blocking=False) and len(self._threads) < self._max_workers:
                thread = threading.Thread(target=self._serve, daemon=True,
                                          name=f"{self._name}_{len(self._threads)}")
                thread.start()
                self._threads.append(thread)
        return future

    def map(self, function: Callable, items: Iterable) -> Iterator:
        """function(item) for each item, in their order; what has not started yet is
        cancelled when the results are dropped unread (an error in one of them, say)."""
        futures = [self.submit(function, item) for item in items]

        def results() -> Iterator:
            try:
                for future in futures:
                    yield future.result()
            finally:
                for future in futures:
                    future.cancel()
        return results()

    def shutdown(self, wait: bool = True, cancel_futures: bool = False) -> None:
        """No more work; with cancel_futures, what has not started is cancelled; with wait,
        return once every thread has ended."""
        with self._lock:
            self._shut_down = True
            if cancel_futures:
                while True:
                    try:
                        item = self._work.get_nowait()
                    except queue.Empty:
                        break
                    if item is not None:
                        item[0].cancel()
            for _ in self._threads:
                self._work.put(None)  # one each: the end of its work
        if wait:
            for thread in self._threads:
                thread.join()

    def _serve(self) -> None:
        while True:
            item = self._work.get()
            if item is None:
                return
            future, function, args = item
            item = None
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(function(*args))
                except BaseException as error:  # noqa: BLE001 - handed to whoever waits on it
                    future.set_exception(error)
            future = function = args = None  # nothing held while idle
            self._idle.release()


@contextlib.contextmanager
def thread_pool(threads: int, name: str) -> Iterator[DaemonThreadPool]:
    """A DaemonThreadPool of `threads` threads named after `name`, shut down as the block
    ends: waited for after success, not after a failure (see the module docstring)."""
    pool = DaemonThreadPool(threads, name)
    try:
        yield pool
    except BaseException:
        pool.shutdown(wait=False, cancel_futures=True)
        raise
    pool.shutdown(wait=True)

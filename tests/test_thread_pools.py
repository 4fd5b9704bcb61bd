"""The daemon thread pools: what ThreadPoolExecutor gives (results in order, errors raised
where they are waited for), without holding up a failure or the end of the process."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
import time

import pytest

from dcpctl.thread_pools import DaemonThreadPool, thread_pool


def test_results_come_in_order_and_errors_where_they_are_waited_for():
    with thread_pool(3, "test") as pool:
        assert list(pool.map(lambda n: n * n, range(20))) == [n * n for n in range(20)]
        failing = pool.submit(lambda: 1 / 0)
        with pytest.raises(ZeroDivisionError):
            failing.result()
        assert pool.submit(lambda a, b: a + b, 2, 3).result() == 5


def test_a_failed_block_does_not_wait_and_cancels_what_had_not_started():
    release, started = threading.Event(), []

    def stuck(n):
        started.append(n)
        release.wait()

    begun = time.monotonic()
    with pytest.raises(KeyError):
        with thread_pool(2, "test") as pool:
            futures = [pool.submit(stuck, n) for n in range(6)]
            while len(started) < 2:
                time.sleep(0.01)
            raise KeyError("a failure while two threads are stuck")
    assert time.monotonic() - begun < 5
    assert [future.cancelled() for future in futures[2:]] == [True] * 4
    release.set()


def test_a_successful_block_waits_for_every_thread():
    done = []
    with thread_pool(2, "test") as pool:
        for n in range(4):
            pool.submit(lambda n=n: (time.sleep(0.05), done.append(n)))
    assert sorted(done) == [0, 1, 2, 3]
    with pytest.raises(RuntimeError):
        pool.submit(print)


def test_the_process_ends_though_a_thread_of_a_pool_never_returns():
    """concurrent.futures joins every pool's threads as Python exits."""
    code = textwrap.dedent("""
        import threading
        from dcpctl.thread_pools import DaemonThreadPool
        DaemonThreadPool(2, "stuck").submit(threading.Event().wait)
        print("leaving")
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60)
    assert (done.returncode, done.stdout) == (0, "leaving\n")


def test_threads_start_only_as_work_comes_and_are_reused():
    pool = DaemonThreadPool(8, "test")
    for _ in range(5):
        pool.submit(time.sleep, 0).result()
    assert len(pool._threads) == 1
    pool.shutdown()

"""Thread pools that do not hold up a failure.

A `with ThreadPoolExecutor()` block waits for every thread when it ends, even when it ends by
an error or a stop (Ctrl-C, SIGTERM): a thread stuck in a call to a store that stopped
answering would hold the command until the store's client gives up, minutes later. thread_pool
waits for its threads only when its block succeeds; after a failure it cancels what has not
started and lets the rest run on unwaited (what they read or write, the failing command
discards as it unwinds).
"""

from __future__ import annotations

import contextlib
from concurrent.futures import ThreadPoolExecutor
from typing import Iterator


@contextlib.contextmanager
def thread_pool(threads: int, name: str) -> Iterator[ThreadPoolExecutor]:
    """A ThreadPoolExecutor of `threads` threads named after `name`, shut down as the block
    ends: waited for after success, not after a failure (see the module docstring)."""
    pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix=name)
    try:
        yield pool
    except BaseException:
        pool.shutdown(wait=False, cancel_futures=True)
        raise
    pool.shutdown(wait=True)

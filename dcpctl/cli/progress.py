"""Progress bars on stderr for long operations (hidden when stderr is not a terminal)."""

from __future__ import annotations

import contextlib
import sys
import threading
from typing import Callable, Iterator


def _ignore(done_bytes: int, total_bytes: int) -> None:
    pass


@contextlib.contextmanager
def byte_progress(description: str) -> Iterator[Callable[[int, int], None]]:
    """Yields `advance(bytes_done, total_bytes)` for ops, callable from any thread; the bar
    starts on the first call, and starts over when the total changes (a command that first
    hashes the files SHA256SUMS lists, then does its work). Where stderr is not a terminal (a
    cron job, a pipe) there is no bar, and tqdm is not even imported."""
    if not sys.stderr.isatty():
        yield _ignore
        return
    from tqdm import tqdm

    bars: list[tqdm] = []
    current_total = [0]
    lock = threading.Lock()

    def advance(done_bytes: int, total_bytes: int) -> None:
        with lock:
            if not bars:
                bars.append(tqdm(total=total_bytes, unit="B", unit_scale=True,
                                 unit_divisor=1024, desc=description, leave=False,
                                 dynamic_ncols=True))
            elif current_total[0] != total_bytes:  # the next pass (hashing done, the work)
                bars[0].reset(total=total_bytes)
            current_total[0] = total_bytes
            bars[0].update(done_bytes)

    try:
        yield advance
    finally:
        for bar in bars:
            bar.close()

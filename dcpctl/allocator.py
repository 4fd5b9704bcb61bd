"""Let the C allocator reuse large buffers instead of mapping fresh memory for each (glibc).

The pipelines allocate pieces of a few MiB over and over. Above its mmap threshold glibc gives
each allocation a fresh mapping that the kernel faults in and zeroes page by page, and faults
from several threads contend for one lock: a tenth of a compress run went there. With the
threshold at its maximum and the heap not trimmed back, freed pieces are reused. Each arena
(glibc gives threads up to eight per core) keeps its own freed pieces, so memory would grow with
the thread count: two arenas share them among all threads (a command on a bucket runs many
threads that mostly wait: at 8 threads a compress bucket -> bucket peaked at 0.62 GB with an
arena per thread, 0.40 GB with two). Threads seldom meet on an arena's lock: a few allocations
per MiB of work.
"""

from __future__ import annotations

import ctypes

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_M_ARENA_MAX = -8
_MMAP_THRESHOLD_BYTES = 32 << 20  # the largest glibc accepts on 64-bit systems
_TRIM_THRESHOLD_BYTES = 256 << 20
_ARENAS = 2


def reuse_large_buffers() -> None:
    """Tune glibc's malloc for many short-lived buffers of a few MiB; elsewhere, do nothing."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):  # not glibc
        return
    mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_BYTES)
    mallopt(_M_TRIM_THRESHOLD, _TRIM_THRESHOLD_BYTES)
    mallopt(_M_ARENA_MAX, _ARENAS)

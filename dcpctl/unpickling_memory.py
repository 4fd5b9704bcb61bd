"""A cap on the memory an unpickling of `.metadata` may take, in dcpctl's own processes.

CPython's C unpickler sizes its memo table by the largest index a pickle names: one LONG_BINPUT
of index 2**30 in a file of a few bytes asks for 16 GiB, zeroed, before anything else is read
(CPython gh-115952; releases before its fix). No allowlist sees it: it names no class. So while
a `.metadata` is unpickled, the process's data segment (RLIMIT_DATA: its heap and private
mappings) may grow by a budget that follows the file, far more than an honest one takes (about
12 bytes per byte of pickle at a million chunks), and such an index fails at once with
MemoryError. The limit is the process's, for every thread, so only dcpctl's own processes turn
it on (the command, its workers, its torchrun ranks): a training job that loads through
dcpctl.storage_reader keeps its memory to itself.
"""

from __future__ import annotations

import contextlib
import resource
import threading
from typing import Iterator

_BUDGET_BYTES_PER_PICKLE_BYTE = 64
_BUDGET_BASE_BYTES = 1 << 30

_bounded = False
_lock = threading.Lock()
_unpicklings = 0  # running under the cap; the limit is lifted when the last one ends
_limit_before: tuple[int, int] | None = None


def bound_unpickling_memory() -> None:
    """Cap what each unpickling of `.metadata` in this process may take (see the module)."""
    global _bounded
    _bounded = True


def memory_budget_bytes(pickle_bytes: int) -> int:
    """What an unpickling of a pickle of pickle_bytes may add to the process's data segment."""
    return _BUDGET_BASE_BYTES + _BUDGET_BYTES_PER_PICKLE_BYTE * pickle_bytes


@contextlib.contextmanager
def bounded_memory(pickle_bytes: int) -> Iterator[None]:
    """While the block runs, the data segment may grow by memory_budget_bytes(pickle_bytes),
    where this process bounds unpickling (and Linux counts its data segment); beyond that,
    allocations fail with MemoryError. Nested and concurrent uses each keep their room."""
    global _unpicklings, _limit_before
    data_bytes = _data_segment_bytes() if _bounded else None
    if data_bytes is None:
        yield
        return
    with _lock:
        soft, hard = resource.getrlimit(resource.RLIMIT_DATA)
        if _unpicklings == 0:
            _limit_before = (soft, hard)
        wanted = data_bytes + memory_budget_bytes(pickle_bytes)
        if _unpicklings:  # another unpickling's room stays
            wanted = max(wanted, soft)
        for limit in (_limit_before[0], hard):  # never past a limit set by someone else
            if limit != resource.RLIM_INFINITY:
                wanted = min(wanted, limit)
        resource.setrlimit(resource.RLIMIT_DATA, (wanted, hard))
        _unpicklings += 1
    try:
        yield
    finally:
        with _lock:
            _unpicklings -= 1
            if _unpicklings == 0:
                resource.setrlimit(resource.RLIMIT_DATA, _limit_before)


def _data_segment_bytes() -> int | None:
    """The process's data segment as RLIMIT_DATA counts it (VmData), or None where the system
    does not tell."""
    try:
        with open("/proc/self/status", "rb") as status:
            for line in status:
                if line.startswith(b"VmData:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None

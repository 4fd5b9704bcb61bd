"""Buffers of a few MiB come back from the allocator's heap once it is tuned (glibc only)."""

from __future__ import annotations

import ctypes
import resource
import subprocess
import sys
import threading
from pathlib import Path

import pytest

_BUFFER_BYTES = 4 << 20
_BUFFERS_PER_THREAD = 40


def _allocate_like_a_pipeline() -> None:
    """Buffers of a few MiB, each kept a little while, as pieces in flight are."""
    kept = []
    for index in range(_BUFFERS_PER_THREAD):
        buffer = bytearray(_BUFFER_BYTES - 1000 * (index % 7))
        kept.append(buffer)
        if len(kept) > 3:
            kept.pop(0)


def page_faults_in_steady_state() -> int:
    """Minor page faults of two threads allocating, after a first round warmed the heap up."""
    def round_of_two_threads() -> int:
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        threads = [threading.Thread(target=_allocate_like_a_pipeline) for _ in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before

    round_of_two_threads()
    return round_of_two_threads()


_MEASURE = ("import sys; sys.path.insert(0, {tests!r}); import test_allocator as t; "
            "{tune}print(t.page_faults_in_steady_state())")


def _faults(tune: bool) -> int:
    code = _MEASURE.format(tests=str(Path(__file__).parent), tune=(
        "from dcpctl.allocator import reuse_large_buffers; reuse_large_buffers(); "
        if tune else ""))
    return int(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                              check=True).stdout)


@pytest.mark.skipif(not hasattr(ctypes.CDLL(None), "mallopt"), reason="not glibc")
def test_freed_buffers_are_reused_instead_of_faulted_in_afresh():
    pages_allocated = 2 * _BUFFERS_PER_THREAD * _BUFFER_BYTES // 4096
    untuned, tuned = _faults(tune=False), _faults(tune=True)
    assert tuned < pages_allocated // 20
    assert untuned > 4 * tuned  # what the tuning is for: without it, pages fault in again

"""Buffers of a few MiB come from the allocator's heap, not fresh mappings, once it is tuned
(glibc only): a fresh mapping is faulted in and zeroed page by page on every use."""

from __future__ import annotations

import ctypes
import subprocess
import sys

import pytest

_GLIBC = ctypes.CDLL(None)

# In a new process (an allocator nobody has used for large buffers yet): how many regions
# glibc maps for buffers of a few MiB, after dcpctl's tuning or without it.
_COUNT_MAPPED_REGIONS = """
import ctypes
from dcpctl.allocator import reuse_large_buffers

class MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
        "fordblks", "keepcost")]

mallinfo2 = ctypes.CDLL(None).mallinfo2
mallinfo2.restype = MallInfo2
if {tune}:
    reuse_large_buffers()
before = mallinfo2().hblks
buffers = [bytearray((4 << 20) - 1000 * index) for index in range(3)]
print(mallinfo2().hblks - before)
"""


def _mapped_regions(tune: bool) -> int:
    result = subprocess.run([sys.executable, "-c", _COUNT_MAPPED_REGIONS.format(tune=tune)],
                            capture_output=True, text=True, check=True)
    return int(result.stdout)


@pytest.mark.skipif(not hasattr(_GLIBC, "mallinfo2"), reason="not glibc 2.33 or newer")
def test_buffers_of_a_few_mib_come_from_the_heap_once_tuned():
    assert _mapped_regions(tune=False) == 3  # glibc's default: a mapping of its own each
    assert _mapped_regions(tune=True) == 0

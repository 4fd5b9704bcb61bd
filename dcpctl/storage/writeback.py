"""Starting the write-out of a local file's bytes while the file is still being written.

A new file's bytes sit in the page cache until its closing fsync writes them to disk, so
without help the fsync of a gigabyte waits for a gigabyte of write-out after the work is done
(Linux starts writing dirty pages by itself only past dirty_background_ratio of memory or
after 30 seconds). Asking the kernel to start writing every few megabytes, as the bytes come
(Linux's sync_file_range with SYNC_FILE_RANGE_WRITE, which does not wait for the write-out),
overlaps it with the work; the closing fsync, which durability still rests on, then finds
little left to do. Where sync_file_range is missing (not Linux) nothing is started early.
"""

from __future__ import annotations

import functools
from typing import Callable

WRITEBACK_BYTES = 8 << 20
"""Bytes written between two requests to start their write-out."""
_SYNC_FILE_RANGE_WRITE = 2


class Writeback:
    """Counts the bytes written to one file descriptor and, every WRITEBACK_BYTES, starts the
    write-out of the file's dirty pages (bytes a writer still buffers wait for the next time,
    or for the fsync). A hint: whatever it fails to do, the closing fsync does, and reports."""

    def __init__(self, descriptor: int) -> None:
        self._descriptor = descriptor
        self._unstarted_bytes = 0

    def written(self, size_bytes: int) -> None:
        """Count size_bytes just written."""
        self._unstarted_bytes += size_bytes
        if self._unstarted_bytes >= WRITEBACK_BYTES:
            self._unstarted_bytes = 0
            start_writeout = _start_writeout()
            if start_writeout is not None:  # 0, 0: the whole file
                start_writeout(self._descriptor, 0, 0, _SYNC_FILE_RANGE_WRITE)


@functools.cache
def _start_writeout() -> Callable[[int, int, int, int], int] | None:
    """libc's sync_file_range, or None where there is none."""
    import ctypes
    try:
        function = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    function.argtypes = (ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint)
    function.restype = ctypes.c_int
    return function

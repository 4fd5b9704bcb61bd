"""A process that the kernel ends when the process that started it dies (Linux), so that
nothing it started goes on alone: a worker whose coordinator was killed, a torchrun rank whose
agent was killed while the rank still waited to join the job."""

from __future__ import annotations

import os
import signal

_PR_SET_PDEATHSIG = 1


def die_with_parent(signal_number: int = signal.SIGKILL) -> None:
    """Have the kernel send this process signal_number when its parent dies (0: no longer);
    where the parent died already, end now. Nothing where the system has no prctl."""
    try:
        import ctypes
        libc = ctypes.CDLL(None)
        libc.prctl(_PR_SET_PDEATHSIG, signal_number)
    except (OSError, AttributeError):
        return
    if signal_number and os.getppid() == 1:  # the parent died before that took effect
        os._exit(1)

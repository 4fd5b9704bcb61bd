"""Holding off Python's cycle collector while millions of small objects are built."""

import contextlib
import gc


@contextlib.contextmanager
def paused_cycle_collector():
    """Building millions of small objects triggers the cycle collector over and over, tripling
    the time; nothing built here forms cycles, so hold it off until done."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()

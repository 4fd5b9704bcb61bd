"""Holding off Python's cycle collector while millions of small objects are built."""

import contextlib
import gc

_freezes_on_resume = False


def freeze_built_objects_on_resume() -> None:
    """For the command-line process: when the collector resumes after a pause, move every
    object then alive to its permanent generation (gc.freeze). Resumed as it is, the collector
    would walk the millions of records just built at its next collections, several times over,
    though none of them is ever cyclic garbage. A program using dcpctl as a library keeps
    Python's default."""
    global _freezes_on_resume
    _freezes_on_resume = True


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
            if _freezes_on_resume:
                gc.freeze()
            gc.enable()

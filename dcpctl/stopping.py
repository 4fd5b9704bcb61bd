"""Stopping when asked (Ctrl-C, SIGTERM, SIGHUP), at a moment that leaves nothing half done.

Python turns SIGINT into KeyboardInterrupt in the main thread; stop_on_signals() does the same
for SIGTERM (kill, timeout, a scheduler's preemption) and SIGHUP (a lost terminal), raising
Terminated, so a command stopped either way unwinds and removes its temporary files and staged
outputs. A few steps must not be cut in two once begun (the renames that publish a rewritten
checkpoint): inside `finishing_first()` a stop request waits, and is raised as the block ends.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from typing import Callable, Iterable, Iterator


class Terminated(BaseException):
    """SIGTERM or SIGHUP arrived. Like KeyboardInterrupt it is not an Exception, so nothing on
    the way mistakes it for a failure to report; cleanup runs as it passes."""

    def __init__(self, signal_number: int) -> None:
        super().__init__(signal.Signals(signal_number).name)
        self.signal_number = signal_number


_STOPPING_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
_state = threading.local()  # signal handlers run in the main thread, between its bytecodes


def handle_stops(handler: Callable[[int, object], None],
                 signal_numbers: Iterable[int] = _STOPPING_SIGNALS) -> None:
    """Handle the stopping signals (or these of them) with handler, in the main thread. A
    signal someone chose to ignore (nohup ignores SIGHUP) stays ignored."""
    for signal_number in signal_numbers:
        if signal.getsignal(signal_number) is not signal.SIG_IGN:
            signal.signal(signal_number, handler)


def stop_on_signals() -> None:
    """Install the handlers (call once, in the main thread of a dcpctl process)."""
    handle_stops(_request_stop)


def stop_once_on_signals() -> None:
    """For a worker process (execution/processes.py), whose coordinator acts on Ctrl-C for it:
    the first SIGTERM or SIGHUP raises Terminated, and those that follow do nothing while the
    worker stops (a signal to the whole process group is followed by the coordinator's own
    SIGTERM), so that it aborts what it wrote; its coordinator kills it if that takes too
    long. A signal someone chose to ignore stays ignored."""
    handle_stops(_stop_once, (signal.SIGTERM, signal.SIGHUP))


def end_quietly_when_stopped() -> None:
    """For a worker process whose work is over (its coordinator closed the pipe, no result
    left to send): a stop from now on ends it at once, as the signal's default does, rather
    than raising Terminated into its exit (a traceback from its atexit handlers)."""
    for signal_number in (signal.SIGTERM, signal.SIGHUP):
        if signal.getsignal(signal_number) is not signal.SIG_IGN:
            signal.signal(signal_number, signal.SIG_DFL)


_stop_raised = False


def _stop_once(signal_number: int, frame) -> None:
    global _stop_raised
    if not _stop_raised:
        _stop_raised = True
        _request_stop(signal_number, frame)  # raised now, or as a finishing_first block ends


@contextlib.contextmanager
def finishing_first(finished: str | None = None) -> Iterator[None]:
    """Run the block to its end even if a stop is requested meanwhile; then stop (the stop
    wins over an error the block raised). `finished` says what a block that ended without
    error has done, which the stop's message (describe_stop) then tells: the user stopped a
    run whose output is whole all the same."""
    if getattr(_state, "deferred", None) is not None:  # nested: the outer block decides
        yield
        return
    _state.deferred = []
    ended_without_error = False
    try:
        yield
        ended_without_error = True
    finally:
        deferred, _state.deferred = _state.deferred, None
        if deferred:
            _raise_stop(deferred[0], finished if ended_without_error else None)


def _request_stop(signal_number: int, frame) -> None:
    deferred = getattr(_state, "deferred", None)
    if deferred is not None:
        deferred.append(signal_number)
        return
    _raise_stop(signal_number)


def _raise_stop(signal_number: int, finished: str | None = None) -> None:
    stop = KeyboardInterrupt() if signal_number == signal.SIGINT else Terminated(signal_number)
    stop.finished = finished
    raise stop


def describe_stop(stop: KeyboardInterrupt | Terminated) -> str:
    """How a command's stop is said: by its signal, and with what a finishing_first block it
    waited for had finished."""
    said = "interrupted" if isinstance(stop, KeyboardInterrupt) else f"stopped by {stop}"
    finished = getattr(stop, "finished", None)
    return f"{said}, after finishing what a stop waits for: {finished}" if finished else said

"""Stops (SIGTERM, SIGHUP, Ctrl-C) wait for a finishing_first block, then win."""

from __future__ import annotations

import signal
import subprocess
import sys

import pytest

from dcpctl.stopping import Terminated, finishing_first, stop_on_signals


@pytest.fixture
def stopping_handlers():
    saved = {number: signal.getsignal(number)
             for number in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    for number in saved:  # a shell running pytest in the background ignores SIGINT
        signal.signal(number, signal.SIG_DFL)
    stop_on_signals()
    yield
    for number, handler in saved.items():
        signal.signal(number, handler)


def test_a_stop_outside_a_block_is_raised_at_once(stopping_handlers):
    with pytest.raises(Terminated) as stopped:
        signal.raise_signal(signal.SIGTERM)
    assert stopped.value.signal_number == signal.SIGTERM


def test_a_stop_inside_a_block_waits_for_its_end(stopping_handlers):
    steps = []
    with pytest.raises(Terminated, match="SIGHUP"):
        with finishing_first():
            signal.raise_signal(signal.SIGHUP)
            steps.append("after the signal")
            with finishing_first():  # nested: still deferred to the outer block's end
                steps.append("inner block")
            steps.append("end of the block")
    assert steps == ["after the signal", "inner block", "end of the block"]


def test_the_stop_wins_over_an_error_the_block_raises(stopping_handlers):
    with pytest.raises(KeyboardInterrupt) as stopped:
        with finishing_first():
            signal.raise_signal(signal.SIGINT)
            raise OSError("disk full")
    assert isinstance(stopped.value.__context__, OSError)


def test_without_a_stop_the_block_error_passes_through(stopping_handlers):
    with pytest.raises(OSError, match="disk full"):
        with finishing_first():
            raise OSError("disk full")


_INTERRUPTED_WHILE_IMPORTING = """
import sys

class CtrlCWhileImporting:  # Ctrl-C lands while the command line is being imported
    def find_spec(self, name, path=None, target=None):
        if name == "click":
            raise KeyboardInterrupt

sys.meta_path.insert(0, CtrlCWhileImporting())
from dcpctl.__main__ import main
main()
"""


def test_ctrl_c_while_the_command_starts_is_said_as_an_interruption_not_a_traceback():
    done = subprocess.run([sys.executable, "-c", _INTERRUPTED_WHILE_IMPORTING, "inspect", "x"],
                          capture_output=True, text=True, timeout=60)
    assert (done.returncode, done.stderr) == (128 + signal.SIGINT, "Error: interrupted\n")

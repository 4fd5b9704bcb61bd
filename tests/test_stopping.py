"""Stops (SIGTERM, SIGHUP, Ctrl-C) wait for a finishing_first block, then win."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import time

import pytest
from conftest import fixture_path

from dcpctl.stopping import Terminated, describe_stop, finishing_first, stop_on_signals


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


def test_a_stop_that_waited_for_a_block_says_what_the_block_finished(stopping_handlers):
    with pytest.raises(Terminated) as stopped:
        with finishing_first(finished="the output is published whole"):
            signal.raise_signal(signal.SIGTERM)
    assert describe_stop(stopped.value) == ("stopped by SIGTERM, after finishing what a stop "
                                            "waits for: the output is published whole")
    with pytest.raises(KeyboardInterrupt) as interrupted:
        with finishing_first(finished="the output is published whole"):
            signal.raise_signal(signal.SIGINT)
    assert describe_stop(interrupted.value) == ("interrupted, after finishing what a stop "
                                                "waits for: the output is published whole")


def test_a_stop_that_cut_a_block_short_says_nothing_of_it(stopping_handlers):
    """A block that raised did not finish: the stop is said as any other."""
    with pytest.raises(Terminated) as stopped:
        with finishing_first(finished="the output is published whole"):
            signal.raise_signal(signal.SIGTERM)
            raise OSError("disk full")
    assert describe_stop(stopped.value) == "stopped by SIGTERM"
    with pytest.raises(KeyboardInterrupt) as interrupted:
        signal.raise_signal(signal.SIGINT)
    assert describe_stop(interrupted.value) == "interrupted"


def test_without_a_stop_the_block_error_passes_through(stopping_handlers):
    with pytest.raises(OSError, match="disk full"):
        with finishing_first():
            raise OSError("disk full")


def test_a_worker_stops_once_and_waits_for_a_block_as_every_process_does(monkeypatch):
    """The first SIGTERM or SIGHUP of a worker process stops it, as a block's end; the
    coordinator's own SIGTERM that follows a signal to the whole group does nothing."""
    from dcpctl import stopping

    saved = {number: signal.getsignal(number) for number in (signal.SIGTERM, signal.SIGHUP)}
    monkeypatch.setattr(stopping, "_stop_raised", False)
    try:
        stopping.stop_once_on_signals()
        steps = []
        with pytest.raises(Terminated, match="SIGHUP"):
            with finishing_first():
                signal.raise_signal(signal.SIGHUP)
                steps.append("end of the block")
        signal.raise_signal(signal.SIGTERM)
        assert steps == ["end of the block"]
    finally:
        for number, handler in saved.items():
            signal.signal(number, handler)


_STOPPED_AS_IT_EXITS = """
import atexit, os, signal, sys
sys.path.insert(0, sys.argv[1])
from dcpctl.stopping import end_quietly_when_stopped, stop_once_on_signals
stop_once_on_signals()
if sys.argv[2] == "quietly":
    end_quietly_when_stopped()
atexit.register(lambda: os.kill(os.getpid(), signal.SIGTERM))  # the coordinator's, late
"""


@pytest.mark.parametrize("how", ["quietly", "as before"])
def test_a_worker_whose_work_is_over_ends_quietly_when_stopped(how):
    """A worker that had sent its last result, stopped by its coordinator's SIGTERM as it
    exited, raised Terminated into its atexit handlers: a traceback on the command's stderr,
    which must hold one line (about one run in ten of a failing compress --workers 2)."""
    from conftest import REPO_ROOT

    result = subprocess.run([sys.executable, "-c", _STOPPED_AS_IT_EXITS, str(REPO_ROOT), how],
                            capture_output=True, text=True, timeout=60)
    if how == "quietly":
        assert (result.returncode, result.stderr) == (-signal.SIGTERM, "")
    else:  # what the worker did before: the test shows the stop reaching the exit
        assert "Terminated: SIGTERM" in result.stderr


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


_STOPPED_WHILE_TEARING_DOWN = """
import atexit, os, signal, sys, time

stop = getattr(signal, sys.argv[1])

def stopped_now():  # as a SIGTERM or Ctrl-C that lands while the interpreter tears down
    os.kill(os.getpid(), stop)
    time.sleep(1)
    print("teardown went on", file=sys.stderr)

atexit.register(stopped_now)
sys.argv = ["dcpctl", *sys.argv[2:]]
from dcpctl.__main__ import main
main()
"""


@pytest.mark.parametrize("stop", ["SIGTERM", "SIGINT", "SIGHUP"])
@pytest.mark.parametrize("sums_agree", [True, False])
def test_a_stop_after_the_command_ended_ends_the_process_with_the_command_s_status(
        tmp_path, stop, sums_agree):
    """The stop was raised into the interpreter's teardown, after the command's result:
    `Exception ignored in ...: Terminated` (or KeyboardInterrupt), or the process killed by
    the signal. Here it lands in an exit handler, after checksum wrote its sums or refused."""
    checkpoint = shutil.copytree(fixture_path("fsdp2_adamw_3ranks"), tmp_path / "ck")
    if not sums_agree:
        (checkpoint / "SHA256SUMS").write_text("0" * 64 + "  .metadata\n")
    done = subprocess.run([sys.executable, "-c", _STOPPED_WHILE_TEARING_DOWN, stop, "checksum",
                           str(checkpoint), "--json"], capture_output=True, text=True, timeout=60)
    assert "teardown went on" not in done.stderr and "Exception ignored" not in done.stderr, \
        done.stderr
    if sums_agree:
        assert (done.returncode, done.stderr) == (0, "")
        assert json.loads(done.stdout)["sums_path"] == str(checkpoint / "SHA256SUMS")
    else:
        assert done.returncode == 1
        assert done.stderr.startswith("Error: ") and done.stderr.count("\n") == 1, done.stderr


_STORE_THAT_STOPS_ANSWERING = """
import os, signal, sys, threading
import fsspec
from fsspec.implementations.memory import MemoryFileSystem

class StoreThatStopsAnswering(MemoryFileSystem):
    \"\"\"Answers until the first read of a data file, which never returns; the command is
    sent SIGTERM half a second later.\"\"\"
    protocol = "stops-answering"
    store, pseudo_dirs, stopped = {}, [""], threading.Event()

    @classmethod
    def _strip_protocol(cls, path):
        return super()._strip_protocol(str(path).replace("stops-answering://", "memory://", 1))

    def cat_file(self, path, start=None, end=None, **kwargs):
        if str(path).endswith(".distcp"):
            if not self.stopped.is_set():
                self.stopped.set()
                threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGTERM)).start()
            threading.Event().wait()
        return super().cat_file(path, start, end, **kwargs)

fsspec.register_implementation("stops-answering", StoreThatStopsAnswering)
StoreThatStopsAnswering().put(sys.argv[1], "/bucket/ck", recursive=True)
sys.argv = ["dcpctl", *sys.argv[2:]]
from dcpctl.__main__ import main
main()
"""


@pytest.mark.parametrize("command,seconds", [
    (["verify"], 5), (["checksum"], 5),
    (["compress", "-o", "{tmp}/out"], 15),  # the pipeline gives its threads 10 s to stop
])
def test_a_stop_ends_the_command_though_its_threads_wait_on_a_store_that_stopped_answering(
        tmp_path, command, seconds):
    """The error was said at once, then the process waited at exit for the threads still
    reading (from a pool, which Python joins at exit) as long as the store's client retried:
    minutes on S3, forever here."""
    arguments = [part.format(tmp=tmp_path) for part in command]
    started = time.monotonic()
    try:
        done = subprocess.run(
            [sys.executable, "-c", _STORE_THAT_STOPS_ANSWERING,
             str(fixture_path("fsdp2_adamw_3ranks")), arguments[0],
             "stops-answering://bucket/ck", *arguments[1:]],
            capture_output=True, text=True, timeout=60)
    except subprocess.TimeoutExpired:
        pytest.fail(f"{command[0]} still running 60 s after SIGTERM")
    assert (done.returncode, done.stderr) == (128 + signal.SIGTERM, "Error: stopped by SIGTERM\n")
    assert time.monotonic() - started < seconds
    assert not (tmp_path / "out").exists()

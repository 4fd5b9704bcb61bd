"""Progress bars: a tqdm bar of bytes on a terminal; nothing, and no tqdm, elsewhere."""

import io
import subprocess
import sys

import tqdm

from dcpctl.cli.progress import byte_progress


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


class _RecordingBar:
    """Stands in for tqdm, so the test checks what dcpctl asks of it, not how a tqdm release
    draws a bar."""

    made: list["_RecordingBar"] = []

    def __init__(self, **options) -> None:
        self.options = options
        self.updates: list[int] = []
        self.closed = False
        _RecordingBar.made.append(self)

    def update(self, count: int) -> None:
        self.updates.append(count)

    def reset(self, total: int) -> None:
        self.updates.append(("reset", total))

    def close(self) -> None:
        self.closed = True


def test_a_terminal_gets_one_byte_bar_of_the_total(monkeypatch):
    monkeypatch.setattr(sys, "stderr", _Terminal())
    monkeypatch.setattr(tqdm, "tqdm", _RecordingBar)
    _RecordingBar.made.clear()
    with byte_progress("compress") as advance:
        advance(512, 2048)
        advance(1024, 2048)
    (bar,) = _RecordingBar.made
    assert bar.options["total"] == 2048 and bar.options["unit"] == "B"
    assert bar.options["desc"] == "compress"
    assert bar.updates == [512, 1024] and bar.closed


def test_a_second_pass_with_its_own_total_starts_the_bar_over(monkeypatch):
    monkeypatch.setattr(sys, "stderr", _Terminal())
    monkeypatch.setattr(tqdm, "tqdm", _RecordingBar)
    _RecordingBar.made.clear()
    with byte_progress("reshard") as advance:
        advance(100, 300)  # hashing the files SHA256SUMS lists
        advance(200, 300)
        advance(50, 1000)  # then the work
        advance(50, 1000)
    (bar,) = _RecordingBar.made
    assert bar.options["total"] == 300
    assert bar.updates == [100, 200, ("reset", 1000), 50, 50] and bar.closed


def test_no_terminal_no_bar_and_no_tqdm():
    code = ("import sys\nfrom dcpctl.cli.progress import byte_progress\n"
            "with byte_progress('compress') as advance:\n    advance(1, 2)\n"
            "print('tqdm' in sys.modules)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            check=True)
    assert result.stdout.strip() == "False" and result.stderr == ""

import io
import subprocess
import sys

from dcpctl.cli.progress import byte_progress


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_terminal_gets_a_byte_bar(monkeypatch):
    terminal = _Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    with byte_progress("compress") as advance:
        advance(512, 2048)
        advance(512, 2048)
    shown = terminal.getvalue()
    assert shown.startswith("\rcompress:") and "/2.00k" in shown  # bytes of the total


def test_no_terminal_no_bar_and_no_tqdm():
    code = ("import sys\nfrom dcpctl.cli.progress import byte_progress\n"
            "with byte_progress('compress') as advance:\n    advance(1, 2)\n"
            "print('tqdm' in sys.modules)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            check=True)
    assert result.stdout.strip() == "False" and result.stderr == ""

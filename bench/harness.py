"""Shared benchmark plumbing: run a command in a fresh process and read its time and peak RSS."""

from __future__ import annotations

import compileall
import functools
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent

STAND_IN_UNPICKLER = """
import gc, pickle
gc.disable()  # as dcpctl's reader pauses the cycle collector
class Record:
    pass
class TupleRecord:  # TensorProperties pickles its state as a tuple
    def __setstate__(self, state):
        self.state = state
STAND_INS = {("torch", "Size"): tuple, ("collections", "OrderedDict"): dict,
             ("torch.serialization", "_get_layout"): str, ("pathlib", "PosixPath"): lambda *parts: parts,
             ("torch.distributed.checkpoint.metadata", "_MEM_FORMAT_ENCODING"): int,
             ("torch.distributed.checkpoint.metadata", "TensorProperties"): TupleRecord}
class StandIns(pickle.Unpickler):
    def find_class(self, module, name):
        return STAND_INS.get((module, name), Record)
"""
"""Code defining StandIns, Python's C unpickler with every global of DCP metadata mapped to the
cheapest stand-in (no checks, no allowlist, no report): the floor of any reader built on it."""


@dataclass
class Measurement:
    """Wall seconds and peak resident memory of one command."""

    label: str
    seconds: float
    peak_rss_bytes: int
    cpu_seconds: float = 0.0
    """User and system CPU time of the command and the children it waited for."""


def measure(label: str, command: list[str], env: dict | None = None) -> Measurement:
    """Run command under /usr/bin/time -v; raise with its stderr if it fails."""
    result = subprocess.run(["/usr/bin/time", "-v", *command], capture_output=True, text=True,
                            env={**os.environ, **(env or {})}, cwd=REPO_ROOT)
    if result.returncode != 0:
        raise RuntimeError(f"{label} failed ({result.returncode}):\n{result.stderr[-3000:]}")
    wall = re.search(r"Elapsed \(wall clock\) time.*: (?:(\d+):)?(\d+):([\d.]+)", result.stderr)
    hours, minutes, seconds = wall.groups()
    elapsed = int(hours or 0) * 3600 + int(minutes) * 60 + float(seconds)
    rss_kib = int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", result.stderr)[1])
    cpu = sum(float(re.search(rf"{kind} time \(seconds\): ([\d.]+)", result.stderr)[1])
              for kind in ("User", "System"))
    return Measurement(label, elapsed, rss_kib * 1024, cpu)


def python_command(code: str) -> list[str]:
    """A command running code in a fresh interpreter."""
    return [sys.executable, "-c", code]


def dcpctl_command(*args: str) -> list[str]:
    """A command running dcpctl from this source tree, its modules byte-compiled first."""
    _byte_compile_dcpctl()
    return [sys.executable, "-m", "dcpctl", *args]


@functools.cache
def _byte_compile_dcpctl() -> None:
    """Write dcpctl's bytecode (__pycache__, ignored by git), as installing a wheel does, so
    that a dcpctl process, and each worker it starts, reads its modules as a user's would
    rather than compile them all again (about 0.15 s a process) where PYTHONDONTWRITEBYTECODE
    is set."""
    compileall.compile_dir(REPO_ROOT / "dcpctl", quiet=1)


def directory_bytes(path: Path) -> int:
    """Total size of the regular files in a directory."""
    return sum(entry.stat().st_size for entry in Path(path).iterdir() if entry.is_file())


def drop_directory(path: Path) -> None:
    """Remove a benchmark output directory if present."""
    shutil.rmtree(path, ignore_errors=True)


def warm_page_cache(path: Path) -> None:
    """Read every file once so each contender starts with the data in memory."""
    for entry in Path(path).iterdir():
        if entry.is_file():
            with open(entry, "rb") as stream:
                while stream.read(16 << 20):
                    pass


def print_table(rows: list[tuple], headers: tuple) -> None:
    """A plain aligned table on stdout."""
    cells = [tuple(str(cell) for cell in row) for row in [headers, *rows]]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    for row in cells:
        print("  ".join(cell.rjust(width) if i else cell.ljust(width)
                        for i, (cell, width) in enumerate(zip(row, widths))))

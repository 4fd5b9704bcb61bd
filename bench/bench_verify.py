"""Time `dcpctl verify` and `dcpctl checksum` beside `sha256sum` on the real-weights checkpoint.

Works on a temporary directory of hard links to the checkpoint's files (copies where links are
not possible), so the shared cached checkpoint never gets a SHA256SUMS of its own. Reads every
file once first, so that every command reads from the page cache, then runs in rounds,
interleaved, each command in a fresh process, and keeps the best of the rounds:
  sha256sum:            `ls -A | xargs -n 1 -P CORES sha256sum` over the same files (one
                        process per file: a bare `xargs -P` hands all files to one process)
  dcpctl checksum:      writes SHA256SUMS
  verify deep + sums:   `dcpctl verify` with SHA256SUMS present (hash, decode, CRC, dtype/shape)
  verify --quick + sums: structure and SHA256SUMS only
  verify deep, no sums: structure, decode, CRC, dtype/shape
and prints seconds, peak memory of the process, and each time over sha256sum's.

Usage: python bench/bench_verify.py [--checkpoint DIR] [--rounds 3] [--threads N]
Without --checkpoint it uses (and builds once, if missing) bench/real_checkpoint.py's.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

_MEASURE = """
import resource, subprocess, sys, time
start = time.perf_counter()
code = subprocess.run(sys.argv[2:], stdout=subprocess.DEVNULL, cwd=sys.argv[1]).returncode
seconds = time.perf_counter() - start
print(seconds, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, code)
"""


REPO_ROOT = Path(__file__).resolve().parent.parent


def measure(command: list[str], cwd: Path) -> tuple[float, float, int]:
    """(seconds, peak RSS in MiB of the command's largest process, exit code), run fresh,
    with this source tree's dcpctl first on the path."""
    python_path = os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))
    output = subprocess.run([sys.executable, "-c", _MEASURE, str(cwd), *command],
                            capture_output=True, text=True, check=True,
                            env={**os.environ, "PYTHONPATH": python_path}).stdout.split()
    return float(output[0]), int(output[1]) / 1024, int(output[2])


def linked_copy(source: Path, parent: Path) -> Path:
    """A directory of hard links (or copies) of source's files."""
    target = parent / source.name
    target.mkdir()
    for path in source.iterdir():
        if path.name == "SHA256SUMS":
            continue
        try:
            os.link(path, target / path.name)
        except OSError:
            shutil.copy2(path, target / path.name)
    return target


def warm_page_cache(directory: Path) -> int:
    total = 0
    for path in directory.iterdir():
        with open(path, "rb", buffering=0) as stream:
            while piece := stream.read(16 << 20):
                total += len(piece)
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", type=Path, default=None)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    args = parser.parse_args()
    source = args.checkpoint
    if source is None:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from real_checkpoint import real_checkpoint

        source = real_checkpoint()
    dcpctl = [sys.executable, "-m", "dcpctl"]
    threads = ["--threads", str(args.threads)]
    with tempfile.TemporaryDirectory(prefix="bench-verify-") as work:
        checkpoint = linked_copy(source, Path(work))
        sums = checkpoint / "SHA256SUMS"
        size_bytes = warm_page_cache(checkpoint)
        print(f"checkpoint: {source} ({size_bytes / 1e9:.2f} GB, "
              f"{len(list(checkpoint.iterdir()))} files), {args.threads} threads, "
              f"best of {args.rounds}")
        commands = {
            "sha256sum (xargs -n1 -P)": (["sh", "-c", "ls -A | grep -vx SHA256SUMS | xargs -n 1 "
                                         f"-P {args.threads} sha256sum"], None),
            "dcpctl checksum": ([*dcpctl, "checksum", ".", *threads], None),
            "dcpctl verify (deep, with SHA256SUMS)": ([*dcpctl, "verify", ".", *threads], True),
            "dcpctl verify --quick (with SHA256SUMS)": (
                [*dcpctl, "verify", ".", "--quick", *threads], True),
            "dcpctl verify (deep, no SHA256SUMS)": ([*dcpctl, "verify", ".", *threads], False),
        }
        best: dict[str, tuple[float, float]] = {}
        for _ in range(args.rounds):
            for label, (command, with_sums) in commands.items():
                if with_sums is False and sums.exists():
                    sums.rename(checkpoint.parent / "SHA256SUMS.aside")
                if with_sums and not sums.exists():
                    (checkpoint.parent / "SHA256SUMS.aside").rename(sums)
                seconds, peak_mib, code = measure(command, checkpoint)
                if code != 0:
                    raise SystemExit(f"{label}: exit {code}")
                if label not in best or seconds < best[label][0]:
                    best[label] = (seconds, peak_mib)
        anchor = best["sha256sum (xargs -n1 -P)"][0]
        print(f"{'what':<42}{'seconds':>9}{'peak MiB':>10}{'/ sha256sum':>13}")
        for label, (seconds, peak_mib) in best.items():
            print(f"{label:<42}{seconds:>9.2f}{peak_mib:>10.0f}{seconds / anchor:>12.2f}x")
        print(json.dumps({label: round(seconds, 3) for label, (seconds, _) in best.items()}))


if __name__ == "__main__":
    main()

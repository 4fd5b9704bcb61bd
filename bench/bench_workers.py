"""--workers: process scaling of the commands that move data, on the real-weights checkpoint,
side by side in one run, against one process with its threads and against each command's floor.

For each command: `--workers 1 --threads 1`, `--workers 2 --threads 1` (process scaling),
one process with its default threads (what the commands did by default before --workers chose
a default from the cores), `--workers 2` with default threads, and the defaults. The floor is
the CPU-seconds of the command's unavoidable work, measured by bench/checksummed_copy.py
(reads, CRC-32, SHA-256, writes; zstd level 3 for compress; no SHA-256 for convert; no writes
for verify and checksum), divided by the cores. That work is timed on one thread and on as many
threads as there are cores (its C calls release the interpreter lock): the floor takes the
fewer CPU-seconds of the two, and the speed-up of the second over the first is printed, the
scaling this machine gives the unavoidable work itself. CPU-seconds per GB (of the input) is
printed so that a job on N machines can be projected. Best of --repeat runs, input in the page
cache; a command's contenders (its floors among them) run in rounds, one run of each per round.

Usage: python bench/bench_workers.py [--units 11] [--repeat 2]
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import (Measurement, dcpctl_command, directory_bytes,  # noqa: E402
                     drop_directory, measure, print_table, warm_page_cache)
from real_checkpoint import ONE_GB_UNITS, OUT_ROOT, real_checkpoint  # noqa: E402

CHECKSUMMED_COPY = str(Path(__file__).resolve().parent / "checksummed_copy.py")
CONFIGS = [("--workers 1 --threads 1", ["--workers", "1", "--threads", "1"]),
           ("--workers 2 --threads 1", ["--workers", "2", "--threads", "1"]),
           ("one process, default threads", ["--workers", "1"]),
           ("--workers 2, default threads", ["--workers", "2"]),
           ("defaults (no --workers)", [])]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--units", type=int, default=ONE_GB_UNITS)
    parser.add_argument("--repeat", type=int, default=2)
    args = parser.parse_args()
    source = real_checkpoint(args.units, 4)
    gigabytes = directory_bytes(source) / 1e9
    cores = len(os.sched_getaffinity(0))
    out = OUT_ROOT / "workers-out"
    sums_copy = OUT_ROOT / "workers-sums"
    commands = {
        "compress": (lambda: dcpctl_command("compress", str(source), "-o", str(out)),
                     ["--zstd", "3"]),
        "reshard --ranks 16": (lambda: dcpctl_command("reshard", str(source), "--ranks", "16",
                                                      "-o", str(out)), []),
        "convert --to safetensors": (lambda: dcpctl_command(
            "convert", str(source), "--to", "safetensors", "--include", "*", "-o", str(out)),
            ["--no-sha256"]),
        "verify": (lambda: dcpctl_command("verify", str(source)), ["--no-write"]),
        "checksum": (lambda: dcpctl_command("checksum", str(sums_copy)), ["--no-write"]),
    }
    drop_directory(sums_copy)
    shutil.copytree(source, sums_copy)
    (sums_copy / "SHA256SUMS").unlink(missing_ok=True)
    rows = []
    for name, (command, floor_options) in commands.items():
        contenders = {
            "floor": [sys.executable, CHECKSUMMED_COPY, str(source), str(out), "1",
                      *floor_options],
            "floor, all cores": [sys.executable, CHECKSUMMED_COPY, str(source), str(out),
                                 str(cores), *floor_options],
            **{label: command() + options for label, options in CONFIGS}}
        runs = best_of_rounds(args.repeat, source, out, contenders)
        floor, floor_on_cores = runs.pop("floor"), runs.pop("floor, all cores")
        # the same work either way: the fewer CPU-seconds (a run that writes a gigabyte now
        # and then spends a second or two more in the kernel, on 1 thread or on 2)
        floor_cpu = min(floor.cpu_seconds, floor_on_cores.cpu_seconds)
        floor_seconds = floor_cpu / cores
        rows.append((name, f"floor: its CPU-s / {cores} cores", f"{floor_seconds:.2f}",
                     f"{floor_cpu:.2f}", f"{floor_cpu / gigabytes:.2f}", "1.00", "", "", ""))
        # what the machine itself gives: the floor's own work, timed on 1 thread and on all
        rows.append((name, f"floor's work on {cores} threads (speed-up: over 1 thread)",
                     f"{floor_on_cores.seconds:.2f}", f"{floor_on_cores.cpu_seconds:.2f}",
                     f"{floor_on_cores.cpu_seconds / gigabytes:.2f}",
                     f"{floor_on_cores.seconds / floor_seconds:.2f}",
                     f"{floor.seconds / floor_on_cores.seconds:.2f}", "", ""))
        one, single = runs[CONFIGS[0][0]], runs[CONFIGS[2][0]]
        for label, run in runs.items():
            rows.append((name, label, f"{run.seconds:.2f}", f"{run.cpu_seconds:.2f}",
                         f"{run.cpu_seconds / gigabytes:.2f}",
                         f"{run.seconds / floor_seconds:.2f}",
                         f"{one.seconds / run.seconds:.2f}", f"{single.seconds / run.seconds:.2f}",
                         f"{run.peak_rss_bytes / 2**20:.0f}"))
    drop_directory(out)
    drop_directory(sums_copy)
    print(f"input: {source} ({gigabytes:.2f} GB, 4 ranks); {cores} cores; best of "
          f"{args.repeat}; peak RSS of the largest single process")
    print_table(rows, ("command", "how", "seconds", "CPU-s", "CPU-s/GB", "x floor",
                       "speed-up vs w1 t1", "vs one process", "peak RSS MiB"))


def best_of_rounds(repeat: int, source: Path, out: Path, contenders: dict[str, list[str]]
                   ) -> dict[str, Measurement]:
    """Each contender's fastest of `repeat` runs, run in rounds of one run each, so that a
    spell of load from elsewhere on the machine slows every contender rather than one."""
    best: dict[str, Measurement] = {}
    for _ in range(repeat):
        for label, command in contenders.items():
            drop_directory(out)
            warm_page_cache(source)
            run = measure(label, command)
            if label not in best or run.seconds < best[label].seconds:
                best[label] = run
    drop_directory(out)
    return best


if __name__ == "__main__":
    main()

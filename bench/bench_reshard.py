"""reshard: dcpctl against today's way and against `cp -r`, on the real-weights checkpoint.

Today's way: N gloo processes (as torchrun would start) that each build the target state from
the metadata (DTensors sharded along dim 0 on an N-rank mesh), `dcp.load` it and `dcp.save` it.
dcpctl: `dcpctl reshard CKPT --ranks N -o OUT`, one process. `cp -r` of the same checkpoint is
the bar's anchor; bench/checksummed_copy.py is the floor of anything that writes SHA256SUMS and
torch.save archives: a copy that also computes a CRC-32 and a SHA-256 of every byte. Each
runs in fresh processes under /usr/bin/time -v, input in the page cache; peak RSS is that of
the largest single process.

Usage: python bench/bench_reshard.py [--units 11] [--targets 16 3] [--also-units 43]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import (dcpctl_command, directory_bytes, drop_directory, measure,  # noqa: E402
                     print_table, warm_page_cache)
from real_checkpoint import ONE_GB_UNITS, OUT_ROOT, real_checkpoint  # noqa: E402

TODAYS_WAY = str(Path(__file__).resolve().parent / "todays_reshard.py")
CHECKSUMMED_COPY = str(Path(__file__).resolve().parent / "checksummed_copy.py")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--units", type=int, default=ONE_GB_UNITS)
    parser.add_argument("--targets", type=int, nargs="+", default=[16, 3])
    parser.add_argument("--also-units", type=int, default=0)
    args = parser.parse_args()
    source = real_checkpoint(args.units, 4)
    source_bytes = directory_bytes(source)
    out = OUT_ROOT / "reshard-out"
    rows = []
    copy_seconds = None
    floor = [("floor: copy + CRC-32 + SHA-256, 2 threads",
              [sys.executable, CHECKSUMMED_COPY, str(source), str(out), "2"])]
    for label, command in [("cp -r", ["cp", "-r", str(source), str(out)])] + floor + [
            item for n in args.targets for item in (
                (f"today: {n} gloo processes load + save", [sys.executable, TODAYS_WAY, str(source), str(out), str(n)]),
                (f"dcpctl reshard --ranks {n}", dcpctl_command("reshard", str(source),
                                                                "--ranks", str(n), "-o",
                                                                str(out))))]:
        drop_directory(out)
        warm_page_cache(source)
        result = measure(label, command)
        copy_seconds = copy_seconds or result.seconds
        rows.append((label, f"{result.seconds:.1f}", f"{result.seconds / copy_seconds:.2f}",
                     f"{result.peak_rss_bytes / 2**20:.0f}", f"{directory_bytes(out) / 1e6:.0f}"))
    drop_directory(out)
    print(f"input: {source} ({source_bytes / 1e9:.2f} GB, 4 ranks)")
    print_table(rows, ("what", "seconds", "x cp -r", "peak RSS MiB", "output MB"))
    if args.also_units:
        large = real_checkpoint(args.also_units, 4)
        result = measure("large", dcpctl_command("reshard", str(large), "--ranks",
                                                 str(args.targets[0]), "-o", str(out)))
        print(f"dcpctl reshard --ranks {args.targets[0]} on {directory_bytes(large) / 1e9:.2f} GB:"
              f" {result.seconds:.1f} s, peak RSS {result.peak_rss_bytes / 2**20:.0f} MiB")
        drop_directory(out)


if __name__ == "__main__":
    main()

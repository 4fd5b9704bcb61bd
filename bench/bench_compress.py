"""compress: dcpctl against torch's way, on the real-weights checkpoint, side by side.

torch's way: load the whole state with DCP in one process (`_EmptyStateDictLoadPlanner`), then
save it with `FileSystemWriter(out, thread_count=2, _extensions=[ZStandard()])`: the whole
checkpoint in memory. dcpctl: `dcpctl compress CKPT -o OUT` at the same zstd level (3), with
--threads 2 and --threads 1. Each runs in a fresh process under /usr/bin/time -v (wall time,
CPU time and peak RSS), with the input in the page cache; the dcpctl runs take turns --repeat
times and each reports its fastest run (and its highest peak RSS), so a burst of load on a
shared machine does not decide the thread scaling. For size at the same layout, it also reports
what torch itself writes when the same 4-rank job saves with the ZStandard extension.

Usage: python bench/bench_compress.py [--units 11] [--also-units 43] [--repeat 3]
  --units N        checkpoint size in units of ~93 MB (11 is ~1 GB)
  --also-units M   also measure dcpctl's peak RSS on an M-unit checkpoint (43 is ~4 GB)
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import (dcpctl_command, directory_bytes, drop_directory, measure,  # noqa: E402
                     print_table, python_command, warm_page_cache)
from real_checkpoint import ONE_GB_UNITS, OUT_ROOT, real_checkpoint  # noqa: E402

TORCH_WAY = """
import sys
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._extension import ZStandard
from torch.distributed.checkpoint.format_utils import _EmptyStateDictLoadPlanner
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict
state = {}
_load_state_dict(state, storage_reader=dcp.FileSystemReader(sys.argv[1]),
                 planner=_EmptyStateDictLoadPlanner(), no_dist=True)
dcp.save(state, storage_writer=dcp.FileSystemWriter(sys.argv[2], thread_count=2,
                                                     _extensions=[ZStandard()]), no_dist=True)
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--units", type=int, default=ONE_GB_UNITS)
    parser.add_argument("--also-units", type=int, default=0)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    source = real_checkpoint(args.units, 4)
    source_bytes = directory_bytes(source)
    outputs = {name: OUT_ROOT / f"compress-{name}" for name in ("torch", "t2", "t1")}
    for path in outputs.values():
        drop_directory(path)
    warm_page_cache(source)
    runs = [
        ("torch load + save(ZStandard, thread_count=2)", "torch",
         python_command(TORCH_WAY) + [str(source), str(outputs["torch"])]),
        ("dcpctl compress --threads 2", "t2",
         dcpctl_command("compress", str(source), "-o", str(outputs["t2"]), "--threads", "2")),
        ("dcpctl compress --threads 1", "t1",
         dcpctl_command("compress", str(source), "-o", str(outputs["t1"]), "--threads", "1")),
    ]
    seconds: dict[str, float] = {}
    peak_rss_bytes: dict[str, int] = {}
    for round_index in range(args.repeat):
        for label, name, command in runs:
            if name == "torch" and round_index:
                continue  # many seconds per run, and its margin does not hang on noise
            drop_directory(outputs[name])
            result = measure(label, command)
            warm_page_cache(source)
            seconds[name] = min(seconds.get(name, result.seconds), result.seconds)
            peak_rss_bytes[name] = max(peak_rss_bytes.get(name, 0), result.peak_rss_bytes)
    print(f"input: {source} ({source_bytes / 1e9:.2f} GB, {args.units} units)")
    rows = []
    for label, name, _ in runs:
        out_bytes = directory_bytes(outputs[name])
        rows.append((label, f"{seconds[name]:.2f}", f"{source_bytes / seconds[name] / 1e6:.0f}",
                     f"{peak_rss_bytes[name] / 2**20:.0f}", f"{out_bytes / 1e6:.1f}",
                     f"{out_bytes / source_bytes:.4f}"))
    same_layout = real_checkpoint(args.units, 4, zstd=True)
    same_layout_bytes = directory_bytes(same_layout)
    rows.append(("torch 4-rank save with ZStandard (same layout)", "-", "-", "-",
                 f"{same_layout_bytes / 1e6:.1f}", f"{same_layout_bytes / source_bytes:.4f}"))
    print_table(rows, ("what", "seconds", "MB/s", "peak RSS MiB", "output MB", "out/in"))
    print(f"dcpctl --threads 2 is {seconds['torch'] / seconds['t2']:.2f}x faster than torch's way")
    print(f"--threads 2 / --threads 1 throughput: {seconds['t1'] / seconds['t2']:.2f}x "
          f"(fastest of {args.repeat} runs each)")
    if args.also_units:
        large = real_checkpoint(args.also_units, 4)
        out = OUT_ROOT / "compress-large"
        drop_directory(out)
        result = measure("large", dcpctl_command("compress", str(large), "-o", str(out),
                                                 "--threads", "2"))
        print(f"dcpctl compress --threads 2 on {directory_bytes(large) / 1e9:.2f} GB: "
              f"{result.seconds:.1f} s, peak RSS {result.peak_rss_bytes / 2**20:.0f} MiB")
        drop_directory(out)
    for path in outputs.values():
        drop_directory(path)


if __name__ == "__main__":
    main()

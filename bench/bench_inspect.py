"""Time `dcpctl inspect` on checkpoints whose metadata lists 100,000 tensors.

For each chunk count (default 1 and 4 chunks per tensor, as a save over that many ranks would
write), builds the `.metadata` torch would write, with sparse data files, then times side by
side, each run a fresh process and each figure the best of --repeat runs (median in brackets):
  torch:  `FileSystemReader(path).read_metadata()` (today's way to look inside: import torch
          and unpickle with torch's classes), as a process and, inside it, the read alone
  dcpctl: `dcpctl inspect --json` (safe unpickle, checks, full report, JSON out) and the
          table, as processes; and inside a process, the read + report and the JSON text alone
  floors: the start-up of a bare `python -c pass`, and Python's C unpickler alone on the same
          `.metadata` with its globals mapped to trivial stand-in classes: no reader that
          builds the records from the pickle can beat their sum.
With --baseline DIR, the dcpctl rows are also run from another source tree (e.g. an older
commit: `git worktree add /tmp/old <commit>`), interleaved with this one's runs.

Usage: python bench/bench_inspect.py [--tensors N] [--ranks R [R ...]] [--repeat N]
                                     [--baseline DIR] [--workdir DIR]
"""

from __future__ import annotations

import argparse
import os
import pickle
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import STAND_IN_UNPICKLER  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parent.parent


def build_checkpoint(directory: Path, tensor_count: int, ranks: int) -> None:
    """Write a `.metadata` with tensor_count tensors of ranks chunks each, and sparse files."""
    import torch
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, Metadata,
                                                       MetadataIndex, StorageMeta, TensorProperties,
                                                       TensorStorageMetadata)

    state, storage, planner = {}, {}, {}
    offsets = [0] * ranks
    item_bytes = 4096 + 1200
    for index in range(tensor_count):
        fqn = f"model.layers.{index // 10}.block.{index % 10}.weight"
        rows = 4 * ranks
        chunks = [ChunkStorageMetadata(torch.Size([4 * r, 0]), torch.Size([4, 256]))
                  for r in range(ranks)]
        state[fqn] = TensorStorageMetadata(TensorProperties(torch.bfloat16),
                                           torch.Size([rows, 256]), chunks)
        planner[fqn] = tuple(fqn.split("."))
        for rank, chunk in enumerate(chunks):
            storage[MetadataIndex(fqn, chunk.offsets, rank)] = _StorageInfo(
                f"__{rank}_0.distcp", offsets[rank], item_bytes)
            offsets[rank] += item_bytes
    metadata = Metadata(state, planner_data=planner, storage_data=storage,
                        storage_meta=StorageMeta(directory, "bench"), version="1.0.0")
    directory.mkdir(parents=True, exist_ok=True)
    with open(directory / ".metadata", "wb") as stream:
        pickle.dump(metadata, stream)
    for rank in range(ranks):
        with open(directory / f"__{rank}_0.distcp", "wb") as stream:
            stream.write(b"PK\x03\x04")
            stream.truncate(offsets[rank])


# Each prints the seconds its own timed part took, measured inside a fresh process.
_TORCH_READ_CODE = """
import sys, time
from torch.distributed.checkpoint import FileSystemReader
start = time.perf_counter()
FileSystemReader(sys.argv[1]).read_metadata()
print(time.perf_counter() - start)
"""
# gc.collect(0): the pass of the cycle collector over the report's new objects, which the
# next allocations would start anyway, counted with the read, not with what follows it.
_DCPCTL_REPORT_CODE = """
import gc, sys, time
from dcpctl.ops.inspection.report import inspect_checkpoint
start = time.perf_counter()
report = inspect_checkpoint(sys.argv[1])
gc.collect(0)
print(time.perf_counter() - start)
"""
_DCPCTL_JSON_CODE = """
import gc, sys, time
from dcpctl.ops.inspection.report import inspect_checkpoint
report = inspect_checkpoint(sys.argv[1])
gc.collect(0)
start = time.perf_counter()
if hasattr(report, "to_json_text"):
    text = report.to_json_text()
else:  # a tree from before to_json_text: what its CLI did
    text = __import__("json").dumps(report.to_json(), separators=(",", ":"), default=str)
print(time.perf_counter() - start)
"""

# The floor of any reader that builds the records: Python's C unpickler alone on the same
# bytes, its globals mapped to the cheapest stand-ins (no checks, no allowlist, no report).
_UNPICKLE_FLOOR_CODE = STAND_IN_UNPICKLER + """
import io, sys, time
data = open(sys.argv[1] + "/.metadata", "rb").read()
start = time.perf_counter()
StandIns(io.BytesIO(data)).load()
print(time.perf_counter() - start)
"""


def _in_tree(source_tree: Path) -> dict:
    """Run from source_tree and import dcpctl from it: `python -m` and `-c` put the working
    directory first on sys.path, ahead of PYTHONPATH."""
    return {"cwd": source_tree, "env": {**os.environ, "PYTHONPATH": str(source_tree)}}


def process_seconds(command: list[str], source_tree: Path) -> float:
    """Wall seconds of command as a fresh process, its output thrown away."""
    start = time.perf_counter()
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL, **_in_tree(source_tree))
    return time.perf_counter() - start


def reported_seconds(code: str, checkpoint: Path, source_tree: Path) -> float:
    """The seconds a fresh process running code on checkpoint prints."""
    result = subprocess.run([sys.executable, "-c", code, str(checkpoint)], check=True,
                            capture_output=True, text=True, **_in_tree(source_tree))
    return float(result.stdout.split()[-1])


def measurements(checkpoint: Path) -> dict[str, tuple[bool, object]]:
    """Each row: whether it runs dcpctl (and so also from a baseline tree), and how to time it."""
    dcpctl = [sys.executable, "-m", "dcpctl", "inspect"]
    return {
        "torch: import + read_metadata (process)": (False, lambda tree: process_seconds(
            [sys.executable, "-c", _TORCH_READ_CODE, str(checkpoint)], tree)),
        "torch: read_metadata (inside the process)": (False, lambda tree: reported_seconds(
            _TORCH_READ_CODE, checkpoint, tree)),
        "dcpctl inspect --json (process)": (True, lambda tree: process_seconds(
            [*dcpctl, "--json", str(checkpoint)], tree)),
        "dcpctl inspect, table (process)": (True, lambda tree: process_seconds(
            [*dcpctl, str(checkpoint)], tree)),
        "dcpctl read + report (inside the process)": (True, lambda tree: reported_seconds(
            _DCPCTL_REPORT_CODE, checkpoint, tree)),
        "dcpctl JSON text of the report (inside)": (True, lambda tree: reported_seconds(
            _DCPCTL_JSON_CODE, checkpoint, tree)),
        "floor: python start-up (process)": (False, lambda tree: process_seconds(
            [sys.executable, "-c", "pass"], tree)),
        "floor: C unpickle to stand-ins (inside)": (False, lambda tree: reported_seconds(
            _UNPICKLE_FLOOR_CODE, checkpoint, tree)),
    }


def figure(seconds: list[float]) -> str:
    """Best of the runs, median in brackets."""
    return f"{min(seconds):6.2f} ({statistics.median(seconds):5.2f})"


def bench_one(checkpoint: Path, repeat: int, baseline: Path | None) -> None:
    """Time every row, this tree and the baseline interleaved, and print the table."""
    trees = {"this tree": REPO_ROOT, **({"baseline": baseline.resolve()} if baseline else {})}
    rows = measurements(checkpoint)
    times: dict[tuple[str, str], list[float]] = {}
    for _ in range(repeat):
        for label, (is_dcpctl, run) in rows.items():
            for tree_name, tree in trees.items():
                if is_dcpctl or tree_name == "this tree":
                    times.setdefault((label, tree_name), []).append(run(tree))
    header = "".join(f"{name:>17}" for name in trees)
    print(f"{'what (seconds: best of ' + str(repeat) + ', median)':<44}{header}")
    for label in rows:
        cells = "".join(f"{figure(times[(label, name)]):>17}" if (label, name) in times
                        else f"{'':>17}" for name in trees)
        print(f"{label:<44}{cells}")
    torch_best = min(times[("torch: import + read_metadata (process)", "this tree")])
    json_best = min(times[("dcpctl inspect --json (process)", "this tree")])
    print(f"dcpctl inspect --json / torch read_metadata, as processes: "
          f"{json_best / torch_best:.2f}x")
    floor = (min(times[("floor: python start-up (process)", "this tree")])
             + min(times[("floor: C unpickle to stand-ins (inside)", "this tree")]))
    print(f"floor of any reader that builds the records (start-up + C unpickle): {floor:.2f} s;"
          f" dcpctl inspect --json is {json_best / floor:.2f}x that")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tensors", type=int, default=100_000)
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 4],
                        help="chunks per tensor, one checkpoint each (default: 1 4)")
    parser.add_argument("--repeat", type=int, default=3, help="fresh processes per figure")
    parser.add_argument("--baseline", type=Path, default=None,
                        help="another dcpctl source tree to time side by side")
    parser.add_argument("--workdir", type=Path, default=None)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(dir=args.workdir) as work:
        for ranks in args.ranks:
            checkpoint = Path(work) / f"ckpt_{ranks}"
            build_checkpoint(checkpoint, args.tensors, ranks)
            metadata_mb = (checkpoint / ".metadata").stat().st_size / 1e6
            print(f"\ncheckpoint: {args.tensors} tensors x {ranks} chunks, "
                  f".metadata {metadata_mb:.1f} MB")
            bench_one(checkpoint, args.repeat, args.baseline)


if __name__ == "__main__":
    main()

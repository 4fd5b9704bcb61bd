"""Compression at save time, side by side: a training job saves the real weights with `dcp.save`
and torch's FileSystemWriter as it is (baseline), with torch's ZStandard extension, and with
dcpctl's FloatSplit extension (`dcpctl.storage_writer`, at its default level 1), then loads
each back.

The state is the real-weights unit of bench/real_checkpoint.py: Whisper tiny.en's weights cast
to bfloat16 (the model) and the GE2E speaker encoder in float32 with the real Adam state of its
training (`optim.*`), each rank holding its rows of every tensor as a Shard(0) DTensor, as an
FSDP2 job does. For 1 and 2 gloo ranks and thread_count 1 and 2 (torch's writer threads per
rank), every codec saves into a fresh directory and loads back into a zeroed state dict through
`dcpctl.storage_reader` (torch's FileSystemReader with dcpctl's extensions registered, which is
stock torch for the baseline and ZStandard); codecs take turns (each repeat starts with the
next), --repeats times, and each keeps its fastest time. Times are wall seconds between
barriers on rank 0. Sizes are the stored item bytes: of the bf16 model weights, and of the
whole state.

A save's time on this machine swings by tens of percent from run to run, more than the coding
costs. So the coding is also measured alone, in this process: each tensor of one unit is
torch.saved through each codec's stream transform (`transform_to`, as the writer uses it) into
a sink that keeps nothing; CPU seconds on one thread (all of the process's threads counted:
a codec whose library spins up threads of its own pays for them here) and wall seconds with
the tensors shared out to two threads, as a writer with thread_count 2 does. Best of
--repeats, codecs taking turns.

Usage: python bench/bench_save.py [--units 2] [--repeats 3] [--coding-only]
"""

from __future__ import annotations

import argparse
import io
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import print_table  # noqa: E402
from real_checkpoint import OUT_ROOT, rank_state, unit_tensors  # noqa: E402

CODECS = ("none", "zstd", "floatsplit")
LABELS = {"none": "baseline", "zstd": "ZStandard", "floatsplit": "FloatSplit"}
THREAD_COUNTS = (1, 2)
MODEL_PREFIX = "model."
BF16_WEIGHTS = ".whisper."  # the fqns of the bf16 model weights


def _zeroed(state: dict) -> dict:
    import torch

    return {key: torch.zeros_like(value) if isinstance(value, torch.Tensor) else value
            for key, value in state.items()}


def _timed(action) -> float:
    import torch.distributed as dist

    dist.barrier()
    start = time.perf_counter()
    action()
    dist.barrier()
    return time.perf_counter() - start


def _job(rank: int, world_size: int, out_root: str, units: int, repeats: int,
         results_file: str) -> None:
    import torch.distributed.checkpoint as dcp

    import dcpctl

    state = rank_state(rank, world_size, units)
    best: dict[str, float] = {}
    for repeat in range(repeats):
        for thread_count in THREAD_COUNTS:
            for codec in CODECS[repeat % 3:] + CODECS[:repeat % 3]:  # each goes first in turn
                path = f"{out_root}/{world_size}r-{thread_count}t-{codec}"
                if rank == 0:
                    shutil.rmtree(path, ignore_errors=True)
                writer = dcpctl.storage_writer(path, codec=codec, thread_count=thread_count)
                save = _timed(lambda: dcp.save(state, storage_writer=writer))
                target = _zeroed(state)
                load = _timed(lambda: dcp.load(target, storage_reader=dcpctl.storage_reader(path)))
                for name, seconds in ((f"save {path}", save), (f"load {path}", load)):
                    best[name] = min(best.get(name, seconds), seconds)
    if rank == 0:
        Path(results_file).write_text(json.dumps(best))


class _Sink(io.RawIOBase):
    """A writable stream that keeps nothing."""

    def writable(self) -> bool:
        return True

    def write(self, data) -> int:
        return memoryview(data).nbytes


def coding_alone(repeats: int) -> tuple[int, dict]:
    """One unit's raw tensor bytes, and per transform (by label) and measure ("cpu", "wall"):
    CPU seconds to torch.save its tensors through the transform on one thread, wall seconds on
    two (see the module's docstring). FloatSplit at its default (fast) level, as a save writes
    it, and at the level `dcpctl compress` writes."""
    from concurrent.futures import ThreadPoolExecutor

    import torch
    from torch.distributed.checkpoint._extension import ZStandard

    from dcpctl.format.codecs.registry import DEFAULT_ZSTD_LEVEL
    from dcpctl.format.codecs.torch_extension import FloatSplit

    tensors = list(unit_tensors().values())
    transforms = {LABELS["none"]: None, LABELS["zstd"]: ZStandard(),
                  LABELS["floatsplit"]: FloatSplit(),
                  f"FloatSplit level {DEFAULT_ZSTD_LEVEL}": FloatSplit(DEFAULT_ZSTD_LEVEL)}

    def save(transform, tensor) -> None:
        stream = transform.transform_to(_Sink()) if transform else _Sink()
        torch.save(tensor, stream)
        stream.close()

    labels = list(transforms)
    best = {(label, measure): float("inf") for label in labels for measure in ("cpu", "wall")}
    with ThreadPoolExecutor(2) as pool:
        for repeat in range(repeats):
            for label in labels[repeat % len(labels):] + labels[:repeat % len(labels)]:
                transform = transforms[label]
                started = time.process_time()
                for tensor in tensors:
                    save(transform, tensor)
                best[label, "cpu"] = min(best[label, "cpu"], time.process_time() - started)
                started = time.perf_counter()
                list(pool.map(lambda tensor: save(transform, tensor), tensors))
                best[label, "wall"] = min(best[label, "wall"], time.perf_counter() - started)
    return sum(tensor.nbytes for tensor in tensors), best


def stored_bytes(checkpoint: Path) -> tuple[int, int, int]:
    """(bf16 model weights, all tensors and objects, raw bytes of the bf16 weights) stored."""
    from torch.distributed.checkpoint import FileSystemReader

    metadata = FileSystemReader(str(checkpoint)).read_metadata()
    weights = sum(info.length for index, info in metadata.storage_data.items()
                  if index.fqn.startswith(MODEL_PREFIX) and BF16_WEIGHTS in index.fqn)
    total = sum(info.length for info in metadata.storage_data.values())
    raw = sum(2 * _numel(entry.size) for fqn, entry in metadata.state_dict_metadata.items()
              if fqn.startswith(MODEL_PREFIX) and BF16_WEIGHTS in fqn)
    return weights, total, raw


def _numel(size) -> int:
    count = 1
    for dimension in size:
        count *= dimension
    return count


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--units", type=int, default=2, help="units of ~93 MB of state")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--coding-only", action="store_true",
                        help="measure the coding alone, without the saves")
    args = parser.parse_args()
    if args.coding_only:
        print_coding_alone(args.repeats)
        return
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "fixtures"))
    from make_fixtures import run_gloo_job

    out_root = OUT_ROOT / "save"
    out_root.mkdir(parents=True, exist_ok=True)
    times: dict[str, float] = {}
    for world_size in (1, 2):
        with tempfile.NamedTemporaryFile(suffix=".json") as results:
            run_gloo_job(world_size, _job, str(out_root), args.units, args.repeats, results.name)
            times.update(json.loads(Path(results.name).read_text()))
    rows, bars = [], []
    for world_size in (1, 2):
        for thread_count in THREAD_COUNTS:
            figures = {}
            for codec in CODECS:
                path = out_root / f"{world_size}r-{thread_count}t-{codec}"
                figures[codec] = (*stored_bytes(path), times[f"save {path}"],
                                  times[f"load {path}"])
            base_weights, base_total, raw, base_save, base_load = figures["none"]
            for codec in CODECS:
                weights, total, _, save, load = figures[codec]
                rows.append((f"{world_size} rank(s), {thread_count} thread(s)", LABELS[codec],
                             f"{weights / raw:.4f}", f"{total / base_total:.4f}",
                             f"{total / 1e6:.1f}", f"{save:.2f}",
                             f"{save / base_save - 1:+.1%}", f"{load:.2f}"))
            bars.append((world_size, thread_count, figures))
    print(f"{args.units} unit(s) of state; best of {args.repeats}; sizes over the baseline's "
          "bf16 weights (raw bytes) and whole checkpoint")
    print_table(rows, ("job", "codec", "bf16 weights", "whole", "MB", "save s",
                       "save overhead", "load s"))
    print()
    for world_size, thread_count, figures in bars:
        zstd, split, base = figures["zstd"], figures["floatsplit"], figures["none"]
        print(f"{world_size} rank(s), {thread_count} thread(s): "
              f"weights floatsplit/ZStandard {split[0] / zstd[0]:.3f} (bar <= 0.90); "
              f"whole {split[1] / zstd[1]:.3f} (bar < 1); "
              f"save overhead {split[3] / base[3] - 1:+.1%} vs {zstd[3] / base[3] - 1:+.1%}; "
              f"load {split[4]:.2f} s vs {zstd[4]:.2f} s")
    print()
    print_coding_alone(args.repeats)


def print_coding_alone(repeats: int) -> None:
    raw, best = coding_alone(repeats)
    print(f"coding alone: one unit's tensors ({raw / 1e6:.1f} MB) torch.saved through each "
          f"transform into a sink; best of {repeats}")
    baseline = LABELS["none"]
    over = {(label, measure): best[label, measure] - best[baseline, measure]
            for label, measure in best}
    labels = list(dict.fromkeys(label for label, _ in best))
    print_table([(label, *(f"{figures[label, measure]:.3f}" for measure in ("cpu", "wall")
                           for figures in (best, over))) for label in labels],
                ("transform", "CPU s, 1 thread", "over none", "wall s, 2 threads", "over none"))
    zstd = LABELS["zstd"]
    for label in labels[2:]:
        print(f"{label}'s coding over {zstd}'s: "
              f"{over[label, 'cpu'] / over[zstd, 'cpu']:.2f}x CPU on one thread, "
              f"{over[label, 'wall'] / over[zstd, 'wall']:.2f}x wall on two")


if __name__ == "__main__":
    main()

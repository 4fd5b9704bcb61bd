"""Build the real-weights DCP checkpoint the benchmarks run on, saved by torch's DCP from 4 ranks.

One "unit" is about 93 MB: the Whisper tiny.en weights cast to bfloat16 (`model.unitN.whisper.*`,
the accepted stand-in for a bf16 model) and the GE2E speaker encoder in float32 with the real
Adam state of its training run (`model.unitN.encoder.*`, `optim.unitN.encoder.*`). Units are
numbered replicas, so 11 units make about 1 GB and 43 about 4 GB. Each rank reads only its own rows of every tensor (`Shard(0)`, torch.chunk
semantics) and the job saves `DTensor`s with `dcp.save`, as an FSDP2 training job would.

Usage: python bench/real_checkpoint.py [--units 11] [--ranks 4] [--out DIR]
Other benchmarks call `real_checkpoint(units, ranks)`, which builds once and reuses the result
under bench/out/ (or $DCPCTL_BENCH_OUT).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
REAL_DATA = REPO_ROOT.parent / "shared" / "data" / "real"
WHISPER = REAL_DATA / "whisper_tiny_en_fp16.safetensors"
ENCODER = REAL_DATA / "resemblyzer_lstm_adam.safetensors"
# Built checkpoints are cached here; DCPCTL_BENCH_OUT lets several work trees share one cache.
OUT_ROOT = Path(os.environ.get("DCPCTL_BENCH_OUT", REPO_ROOT / "bench" / "out"))
sys.path.insert(0, str(REPO_ROOT / "fixtures"))


def _sources() -> list[tuple[str, Path, str, object]]:
    """(fqn prefix, file, name inside, dtype to cast to or None) for one unit's tensors."""
    import torch
    from safetensors import safe_open

    sources = []
    with safe_open(WHISPER, "pt") as whisper:
        for name in whisper.keys():
            sources.append((f"model.whisper.{name.replace('/', '.')}", WHISPER, name,
                            torch.bfloat16))
    with safe_open(ENCODER, "pt") as encoder:
        for name in encoder.keys():
            group, _, rest = name.partition(".")
            sources.append((f"{group}.encoder.{rest}", ENCODER, name, None))
    return sources


def _rows_of_rank(rows: int, rank: int, world_size: int) -> tuple[int, int]:
    per_rank = -(-rows // world_size)
    start = min(rank * per_rank, rows)
    return start, min(start + per_rank, rows)


def unit_tensors() -> dict:
    """One unit's tensors whole, by fqn, as a one-rank job holds them (without the process
    group rank_state needs)."""
    from safetensors import safe_open

    tensors = {}
    handles = {path: safe_open(path, "pt") for path in (WHISPER, ENCODER)}
    for fqn, path, name, dtype in _sources():
        tensor = handles[path].get_tensor(name)
        tensors[fqn] = tensor.to(dtype) if dtype is not None else tensor
    return tensors


def rank_state(rank: int, world_size: int, units: int) -> dict:
    """This rank's state dict of `units` units: its rows of every tensor as a Shard(0) DTensor
    (0-d tensors whole), as an FSDP2 job holds them, and the step counter. Needs the gloo
    process group of the job."""
    import torch
    from safetensors import safe_open
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    mesh = init_device_mesh("cpu", (world_size,))
    state: dict = {}
    handles = {path: safe_open(path, "pt") for path in (WHISPER, ENCODER)}
    for fqn, path, name, dtype in _sources():
        piece = handles[path].get_slice(name)
        shape = piece.get_shape()
        if not shape:
            local = handles[path].get_tensor(name)
            placements_local = None
        else:
            start, stop = _rows_of_rank(shape[0], rank, world_size)
            local = piece[start:stop]
            placements_local = (torch.Size(shape), start)
        if dtype is not None:
            local = local.to(dtype)
        for unit in range(units):
            group, _, rest = fqn.partition(".")
            key = f"{group}.unit{unit}.{rest}"
            if placements_local is None:
                state[key] = local.clone()
                continue
            full_shape, _ = placements_local
            stride = torch.empty(full_shape, device="meta").stride()
            state[key] = DTensor.from_local(local.clone(), mesh, [Shard(0)], run_check=False,
                                            shape=full_shape, stride=stride)
    state["step"] = 1564500
    return state


def _save_rank(rank: int, world_size: int, out_dir: str, units: int, zstd: bool) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint._extension import ZStandard

    dcp.save(rank_state(rank, world_size, units), storage_writer=dcp.FileSystemWriter(
        out_dir, thread_count=1, _extensions=[ZStandard()] if zstd else None))


def build_real_checkpoint(out_dir: Path, units: int, ranks: int, zstd: bool = False) -> Path:
    """Save the real-weights checkpoint of `units` units from `ranks` gloo processes; with zstd,
    as torch's own save with the ZStandard extension writes it."""
    from make_fixtures import run_gloo_job

    shutil.rmtree(out_dir, ignore_errors=True)
    run_gloo_job(ranks, _save_rank, str(out_dir), units, zstd)
    return out_dir


ONE_GB_UNITS = 11
FOUR_GB_UNITS = 43


def real_checkpoint(units: int = ONE_GB_UNITS, ranks: int = 4, zstd: bool = False) -> Path:
    """The cached real-weights checkpoint (built on first use under bench/out/)."""
    out_dir = OUT_ROOT / f"real-{units}u-{ranks}r{'-zstd' if zstd else ''}"
    if not (out_dir / ".metadata").exists():
        build_real_checkpoint(out_dir, units, ranks, zstd)
    return out_dir


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--units", type=int, default=ONE_GB_UNITS)
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    out = args.out or OUT_ROOT / f"real-{args.units}u-{args.ranks}r"
    build_real_checkpoint(out, args.units, args.ranks)
    total = sum(path.stat().st_size for path in out.iterdir())
    print(f"{out}: {total / 1e9:.2f} GB")


if __name__ == "__main__":
    main()

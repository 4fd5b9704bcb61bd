"""Time `dcpctl inspect` on a checkpoint whose metadata lists 100,000 tensors.

Builds the `.metadata` torch would write for 100,000 tensors sharded over 4 ranks (400,000
stored chunks) with sparse data files, then times side by side, each in a fresh process:
  torch:  `FileSystemReader(path).read_metadata()` (today's way to look inside: import torch
          and unpickle with torch's classes)
  dcpctl: `dcpctl inspect --json` (safe unpickle, full report, JSON out) and the table
and, in this process, dcpctl's read + report alone.

Usage: python bench/bench_inspect.py [--tensors N] [--ranks R] [--workdir DIR]
"""

from __future__ import annotations

import argparse
import pickle
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def build_checkpoint(directory: Path, tensor_count: int, ranks: int) -> None:
    """Write a `.metadata` with tensor_count tensors of ranks chunks each, and sparse files."""
    import torch
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, Metadata,
                                                       MetadataIndex, StorageMeta,
                                                       TensorProperties, TensorStorageMetadata)

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


def time_command(command: list[str]) -> float:
    start = time.perf_counter()
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tensors", type=int, default=100_000)
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--workdir", type=Path, default=None)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(dir=args.workdir) as work:
        checkpoint = Path(work) / "ckpt"
        build_checkpoint(checkpoint, args.tensors, args.ranks)
        metadata_mb = (checkpoint / ".metadata").stat().st_size / 1e6
        print(f"checkpoint: {args.tensors} tensors x {args.ranks} chunks, "
              f".metadata {metadata_mb:.1f} MB")
        torch_code = ("from torch.distributed.checkpoint import FileSystemReader; "
                      f"FileSystemReader({str(checkpoint)!r}).read_metadata()")
        torch_seconds = time_command([sys.executable, "-c", torch_code])
        dcpctl_seconds = time_command([sys.executable, "-m", "dcpctl", "inspect", "--json",
                                       str(checkpoint)])
        table_seconds = time_command([sys.executable, "-m", "dcpctl", "inspect", str(checkpoint)])
        from dcpctl.ops.inspect import inspect_checkpoint

        start = time.perf_counter()
        report = inspect_checkpoint(checkpoint)
        in_process = time.perf_counter() - start
        assert len(report.tensors) == args.tensors
        print(f"{'what':<44}{'seconds':>9}")
        print(f"{'torch: import + read_metadata (process)':<44}{torch_seconds:>9.2f}")
        print(f"{'dcpctl inspect --json (process)':<44}{dcpctl_seconds:>9.2f}")
        print(f"{'dcpctl inspect, table (process)':<44}{table_seconds:>9.2f}")
        print(f"{'dcpctl read + report (in process)':<44}{in_process:>9.2f}")
        print(f"dcpctl inspect --json / torch read_metadata: {dcpctl_seconds / torch_seconds:.2f}x")


if __name__ == "__main__":
    main()

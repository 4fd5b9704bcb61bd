"""Metadata at the scale of thousand-rank jobs: reading a `.metadata` of millions of chunks.

A checkpoint of --tensors bf16 tensors, each split by rows over --ranks ranks (one chunk per
rank, FSDP2's layout), is described by a `.metadata` built with torch's own classes and pickled
as torch's FileSystemWriter pickles it; its data files are sparse files of the right sizes
(nothing here reads them). Each contender runs in a fresh process under /usr/bin/time -v, best
of --repeat: torch's `FileSystemReader.read_metadata`, the floor of any reader built on Python's
C unpickler (the unpickler alone, into stand-in classes), `dcpctl inspect` (the table), `dcpctl
inspect --json` and `dcpctl verify --quick`, with wall time, peak RSS and each one's time as a
fraction of torch's. --also-ranks repeats it at a second rank count (4096 gives 4 M chunks at
the default 1,000 tensors), to show how time and memory grow.

--reshard-tensors N also writes metadata of that scale: a checkpoint of N small fp32 tensors
(1,024 x 16), saved by torch's DCP from one process, is resharded for --ranks ranks with
`dcpctl reshard`: N x ranks chunks of one row each, planned, written and described in a new
`.metadata` (wall time and peak RSS, best of --repeat).

Usage: python bench/bench_metadata.py [--tensors 1000] [--ranks 1024] [--also-ranks 4096]
       [--reshard-tensors 1000] [--skip-read]
"""

from __future__ import annotations

import argparse
import os
import pickle
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import (STAND_IN_UNPICKLER, dcpctl_command, drop_directory,  # noqa: E402
                     measure, print_table, python_command)
from real_checkpoint import OUT_ROOT  # noqa: E402

ROWS_PER_RANK, COLUMNS = 2, 64
CHUNK_ITEM_BYTES = 1600  # a torch.save archive of a 2x64 bf16 chunk takes about this much

TORCH_READ = """
import sys
from torch.distributed.checkpoint import FileSystemReader
metadata = FileSystemReader(sys.argv[1]).read_metadata()
print(sum(len(entry.chunks) for entry in metadata.state_dict_metadata.values()))
"""

# The floor of any reader that builds records with Python's C unpickler: the unpickler alone,
# its globals mapped to the cheapest stand-ins (no checks, no allowlist, no report). Its peak
# memory is not a floor: each stand-in copies its fields into a dict of its own, beside the
# state dict the unpickler's memo keeps until it ends, where dcpctl's chunk, key and storage
# records keep theirs in slots (records.py).
UNPICKLE_FLOOR = STAND_IN_UNPICKLER + """
import sys
with open(sys.argv[1] + "/.metadata", "rb") as stream:
    StandIns(stream).load()
"""


def build_metadata(directory: Path, tensors: int, ranks: int) -> None:
    """Write `.metadata` (torch's classes) and sparse data files for tensors x ranks chunks."""
    import torch
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, Metadata,
                                                       MetadataIndex, TensorProperties,
                                                       TensorStorageMetadata)

    directory.mkdir(parents=True, exist_ok=True)
    state_dict_metadata, storage_data, planner_data = {}, {}, {}
    file_bytes = [0] * ranks
    properties = TensorProperties(dtype=torch.bfloat16)
    for tensor in range(tensors):
        fqn = f"model.layers.{tensor // 10}.block{tensor % 10}.weight"
        chunks = []
        for rank in range(ranks):
            offsets = torch.Size([rank * ROWS_PER_RANK, 0])
            chunks.append(ChunkStorageMetadata(offsets=offsets,
                                               sizes=torch.Size([ROWS_PER_RANK, COLUMNS])))
            storage_data[MetadataIndex(fqn, offsets, rank)] = _StorageInfo(
                f"__{rank}_0.distcp", file_bytes[rank], CHUNK_ITEM_BYTES)
            file_bytes[rank] += CHUNK_ITEM_BYTES
        state_dict_metadata[fqn] = TensorStorageMetadata(
            properties, torch.Size([ranks * ROWS_PER_RANK, COLUMNS]), chunks)
        planner_data[fqn] = tuple(fqn.split("."))
    metadata = Metadata(state_dict_metadata, planner_data, storage_data)
    with open(directory / ".metadata", "wb") as stream:
        pickle.dump(metadata, stream)
    for rank, size in enumerate(file_bytes):
        with open(directory / f"__{rank}_0.distcp", "wb") as stream:
            stream.truncate(size)


def checkpoint_of(tensors: int, ranks: int) -> Path:
    """The cached metadata-scale checkpoint (built on first use under bench/out/)."""
    directory = OUT_ROOT / f"metadata-{tensors}t-{ranks}r"
    if not (directory / ".metadata").exists():
        build_metadata(directory, tensors, ranks)
    return directory


def bench(tensors: int, ranks: int, repeat: int) -> list[tuple]:
    checkpoint = checkpoint_of(tensors, ranks)
    contenders = [
        ("torch FileSystemReader.read_metadata", python_command(TORCH_READ) + [str(checkpoint)]),
        ("floor: C unpickle to stand-ins", python_command(UNPICKLE_FLOOR) + [str(checkpoint)]),
        ("dcpctl inspect", dcpctl_command("inspect", str(checkpoint))),
        ("dcpctl inspect --json", dcpctl_command("inspect", str(checkpoint), "--json")),
        ("dcpctl verify --quick", dcpctl_command("verify", str(checkpoint), "--quick")),
    ]
    best = {}
    for _ in range(repeat):
        for label, command in contenders:
            run = measure(label, command, env={"PYTHONUNBUFFERED": "1"})
            if label not in best or run.seconds < best[label].seconds:
                best[label] = run
    torch_seconds = best[contenders[0][0]].seconds
    size_mb = os.path.getsize(checkpoint / ".metadata") / 1e6
    return [(f"{tensors * ranks / 1e6:.2f} M chunks ({size_mb:.0f} MB)", label,
             f"{run.seconds:.2f}", f"{run.seconds / torch_seconds:.2f}",
             f"{run.peak_rss_bytes / 2**30:.2f}") for label, run in best.items()]


SAVE_SMALL_TENSORS = """
import sys
import torch
import torch.distributed.checkpoint as dcp
generator = torch.Generator().manual_seed(0)
state = {f"layers.{index}.weight": torch.randn(1024, 16, generator=generator)
         for index in range(int(sys.argv[2]))}
dcp.save(state, storage_writer=dcp.FileSystemWriter(sys.argv[1]), no_dist=True)
"""


def bench_reshard(tensors: int, ranks: int, repeat: int) -> list[tuple]:
    """`dcpctl reshard --ranks ranks` of a one-rank save of `tensors` small tensors."""
    source = OUT_ROOT / f"small-tensors-{tensors}"
    if not (source / ".metadata").exists():
        drop_directory(source)
        measure("save", python_command(SAVE_SMALL_TENSORS) + [str(source), str(tensors)])
    output = OUT_ROOT / "metadata-reshard-out"
    best = None
    for _ in range(repeat):
        drop_directory(output)
        run = measure("reshard", dcpctl_command("reshard", str(source), "--ranks", str(ranks),
                                                "-o", str(output)))
        best = run if best is None or run.seconds < best.seconds else best
    size_mb = os.path.getsize(output / ".metadata") / 1e6
    drop_directory(output)
    return [(f"{tensors * ranks / 1e6:.2f} M chunks written ({size_mb:.0f} MB)",
             f"dcpctl reshard --ranks {ranks} ({tensors} tensors)", f"{best.seconds:.2f}", "",
             f"{best.peak_rss_bytes / 2**30:.2f}")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tensors", type=int, default=1000)
    parser.add_argument("--ranks", type=int, default=1024)
    parser.add_argument("--also-ranks", type=int, default=0)
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--reshard-tensors", type=int, default=0)
    parser.add_argument("--skip-read", action="store_true", help="only the reshard")
    args = parser.parse_args()
    rows = [] if args.skip_read else bench(args.tensors, args.ranks, args.repeat)
    if args.also_ranks and not args.skip_read:
        rows += bench(args.tensors, args.also_ranks, args.repeat)
    if args.reshard_tensors:
        rows += bench_reshard(args.reshard_tensors, args.ranks, args.repeat)
    print_table(rows, ("metadata", "reader", "seconds", "x torch", "peak RSS GiB"))
    print("bars: inspect and verify --quick at most 0.3x torch; peak RSS at most 0.5 GiB at "
          "1 M chunks, growing linearly")


if __name__ == "__main__":
    main()

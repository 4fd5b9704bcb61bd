"""The floor under any command that reads a checkpoint and writes one with SHA256SUMS: copy a
checkpoint's files while computing what every rewritten chunk costs in bytes work alone (a
CRC-32 of each byte, as each torch.save archive needs over its payload, and a SHA-256 of each
byte written), with no re-layout and no Python per chunk: each file in 4 MiB reads, files shared
among threads. --zstd LEVEL also compresses (the floor of compress): each item the
`.metadata` names in zstd frames of its own, as torch's `stream.zstd/1` format has it (one
frame per 4 MiB piece of an item larger than that), and the bytes between items (none in a DCP
save) as they come. A frame over 4 MiB of a file would find
what neighbouring items share: torch's planner puts items of one size next to each other, and
the benchmark checkpoint's units are replicas, so such frames are about half the size of the
items' own and quicker to make, less than the work compress cannot avoid. --no-write only
reads and checks (the floor of verify); --no-sha256 leaves out the SHA-256 (the floor of a
conversion to safetensors, which writes no SHA256SUMS).

Usage: python bench/checksummed_copy.py SOURCE TARGET [THREADS] [--zstd LEVEL] [--no-write]
       [--no-sha256]
"""

from __future__ import annotations

import argparse
import hashlib
import os
import threading
import zlib
from pathlib import Path
from typing import Sequence

PIECE_BYTES = 4 << 20


def copy_file(source: Path, target: Path | None, zstd_level: int | None,
              sha256: bool = True, item_ends: Sequence[int] = ()) -> str:
    """Copy source to target in pieces of at most PIECE_BYTES that end where items end
    (item_ends), each compressed at zstd_level if given, CRC-32 over every piece read and
    SHA-256 over every piece written (unless not sha256); the digest."""
    import zstandard

    digest = hashlib.sha256() if sha256 else None
    compressor = zstandard.ZstdCompressor(level=zstd_level) if zstd_level is not None else None
    ends = iter(item_ends)
    next_end = next(ends, None)
    position = 0
    with open(source, "rb", buffering=0) as reader:
        writer = open(target, "xb", buffering=0) if target is not None else None
        try:
            while True:
                while next_end is not None and next_end <= position:
                    next_end = next(ends, None)
                wanted = PIECE_BYTES if next_end is None else min(PIECE_BYTES,
                                                                  next_end - position)
                piece = reader.read(wanted)
                if not piece:
                    break
                position += len(piece)
                zlib.crc32(piece)
                if compressor is not None:
                    piece = compressor.compress(piece)
                if digest is not None:
                    digest.update(piece)
                if writer is not None:
                    writer.write(piece)
        finally:
            if writer is not None:
                writer.close()
    return digest.hexdigest() if digest is not None else ""


def item_ends_by_file(checkpoint: Path) -> dict[str, list[int]]:
    """Where each item the checkpoint's `.metadata` names ends, by data file, in order."""
    from dcpctl.format.metadata.reading import read_metadata

    ends: dict[str, set[int]] = {}
    for info in read_metadata(checkpoint).storage_data.values():
        ends.setdefault(info.relative_path, set()).add(info.offset + info.length)
    return {name: sorted(file_ends) for name, file_ends in ends.items()}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("source", type=Path)
    parser.add_argument("target", type=Path)
    parser.add_argument("threads", type=int, nargs="?", default=len(os.sched_getaffinity(0)))
    parser.add_argument("--zstd", type=int, default=None)
    parser.add_argument("--no-write", action="store_true")
    parser.add_argument("--no-sha256", action="store_true")
    args = parser.parse_args()
    if not args.no_write:
        args.target.mkdir()
    names = sorted(path.name for path in args.source.iterdir())
    item_ends = item_ends_by_file(args.source) if args.zstd is not None else {}

    def copy_share(share: list[str]) -> None:
        for name in share:
            copy_file(args.source / name, None if args.no_write else args.target / name,
                      args.zstd, sha256=not args.no_sha256, item_ends=item_ends.get(name, []))

    workers = [threading.Thread(target=copy_share, args=(names[index::args.threads],))
               for index in range(args.threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()


if __name__ == "__main__":
    main()

"""The floor under any reshard that writes SHA256SUMS: copy a checkpoint's files while
computing what every rewritten chunk costs in bytes work alone (a CRC-32 of each byte, as each
torch.save archive needs over its payload, and a SHA-256 of each byte written), with no
re-layout and no Python per chunk: each file in 4 MiB reads, files shared among threads.

Usage: python bench/checksummed_copy.py SOURCE TARGET [THREADS]
"""

from __future__ import annotations

import hashlib
import os
import sys
import threading
import zlib
from pathlib import Path

PIECE_BYTES = 4 << 20


def copy_file(source: Path, target: Path) -> str:
    """Copy source to target in pieces, CRC-32 and SHA-256 over every piece; the digest."""
    digest = hashlib.sha256()
    with open(source, "rb", buffering=0) as reader, open(target, "xb", buffering=0) as writer:
        while piece := reader.read(PIECE_BYTES):
            zlib.crc32(piece)
            digest.update(piece)
            writer.write(piece)
    return digest.hexdigest()


def main() -> None:
    source, target = Path(sys.argv[1]), Path(sys.argv[2])
    threads = int(sys.argv[3]) if len(sys.argv) > 3 else len(os.sched_getaffinity(0))
    target.mkdir()
    names = sorted(path.name for path in source.iterdir())
    workers = [threading.Thread(target=lambda share: [copy_file(source / name, target / name)
                                                      for name in share],
                                args=(names[index::threads],)) for index in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()


if __name__ == "__main__":
    main()

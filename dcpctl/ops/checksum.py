"""Write SHA256SUMS for a checkpoint: the SHA-256 of `.metadata` and of every data file."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable

from dcpctl.format.checkpoint.checksums import sha256_of_files, write_sha256sums
from dcpctl.format.checkpoint.structure import checked_checkpoint
from dcpctl.format.file_names import METADATA_FILE_NAME
from dcpctl.pipeline import default_thread_count
from dcpctl.storage.local import remove_stale_temporaries


@dataclass
class ChecksumReport:
    """Where SHA256SUMS was written, and the digest of each file it covers."""

    path: str
    sums_path: str
    digests: dict[str, str]
    hashed_bytes: int

    def to_json(self) -> dict:
        """A JSON-ready dict."""
        return {"path": self.path, "sums_path": self.sums_path, "hashed_bytes": self.hashed_bytes,
                "files": self.digests}


def checksum_checkpoint(path: str | os.PathLike, threads: int | None = None,
                        on_progress: Callable[[int, int], None] | None = None) -> ChecksumReport:
    """Hash `.metadata` and every data file the metadata names, in parallel, and write
    CKPT/SHA256SUMS. Refuses a checkpoint with missing or truncated data files.
    on_progress(done_bytes, total_bytes) follows the hashing."""
    with checked_checkpoint(path, exclusive=True) as checkpoint:
        remove_stale_temporaries(checkpoint.path, set(checkpoint.files))
        names = [METADATA_FILE_NAME, *checkpoint.files]
        total_bytes = sum((checkpoint.path / name).stat().st_size for name in names)
        advance = None if on_progress is None else lambda done: on_progress(done, total_bytes)
        digests = sha256_of_files(checkpoint.path, names, threads or default_thread_count(),
                                  advance)
        sums_path = write_sha256sums(checkpoint.path, digests)
    return ChecksumReport(str(checkpoint.path), str(sums_path), dict(sorted(digests.items())),
                          total_bytes)

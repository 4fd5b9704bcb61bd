"""Local files written so that a crash never leaves half of one under its real name."""

from __future__ import annotations

import contextlib
import hashlib
import os
import secrets
import tempfile
from pathlib import Path
from typing import Iterator


def fsync_directory(directory: Path) -> None:
    """Make a directory's entries (renames, new files) durable."""
    descriptor = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def write_file_atomically(path: Path, data: bytes) -> str:
    """Write data to path through a new temporary sibling, synced, then renamed over path: a
    reader sees the old file or the whole new one. Returns the hex SHA-256 of data."""
    temporary = path.with_name(f".{path.name}.dcpctl-{secrets.token_hex(6)}.tmp")
    try:
        with open(temporary, "xb") as stream:
            stream.write(data)
            stream.flush()
            os.fsync(stream.fileno())
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise
    return hashlib.sha256(data).hexdigest()


@contextlib.contextmanager
def scratch_directory_beside(path: Path) -> Iterator[Path]:
    """A new hidden directory beside path for temporary files (on the output's file system,
    not a small /tmp), removed with everything in it afterwards."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=path.parent,
                                     prefix=f".{path.name}.dcpctl-scratch-") as directory:
        yield Path(directory)

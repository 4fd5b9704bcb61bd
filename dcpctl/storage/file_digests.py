"""SHA-256 digests of files and objects: of the whole, read in pieces, or of a file's ends."""

from __future__ import annotations

import hashlib
from typing import Callable

from dcpctl.storage.paths import RangedFile, StoragePath, open_ranged

HASH_PIECE_BYTES = 4 << 20
"""The bytes read at a time to hash a file."""


def sha256_of_file(path: StoragePath, on_progress: Callable[[int], None] | None = None) -> str:
    """The hex SHA-256 of a file, read in pieces; on_progress gets the size of each piece."""
    with open_ranged(path) as reader:
        return sha256_of_opened(reader, on_progress)


def sha256_of_opened(reader: RangedFile, on_progress: Callable[[int], None] | None = None
                     ) -> str:
    """The hex SHA-256 of a file opened for ranged reads, read in pieces."""
    digest = hashlib.sha256()
    position = 0
    while piece := reader.read(position, HASH_PIECE_BYTES):
        position += len(piece)
        digest.update(piece)
        if on_progress is not None:
            on_progress(len(piece))
    return digest.hexdigest()


def sha256_of_ends(path: StoragePath, end_bytes: int) -> str:
    """The hex SHA-256 of a file's size and its first and last end_bytes (all of it, if it is
    no longer than twice that)."""
    with open_ranged(path) as reader:
        size = reader.size()
        digest = hashlib.sha256(size.to_bytes(8, "little"))
        digest.update(reader.read(0, min(size, end_bytes)))
        if size > end_bytes:
            tail_start = max(end_bytes, size - end_bytes)
            digest.update(reader.read(tail_start, size - tail_start))
    return digest.hexdigest()

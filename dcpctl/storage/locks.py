"""Locks on directories, held on the directory itself (flock on a descriptor of it): nothing
is written to take one, so nothing can be planted in its place, and the kernel drops it when
the process ends, so no lock is ever stale.

dcpctl takes an exclusive lock on a checkpoint it rewrites in place, writes SHA256SUMS into or
deletes, and on a run directory it prunes; a shared one on a checkpoint it reads data from. A
second dcpctl that would conflict fails at once, changing nothing. Processes that are not
dcpctl (a trainer saving) take no such lock. On a file system without flock the locks are
not taken at all.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import stat
from pathlib import Path
from typing import Iterator

from dcpctl.errors import LockHeldError
from dcpctl.storage.paths import is_remote, storage_path

_LOCKS_UNSUPPORTED = (errno.ENOLCK, errno.EOPNOTSUPP, errno.EINVAL)


@contextlib.contextmanager
def locked_directory(path: Path, exclusive: bool, what: str) -> Iterator[int]:
    """Hold a lock on directory path while the block runs; yields a descriptor of it. Fails at
    once with LockHeldError, saying `what` holds it, when another dcpctl holds a conflicting
    lock."""
    descriptor = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        lock_descriptor(descriptor, exclusive, path, what)
        yield descriptor
    finally:
        os.close(descriptor)


@contextlib.contextmanager
def locked_checkpoint(path: str | os.PathLike, exclusive: bool) -> Iterator[None]:
    """Hold a checkpoint directory, or a file dcpctl reads or replaces whole (a safetensors or
    torch.save file): exclusively to change it (another dcpctl reading or changing it makes
    this fail at once), shared to read its data (another dcpctl changing it makes this fail at
    once). A path that is neither is left to the caller to refuse. A checkpoint in an object
    store takes no lock: there are none; conditional writes guard what dcpctl replaces
    there."""
    what = ("another dcpctl is reading or changing this checkpoint" if exclusive
            else "another dcpctl is changing this checkpoint")
    if is_remote(storage_path(path)):
        yield
        return
    try:  # never waits: a FIFO planted there opens at once, non-blocking
        descriptor = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK | os.O_NOCTTY)
    except OSError:
        yield
        return
    try:
        mode = os.fstat(descriptor).st_mode
        if stat.S_ISDIR(mode) or stat.S_ISREG(mode):
            lock_descriptor(descriptor, exclusive, Path(path), what)
        yield
    finally:
        os.close(descriptor)


def lock_descriptor(descriptor: int, exclusive: bool, path: Path, what: str) -> None:
    """Lock an open directory (released when the descriptor is closed)."""
    try:
        fcntl.flock(descriptor, (fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH) | fcntl.LOCK_NB)
    except BlockingIOError:
        raise LockHeldError(f"{what}; nothing was changed, try again later",
                            path=path) from None
    except OSError as error:
        if error.errno not in _LOCKS_UNSUPPORTED:
            raise

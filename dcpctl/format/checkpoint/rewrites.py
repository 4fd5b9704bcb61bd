"""A checkpoint in an object store rewritten while dcpctl read it.

A store has no locks: an in-place run (dcpctl's, or a trainer saving that step again) may
switch a checkpoint's `.metadata` to new data files and delete the old ones while another
dcpctl reads them. That reader then finds files gone or changed, which would read as damage;
it is a sound checkpoint read at the wrong moment. Where its `.metadata` is no longer the one
read, the reader says so instead, with the exit status that says "try again".
"""

from __future__ import annotations

import contextlib
from typing import Iterator

from dcpctl.errors import DcpctlError
from dcpctl.format.file_names import METADATA_FILE_NAME
from dcpctl.storage.objects import ObjectChangedError, ObjectPath, StorageError
from dcpctl.storage.paths import StoragePath


def rewritten_since_read(directory: StoragePath) -> bool:
    """Whether the checkpoint at directory, in an object store, no longer has the `.metadata`
    this process read, nor one it wrote itself (by ETag; gone counts). False locally, where
    locks keep it from being rewritten under a reader, and where the store gives no ETags or
    will not answer."""
    if not isinstance(directory, ObjectPath):
        return False
    store, key = directory.store, (directory / METADATA_FILE_NAME).key
    read = store.remembered_etag(key)
    if not read:
        return False
    try:
        now = store.info_now(key)
    except (StorageError, OSError):
        return False
    return now is None or (now.etag is not None
                           and now.etag not in (read, store.etag_written(key)))


def rewrite_error(directory: StoragePath) -> ObjectChangedError:
    """The error of a read of directory that another run's rewrite cut short."""
    return ObjectChangedError("was rewritten while dcpctl read it (its .metadata is not the one "
                              "read: another dcpctl's in-place run, or a save of this step?); "
                              "the checkpoint may well be sound: run the command again",
                              path=directory)


@contextlib.contextmanager
def rewrite_named(directory: StoragePath) -> Iterator[None]:
    """Where the block fails because the checkpoint at directory was rewritten meanwhile
    (rewritten_since_read), raise rewrite_error instead of what the block raised (a file
    gone, an object changed, a CRC that no longer holds). A failure of the store itself (a
    connection that kept failing, a timeout) is no sign of a rewrite: it is raised as it is,
    without asking that store again, which would wait out the client's retries once more."""
    try:
        yield
    except (DcpctlError, OSError) as error:
        store_failed = isinstance(error, StorageError) and not isinstance(
            error, ObjectChangedError)
        if not store_failed and rewritten_since_read(directory):
            raise rewrite_error(directory) from error
        raise

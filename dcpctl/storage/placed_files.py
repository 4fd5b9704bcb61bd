"""Output files whose every byte's place is known before they are written, so that several
processes can each write their parts of one file (a safetensors shard, a torch.save archive).

Locally the file is created once, exclusively, by the coordinator, and every writer (the
coordinator, worker processes, torchrun ranks on a shared file system) opens it and writes its
parts at their offsets. An object in an object store is uploaded front to back, so there the
parts must come in order, from this one process: ObjectPlacedFile refuses any other offset.
"""

from __future__ import annotations

import contextlib
import os

from dcpctl.errors import InvalidOptionError
from dcpctl.failpoints import Failpoint, failpoint
from dcpctl.storage.claims import OutputClaim
from dcpctl.storage.local import naming_failures
from dcpctl.storage.objects import ObjectPath
from dcpctl.storage.paths import ObjectOutputFile, StoragePath
from dcpctl.storage.writeback import Writeback


class LocalPlacedFile:
    """A local file written at offsets: created exclusively (create=True, never an existing
    file nor a symlink's target), or opened for writing as it is (a worker's view of a file its
    coordinator created)."""

    def __init__(self, path: str | os.PathLike, create: bool) -> None:
        self.path = os.fspath(path)
        flags = os.O_WRONLY | os.O_CLOEXEC | os.O_NOFOLLOW
        with naming_failures(self.path):
            self._descriptor = os.open(self.path, flags | (os.O_CREAT | os.O_EXCL if create
                                                           else 0), 0o644)
        self._writeback = Writeback(self._descriptor)

    def write_at(self, offset: int, data) -> None:
        """Write data at offset (a file grows to hold it)."""
        view = memoryview(data).cast("B")
        with naming_failures(self.path):
            while view:
                written = os.pwrite(self._descriptor, view, offset)
                view, offset = view[written:], offset + written
                self._writeback.written(written)

    def finish(self) -> None:
        """Sync what this writer wrote to disk and close the file."""
        with naming_failures(self.path):
            os.fsync(self._descriptor)
            self._close()
        failpoint(Failpoint.AFTER_DATA_FILE)

    def discard(self) -> None:
        """Close without syncing, after a failure; the file is its owner's to remove."""
        with contextlib.suppress(OSError):
            self._close()

    def _close(self) -> None:
        if self._descriptor >= 0:
            descriptor, self._descriptor = self._descriptor, -1
            os.close(descriptor)


class ObjectPlacedFile:
    """A new object written as a placed file whose parts come in order (see the module
    docstring): an offset other than the end written so far is refused."""

    def __init__(self, path: ObjectPath, replacing: bool, claim: OutputClaim | None) -> None:
        self.path = path
        self._output = ObjectOutputFile(path, replacing, claim)

    def write_at(self, offset: int, data) -> None:
        """Append data, which must start where the object ends so far."""
        if offset != self._output.tell():
            raise InvalidOptionError(f"{self.path}: an object is uploaded front to back; it "
                                     f"cannot take bytes at {offset} after {self._output.tell()}")
        self._output.write(data)

    def finish(self) -> None:
        """Complete the object."""
        self._output.finish()

    def discard(self) -> None:
        """Abandon the object; nothing of it appears."""
        self._output.discard()


def new_placed_file(path: StoragePath, replacing: bool = False,
                    claim: OutputClaim | None = None) -> LocalPlacedFile | ObjectPlacedFile:
    """A new placed file at path, for its coordinator; an object only where none has its name,
    unless replacing, and only while claim (its output's) holds (see ObjectOutputFile)."""
    if isinstance(path, ObjectPath):
        return ObjectPlacedFile(path, replacing, claim)
    return LocalPlacedFile(path, create=True)


def can_share_placed_files(path: StoragePath) -> bool:
    """Whether other processes can write parts of placed files under path (local paths only)."""
    return not isinstance(path, ObjectPath)

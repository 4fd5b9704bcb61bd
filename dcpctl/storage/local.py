"""Local files written so that a crash never leaves half of one under its real name."""

from __future__ import annotations

import contextlib
import ctypes
import errno
import hashlib
import os
import re
import secrets
import stat
import tempfile
from pathlib import Path
from typing import BinaryIO, Iterable, Iterator

from dcpctl.failpoints import Failpoint, failpoint
from dcpctl.storage.writeback import Writeback

# The names dcpctl gives what it writes beside a file before renaming it into place: the final
# name, a random token and `.tmp` (a hard link made on the way adds `.link`).
_TEMPORARY_NAME = re.compile(r"^(?P<final>.+)\.dcpctl-[0-9a-f]{12}\.tmp(\.link)?$")


def new_token() -> str:
    """A random token that sets one run's temporary names apart from another's."""
    return secrets.token_hex(6)


def temporary_name(final_name: str, token: str) -> str:
    """The name a file that will be called final_name has while it is written."""
    return f"{final_name}.dcpctl-{token}.tmp"


def is_temporary_name(name: str) -> bool:
    """Whether name is one dcpctl gives a file while it is written."""
    return _TEMPORARY_NAME.match(name) is not None


def final_name_of(name: str) -> str:
    """The name a file will have once in place: a temporary name left by an interrupted run
    maps back to the name it was standing in for."""
    match = _TEMPORARY_NAME.match(name)
    return match.group("final") if match else name


def names_stood_in_for(names: Iterable[str]) -> set[str]:
    """The final names of those of names that are temporary names: where a checkpoint's
    `.metadata` names a temporary (an in-place rewrite stopped after its first switch), the
    file of its final name is the old data it replaced."""
    return {final_name_of(name) for name in names if is_temporary_name(name)}


@contextlib.contextmanager
def naming_failures(path: str | os.PathLike) -> Iterator[None]:
    """Let an OSError raised without a file name (a write on a full disk says only "No space
    left on device"), or naming path, name path as the user knows it (as_published)."""
    try:
        yield
    except OSError as error:
        if error.filename is None or error.filename == os.fspath(path):
            raise OSError(error.errno, error.strerror, as_published(path)) from None
        raise


def staging_directory_name(destination_name: str, token: str) -> str:
    """The hidden directory beside an output that it is written in before it is renamed into
    place (StagedOutput)."""
    return temporary_name(f".{destination_name}", token)


def as_published(path: str | os.PathLike) -> str:
    """path as the user knows it: a file in an output's staging directory (a name they never
    gave, gone once the run ends) named by where it goes once published. An output file (not
    a directory) lies in its staging directory under its own name."""
    parts = os.fspath(path).split(os.sep)
    for index, part in enumerate(parts[:-1]):
        staging = _TEMPORARY_NAME.match(part)
        if staging and part.startswith(".") and part.endswith(".tmp"):
            destination = staging.group("final")[1:]
            rest = parts[index + 1:]
            parts = [*parts[:index], destination, *([] if rest == [destination] else rest)]
            break
    return os.sep.join(parts)


class OutputFile:
    """A new file being written: created exclusively (never an existing file, nor the target of
    a symlink planted under its name), its write failures naming it, synced when finished."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = os.fspath(path)
        with naming_failures(self.path):
            self._stream = open(self.path, "xb")
        self._writeback = Writeback(self._stream.fileno())

    def write(self, data) -> None:
        """Append data."""
        with naming_failures(self.path):
            self._writeback.written(self._stream.write(data))

    def tell(self) -> int:
        """Bytes written so far."""
        return self._stream.tell()

    def finish(self) -> None:
        """Flush and sync the file to disk, then close it."""
        with naming_failures(self.path):
            self._stream.flush()
            os.fsync(self._stream.fileno())
            self._stream.close()
        failpoint(Failpoint.AFTER_DATA_FILE)

    def discard(self) -> None:
        """Close without syncing, after a failure (which what is still buffered would only
        repeat); the file itself is its owner's to remove."""
        with contextlib.suppress(OSError):
            self._stream.close()

    def __enter__(self) -> OutputFile:
        return self

    def __exit__(self, *exception) -> None:
        if not self._stream.closed:
            self.discard()


class NotARegularFileError(OSError):
    """A path that holds something other than a regular file where one is read: a FIFO, a
    device, a directory. Not a failure of the file system: what stands there is wrong."""

    def __init__(self, path: str | os.PathLike) -> None:
        super().__init__(errno.EINVAL, "not a regular file", os.fspath(path))


def open_regular_file(path: str | os.PathLike, follow_symlinks: bool = True) -> int:
    """A descriptor for reading a regular file; anything else (a FIFO, a device, a directory,
    and without follow_symlinks a symlink) is refused with an OSError naming it, before a read
    could block forever."""
    no_follow = 0 if follow_symlinks else os.O_NOFOLLOW
    try:
        descriptor = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | no_follow)
    except OSError as error:
        if error.errno == errno.ELOOP and not follow_symlinks:
            raise OSError(errno.ELOOP, "a symlink, which is never followed here",
                          os.fspath(path)) from None
        raise
    try:
        if not stat.S_ISREG(os.fstat(descriptor).st_mode):
            raise NotARegularFileError(path)
        os.set_blocking(descriptor, True)
        return descriptor
    except BaseException:
        os.close(descriptor)
        raise


def open_for_reading(path: str | os.PathLike) -> BinaryIO:
    """An unbuffered binary stream of a regular file (see open_regular_file)."""
    return os.fdopen(open_regular_file(path), "rb", buffering=0)


def read_file(path: str | os.PathLike) -> bytes:
    """The whole of a regular file (see open_for_reading)."""
    with open_for_reading(path) as stream:
        return stream.readall()


def fsync_directory(directory: Path) -> None:
    """Make a directory's entries (renames, new files) durable."""
    descriptor = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def write_file_atomically(path: Path, data: bytes, made_stale: Path | None = None) -> str:
    """Write data to path through a new temporary sibling, synced, then renamed over path: a
    reader sees the old file or the whole new one. made_stale, a file the new one makes wrong,
    is removed just before the rename. Returns the hex SHA-256 of data."""
    temporary = path.with_name(temporary_name(path.name, new_token()))
    stream = OutputFile(temporary)  # refuses a name taken: what is there is not ours to remove
    try:
        with stream:
            stream.write(data)
            stream.finish()
        failpoint(Failpoint.BEFORE_ATOMIC_RENAME)
        if made_stale is not None:
            made_stale.unlink(missing_ok=True)
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise
    return hashlib.sha256(data).hexdigest()


def exchange(path: Path, other: Path) -> bool:
    """Swap two directories' names in one step (Linux renameat2 RENAME_EXCHANGE), so that a
    process killed at any moment leaves each name holding one of them; False, nothing done,
    where the kernel, the C library or the file system cannot."""
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (AttributeError, OSError):
        return False
    if renameat2(_AT_FDCWD, os.fsencode(path), _AT_FDCWD, os.fsencode(other),
                 _RENAME_EXCHANGE) == 0:
        return True
    error = ctypes.get_errno()
    if error in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP):
        return False
    raise OSError(error, os.strerror(error), os.fspath(path))


_AT_FDCWD, _RENAME_EXCHANGE = -100, 2


def open_directory_at(parent_descriptor: int, name: str) -> int:
    """A descriptor of directory `name` of an open directory; never follows a symlink there
    (OSError ELOOP or ENOTDIR instead)."""
    return os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC,
                   dir_fd=parent_descriptor)


def empty_directory(descriptor: int) -> None:
    """Delete everything in the open directory, through descriptors only: a path swapped for
    a symlink meanwhile is never followed, whatever it points to; a directory of another file
    system (a mount point) is never entered, and stops it (OSError EXDEV). Goes down without
    recursion, so a tree planted deep inside fails on the open-file limit (an OSError), not on
    Python's stack."""
    entered: list[tuple[int, str]] = []  # the directories below descriptor being emptied
    current = descriptor
    device = os.fstat(descriptor).st_dev
    try:
        while True:
            subdirectory = _remove_files_in(current)
            if subdirectory is not None:
                current = open_directory_at(current, subdirectory)
                entered.append((current, subdirectory))
                if os.fstat(current).st_dev != device:
                    raise OSError(errno.EXDEV, "another file system is mounted there; not "
                                  "deleted", subdirectory)
                continue
            if not entered:
                return
            emptied, name = entered.pop()
            os.close(emptied)
            current = entered[-1][0] if entered else descriptor
            os.rmdir(name, dir_fd=current)
    finally:
        for still_open, _ in entered:
            os.close(still_open)


_MOUNT_INFO = "/proc/self/mountinfo"


def mount_points_at_or_inside(directory: str | os.PathLike) -> list[str]:
    """The mount points at directory (`.`: it is one itself) or inside it, bind mounts of its
    own file system too (which share its device number), relative to it, from the kernel's
    mount table; none where this system has no such table."""
    base = os.path.realpath(directory)
    try:
        with open(_MOUNT_INFO, encoding="utf-8", errors="surrogateescape") as table:
            lines = table.read().splitlines()
    except OSError:
        return []
    inside = []
    for line in lines:
        fields = line.split(" ")
        if len(fields) < 5:
            continue
        # spaces, tabs, newlines and backslashes in a mount point are written as octal escapes
        point = re.sub(r"\\([0-7]{3})", lambda match: chr(int(match.group(1), 8)), fields[4])
        if point == base or point.startswith(base.rstrip("/") + "/"):
            inside.append(os.path.relpath(point, base))
    return sorted(inside)


def remove_directory(path: str | os.PathLike) -> None:
    """Delete the directory at path with everything in it, as empty_directory does (shutil's
    rmtree refuses a directory whose inode a file system reports otherwise once opened, as
    FUSE file systems may after a rename, taking it for a symlink swapped in)."""
    path = Path(path)
    parent = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        descriptor = open_directory_at(parent, path.name)
        try:
            empty_directory(descriptor)
        finally:
            os.close(descriptor)
        os.rmdir(path.name, dir_fd=parent)
    finally:
        os.close(parent)


def _remove_files_in(descriptor: int) -> str | None:
    """Unlink every entry of the open directory but directories; the name of one of those."""
    subdirectory = None
    with os.scandir(descriptor) as entries:
        for entry in entries:
            if entry.is_dir(follow_symlinks=False):
                subdirectory = entry.name
            else:
                os.unlink(entry.name, dir_fd=descriptor)
    return subdirectory


@contextlib.contextmanager
def scratch_directory_in(path: str | os.PathLike) -> Iterator[Path]:
    """The scratch directory at path that a coordinator made (scratch_directory_beside) for its
    workers to share, removed by the coordinator however a worker ends; where this machine does
    not see it (a torchrun rank on another machine, its coordinator's in a temporary directory
    there), one of this process's own, removed afterwards."""
    if Path(path).is_dir():
        yield Path(path)
        return
    with tempfile.TemporaryDirectory(prefix="dcpctl-scratch-") as directory:
        yield Path(directory)


@contextlib.contextmanager
def scratch_directory_beside(path) -> Iterator[Path]:
    """A new hidden directory beside a local path for temporary files (on the output's file
    system, not a small /tmp), removed with everything in it afterwards; for a path in an
    object store, one in the system's temporary directory."""
    if not isinstance(path, Path):
        with tempfile.TemporaryDirectory(prefix="dcpctl-scratch-") as directory:
            yield Path(directory)
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=path.parent,
                                     prefix=f".{path.name}{SCRATCH_INFIX}") as directory:
        yield Path(directory)


SCRATCH_INFIX = ".dcpctl-scratch-"
"""What the name of a scratch directory beside a path holds after the path's own name."""

"""Where a checkpoint lives, local or in an object store, and the one way to read bytes of it.

Every command takes a local path or a URL (`s3://bucket/run/step-100`, `memory://x`, any
fsspec protocol); `storage_path` turns what the user gave into a `pathlib.Path` or an
`ObjectPath`, which answer the same pathlib calls. Bytes are read through `open_ranged`: a
local file with pread (no seek, no buffer, safe from any thread), an object with ranged GETs.
"""

from __future__ import annotations

import collections
import contextlib
import hashlib
import importlib
import os
import posixpath
import re
import threading
import time
from pathlib import Path
from typing import Callable, Iterable, Iterator, Protocol, Union

from dcpctl.errors import InvalidOptionError, OutputTakenError
from dcpctl.failpoints import Failpoint, failpoint
from dcpctl.pipeline import default_thread_count
from dcpctl.storage.claims import OutputClaim
from dcpctl.storage.local import (OutputFile, is_temporary_name, names_stood_in_for,
                                  open_regular_file, read_file, write_file_atomically)
from dcpctl.storage.objects import ObjectPath, WriteOutcomeUnknownError
from dcpctl.storage.stores import holds_user_info, store_for, without_user_info
from dcpctl.thread_pools import DaemonThreadPool

StoragePath = Union[Path, ObjectPath]

_URL = re.compile(r"^(?P<protocol>[A-Za-z][A-Za-z0-9+.-]*)://")


def storage_path(text: str | os.PathLike | ObjectPath) -> StoragePath:
    """A local path, or an object store URL (`file://` and `local://` URLs are local paths;
    a `memory://` path may start with `/`, as fsspec writes it)."""
    if isinstance(text, (Path, ObjectPath)):
        return text
    text = os.fspath(text)
    match = _URL.match(text)
    if match is None:
        _refuse_a_url_short_of_slashes(text)
        return Path(_not_empty(text, text))
    protocol = match.group("protocol").lower()
    text = f"{protocol}://{text[match.end():]}"  # S3://b is s3://b, for fsspec's parsing too
    if holds_user_info(text):
        raise InvalidOptionError("a URL here holds no user or password: give credentials as "
                                 "the store takes them (its environment, or storage options)",
                                 path=without_user_info(text))
    if protocol in _LOCAL_PROTOCOLS:  # fsspec's names of the local file system
        return Path(_not_empty(text[len(protocol) + 3:], text))
    if protocol in ("http", "https"):  # fsspec's http file system lists no objects to write
        raise InvalidOptionError("an http(s) URL names a web page, not objects dcpctl can list "
                                 "and write; give the store's own URL (s3://, gs://, az://...)",
                                 path=text)
    remainder = text[match.end():]
    if protocol == "memory":  # no buckets: one tree of paths
        remainder = remainder.lstrip("/")
    segments = remainder.rstrip("/").split("/")
    if not segments[0]:
        raise InvalidOptionError(f"names no bucket: give {protocol}://BUCKET/PREFIX", path=text)
    if any(segment in ("", ".", "..") for segment in segments):
        raise InvalidOptionError(
            "an object store URL cannot hold '.', '..' or empty path segments: the store keeps "
            "them as literal parts of its object names, not as directories", path=text)
    settings = _settings_in_url(protocol, text)
    if settings:
        raise InvalidOptionError(
            f"names {', '.join(sorted(settings))} in the URL, which dcpctl does not take from "
            "URLs (its stores are one per protocol): give them as storage options; a file "
            "server's (ftp, sftp, smb) files are read through a mount, as a local path",
            path=text)
    store = store_for(protocol)
    return ObjectPath(store, store.fs._strip_protocol(text))


def _not_empty(path: str, given: str) -> str:
    """path, refused where empty: an unset variable in a cron line (`dcpctl prune "$RUN"`)
    would otherwise name the working directory."""
    if not path:
        raise InvalidOptionError("names nothing: an empty path is not taken for the working "
                                 "directory (give `.` for that)", path=given or "''")
    return path


_SHORT_OF_SLASHES = re.compile(r"^(?P<protocol>[A-Za-z][A-Za-z0-9+.-]+):/?(?P<rest>(?!/).*)$")
# fsspec's names of object stores and remote file systems: a local name starting with one of
# these and a colon is a lost slash. (Not every fsspec protocol: `data:set` or `zip:x` are
# fine names for a local directory.)
_REMOTE_SCHEMES = frozenset({"s3", "s3a", "gs", "gcs", "az", "abfs", "abfss", "adl", "hf",
                             "oci", "oss", "hdfs", "webhdfs"})


def _refuse_a_url_short_of_slashes(text: str) -> None:
    """`s3:/bucket/x` or `s3:bucket/x` is a URL with a slash lost, not a local directory
    `s3:` to read or create, unless there is one."""
    match = _SHORT_OF_SLASHES.match(text)
    protocol = match.group("protocol").lower() if match else None
    if protocol not in _REMOTE_SCHEMES or os.path.lexists(text.split("/", 1)[0]):
        return
    raise InvalidOptionError(f"is no URL (its scheme wants two slashes) and no local path: "
                             f"give {protocol}://{match.group('rest')}", path=text)


def _settings_in_url(protocol: str, text: str) -> dict:
    """What fsspec's file system for protocol would take from the URL besides its path: a
    host, port, user, password (ftp, sftp), a version (s3's ?versionId)."""
    try:
        filesystem_class = importlib.import_module("fsspec").get_filesystem_class(protocol)
    except Exception:  # noqa: BLE001 - no such protocol, or its package absent: store_for says
        return {}
    try:
        return dict(filesystem_class._get_kwargs_from_urls(text) or {})
    except Exception:  # noqa: BLE001 - a host part it cannot read (a port past 65535)
        return {"host": None}


_LOCAL_PROTOCOLS = ("file", "local")


def is_remote(path: StoragePath) -> bool:
    """Whether path lies in an object store."""
    return isinstance(path, ObjectPath)


class RangedFile(Protocol):
    """A file or object read by byte range, from any thread."""

    def read(self, start: int, count: int) -> bytes:
        """Up to count bytes from start: fewer only where the file ends sooner."""

    def readinto(self, buffer, start: int) -> int:
        """Fill buffer with the bytes from start; the count read (short at the end)."""

    def iter_pieces(self, start: int, end: int, piece_bytes: int) -> Iterator[bytes]:
        """Bytes [start, end) in pieces of piece_bytes, front to back; stops early where the
        file ends."""

    def size(self) -> int:
        """The file's size in bytes."""

    def close(self) -> None:
        """Release what the reader holds."""


class LocalRangedFile:
    """A regular local file, read with pread."""

    def __init__(self, path: Path, follow_symlinks: bool = True) -> None:
        self.descriptor = open_regular_file(path, follow_symlinks)

    def read(self, start: int, count: int) -> bytes:
        return os.pread(self.descriptor, count, start)

    def readinto(self, buffer, start: int) -> int:
        return os.preadv(self.descriptor, [buffer], start)

    def iter_pieces(self, start: int, end: int, piece_bytes: int) -> Iterator[bytes]:
        while start < end:
            piece = os.pread(self.descriptor, min(piece_bytes, end - start), start)
            if not piece:
                return
            start += len(piece)
            yield piece

    def size(self) -> int:
        return os.fstat(self.descriptor).st_size

    def close(self) -> None:
        if self.descriptor >= 0:
            os.close(self.descriptor)
            self.descriptor = -1

    def __enter__(self) -> LocalRangedFile:
        return self

    def __exit__(self, *exception) -> None:
        self.close()


READ_AHEAD_PIECES = 4
"""Pieces of an object fetched ahead of the one being read, front to back..."""
READ_AHEAD_BYTES = 32 << 20
"""...as long as all the reads at once hold no more than this fetched ahead."""
_READ_AHEAD_POOL = DaemonThreadPool(32, "dcpctl-read-ahead")


class _Budget:
    """Bytes that may be held at once, taken without waiting: a read that finds the budget
    spent fetches its next piece when it needs it, so memory stays bounded whatever the number
    of threads reading, and no read ever waits on another."""

    def __init__(self, limit_bytes: int) -> None:
        self._left = limit_bytes
        self._lock = threading.Lock()

    def take(self, count: int) -> bool:
        with self._lock:
            if count > self._left:
                return False
            self._left -= count
            return True

    def give_back(self, count: int) -> None:
        with self._lock:
            self._left += count


_READ_AHEAD_BUDGET = _Budget(READ_AHEAD_BYTES)


class ObjectRangedFile:
    """An object, read with one ranged GET per read (held to the object first listed); read
    front to back, up to READ_AHEAD_PIECES more pieces are on their way while one is used
    (READ_AHEAD_BYTES among all reads), so the round trips overlap."""

    def __init__(self, path: ObjectPath) -> None:
        self.path = path

    def read(self, start: int, count: int) -> bytes:
        return self.path.store.read_range(self.path.key, start, start + count)

    def iter_pieces(self, start: int, end: int, piece_bytes: int) -> Iterator[bytes]:
        coming: collections.deque = collections.deque()  # (wanted, future, budgeted bytes)
        next_start = start
        try:
            while True:
                while next_start < end and len(coming) <= READ_AHEAD_PIECES:
                    wanted = min(piece_bytes, end - next_start)
                    budgeted = wanted if coming else 0  # the piece needed now is not ahead
                    if budgeted and not _READ_AHEAD_BUDGET.take(budgeted):
                        break
                    future = _READ_AHEAD_POOL.submit(self.read, next_start, wanted)
                    coming.append((wanted, future, budgeted))
                    next_start += wanted
                if not coming:
                    return
                wanted, future, budgeted = coming.popleft()
                try:
                    piece = future.result()
                finally:
                    _READ_AHEAD_BUDGET.give_back(budgeted)
                if piece:
                    yield piece
                if len(piece) < wanted:
                    return  # the object ends here
        finally:
            for _, future, budgeted in coming:
                future.cancel()
                _READ_AHEAD_BUDGET.give_back(budgeted)

    def size(self) -> int:
        info = self.path.store.info(self.path.key)
        if info is None:
            raise FileNotFoundError(2, "No such file or directory", str(self.path))
        return info.size

    def readinto(self, buffer, start: int) -> int:
        view = memoryview(buffer).cast("B")
        data = self.read(start, len(view))
        view[:len(data)] = data
        return len(data)

    def close(self) -> None:
        pass

    def __enter__(self) -> ObjectRangedFile:
        return self

    def __exit__(self, *exception) -> None:
        pass


def open_ranged(path: StoragePath, follow_symlinks: bool = True
                ) -> LocalRangedFile | ObjectRangedFile:
    """A reader of the file's byte ranges; a local path that is missing, or not a regular
    file (without follow_symlinks: or a symlink), fails here, an object at its first read."""
    if isinstance(path, ObjectPath):
        return ObjectRangedFile(path)
    return LocalRangedFile(path, follow_symlinks)


def read_whole(path: StoragePath) -> bytes:
    """The whole of a regular file or an object."""
    if isinstance(path, ObjectPath):
        return path.read_bytes()
    return read_file(path)


def write_whole(path: StoragePath, data: bytes, made_stale: StoragePath | None = None,
                only_if_absent: bool = False, only_if_unchanged: bool = False) -> str:
    """Write a small file whole, atomically: a reader sees the old file or the whole new one
    (a local file through a synced temporary renamed over it; an object with one PUT).
    made_stale, a file the new one makes wrong, is removed just before. In an object store
    that can promise it the PUT is conditional: only_if_absent, on no object having the name
    (else FileExistsError); only_if_unchanged, on the object being the one dcpctl first saw
    there (else ObjectChangedError). Returns the hex SHA-256 of data."""
    if isinstance(path, ObjectPath):
        store = path.store
        seen_etag = store.remembered_etag(path.key) if only_if_unchanged else None
        failpoint(Failpoint.BEFORE_ATOMIC_RENAME)
        stale_bytes = _take_away(made_stale) if made_stale is not None else None
        try:
            store.put(path.key, data, if_absent=only_if_absent, if_etag=seen_etag)
        except Exception as error:
            # A reply lost after the store wrote it (a dropped connection): the client sends
            # the write again, which a conditional write then fails. What holds the name now
            # says whether this write happened; where the store will not say, neither may be
            # assumed.
            landed = store.holds_exactly(path.key, data)
            if landed is None:
                raise WriteOutcomeUnknownError(
                    f"the write failed ({type(error).__name__}), and the store would not say "
                    "whether it happened all the same", path=store.url(path.key)) from None
            if not landed:
                if stale_bytes is not None:
                    _put_back_unless_replaced(made_stale, stale_bytes, path, only_if_absent,
                                              seen_etag)
                raise
        except BaseException:
            if stale_bytes is not None:
                _put_back_unless_replaced(made_stale, stale_bytes, path, only_if_absent,
                                          seen_etag)
            raise
        return hashlib.sha256(data).hexdigest()
    return write_file_atomically(path, data, made_stale)


def _take_away(path: ObjectPath) -> bytes | None:
    """Delete an object, returning what it held (None where there was none)."""
    if path.store.info(path.key) is None:
        return None
    data = path.read_bytes()
    path.unlink(missing_ok=True)
    return data


def _put_back_unless_replaced(stale: ObjectPath, stale_bytes: bytes, path: ObjectPath,
                              only_if_absent: bool, seen_etag: str | None) -> None:
    """After a conditional write of path that failed: put back the object taken away for it,
    where path is known to be as it was (a write that may have landed, or a path someone else
    changed, leaves the stale object gone). Errors of this last try are not the ones to
    report."""
    if not only_if_absent and seen_etag is None:
        return
    try:
        now = path.store.info_now(path.key)
        if (now is None) if only_if_absent else (now is not None and now.etag == seen_etag):
            path.store.put(stale.key, stale_bytes, if_absent=True)
    except Exception:  # noqa: BLE001 - the failed write is the error to report
        pass


def file_names_in(directory: StoragePath) -> set[str]:
    """The names of the files under a directory, by their paths below it (`a/b.distcp`):
    locally every entry that is not a directory, in its subdirectories too (links are listed,
    not followed); in an object store, every object under the prefix."""
    if isinstance(directory, ObjectPath):
        return set(directory.store.list_tree(directory.key))
    names, pending = set(), [""]
    while pending:
        below = pending.pop()
        with os.scandir(os.path.join(directory, below)) as entries:
            for entry in entries:
                name = f"{below}/{entry.name}" if below else entry.name
                if entry.is_dir(follow_symlinks=False):
                    pending.append(name)
                else:
                    names.add(name)
    return names


def missing_files(directory: StoragePath, names: Iterable[str]) -> list[str]:
    """Those of names (files below directory) that are not there, sorted."""
    return sorted(set(names) - file_names_in(directory))


def remove_stale_temporaries(directory: StoragePath, keep: set[str]) -> list[str]:
    """Delete the temporary files an earlier killed run left under directory, but those in
    keep, and the files that a kept temporary file stands in for (the old data file a killed
    in-place rewrite had switched away from but not yet deleted); returns their names. The
    caller holds the checkpoint exclusively (storage/locks.py), so no other run's are there.
    An object store has no locks: another run's live temporaries look the same there, so only
    what nothing wrote to for STALE_OBJECT_SECONDS goes, unfinished uploads too (S3 keeps, and
    bills, their parts until they are aborted)."""
    replaced = names_stood_in_for(keep) - keep
    aborted = []
    if isinstance(directory, ObjectPath):
        oldest_live = time.time() - STALE_OBJECT_SECONDS
        names = {name for name, info in directory.store.list_tree(directory.key).items()
                 if name in replaced or (info.modified and info.modified < oldest_live)}
        aborted = [f"{name} (an unfinished upload)" for name in abort_stale_uploads(
            directory, lambda name: is_temporary_name(posixpath.basename(name)))]
    else:
        names = file_names_in(directory)
    removed = sorted(name for name in names if name not in keep and (
        is_temporary_name(posixpath.basename(name)) or name in replaced))
    for name in removed:
        (directory / name).unlink(missing_ok=True)
    return removed + aborted


def abort_stale_uploads(directory: ObjectPath,
                        wanted: Callable[[str], bool] = lambda name: True) -> list[str]:
    """Abort the uploads under directory that nothing added to for STALE_OBJECT_SECONDS (a
    killed run's: S3 keeps, and bills, their parts until then), those whose names are
    wanted; their names."""
    return directory.store.abort_uploads(directory.key, wanted,
                                         written_before=time.time() - STALE_OBJECT_SECONDS)


STALE_OBJECT_SECONDS = 24 * 3600
"""How long a temporary object must have been left alone before a run takes it for a killed
run's (remove_stale_temporaries)."""


class ObjectOutputFile:
    """A new object being written (see OutputFile, its local twin): uploaded in parts as it
    grows, there only once finish() completes it, and, as OutputFile creates its file
    exclusively, only where no object has its name by then: a run whose output another run
    took over (--overwrite) never writes over that run's objects. replacing: a file output
    that --overwrite replaces whole, which may stand there. claim: the claim of the directory
    output the object is part of, checked before the object is started and before it is
    completed, so that a run taken over puts nothing more among the other run's files; the run
    that took the output over deletes an object of the run taken over that took its name
    meanwhile (OutputClaim.clear_name), and completes its own."""

    def __init__(self, path: ObjectPath, replacing: bool = False,
                 claim: OutputClaim | None = None) -> None:
        self.path = path
        self.claim = claim
        if claim is not None:
            claim.check()
        with _another_runs_object_refused(path):
            self._writer = path.store.open_writer(path.key, if_absent=not replacing)
        self._size = 0

    def write(self, data) -> None:
        """Append data."""
        self._writer.write(data)
        self._size += len(data)

    def tell(self) -> int:
        """Bytes written so far."""
        return self._size

    def finish(self) -> None:
        """Complete the object."""
        for attempt in range(_NAME_CLEARINGS + 1):
            if self.claim is not None:
                self.claim.check()
            try:
                self._writer.finish()
                break
            except FileExistsError:
                if (attempt == _NAME_CLEARINGS or self.claim is None
                        or not self.claim.clear_name(self.path)):
                    raise _another_runs_object_error(self.path) from None
        failpoint(Failpoint.AFTER_DATA_FILE)

    def discard(self) -> None:
        """Abandon the object; nothing of it appears."""
        self._writer.discard()

    def __enter__(self) -> ObjectOutputFile:
        return self

    def __exit__(self, *exception) -> None:
        if exception[0] is not None:
            self.discard()


_NAME_CLEARINGS = 3
"""How many times a run that took an output over deletes an object of the run taken over that
took the name of the one it completes, and completes it again (each time still holding the
claim), before it gives up."""


@contextlib.contextmanager
def _another_runs_object_refused(path: ObjectPath) -> Iterator[None]:
    try:
        yield
    except FileExistsError:
        raise _another_runs_object_error(path) from None


def _another_runs_object_error(path: ObjectPath) -> OutputTakenError:
    return OutputTakenError("another run wrote an object of this name while this run wrote "
                            "its output (one with --overwrite?): nothing was published",
                            path=path)


def new_output_file(path: StoragePath, claim: OutputClaim | None = None
                    ) -> OutputFile | ObjectOutputFile:
    """A new file to write: locally created exclusively (OutputFile), in an object store an
    object upload (claim: its output's, see ObjectOutputFile)."""
    if isinstance(path, ObjectPath):
        return ObjectOutputFile(path, claim=claim)
    return OutputFile(path)


REMOTE_THREADS = 8
"""Threads reading and writing a checkpoint in an object store by default: each waits on the
network much of the time, so more of them than cores keep the transfers full (large objects are
also read ahead, and uploaded several parts at once, whatever the thread count). Each holds a
few pieces: more threads cost memory, not only cores."""


def default_threads_for(path: StoragePath) -> int:
    """Threads for a command on path when --threads is not given: a thread per core locally,
    at least REMOTE_THREADS for an object store."""
    cores = default_thread_count()
    return max(cores, REMOTE_THREADS) if isinstance(path, ObjectPath) else cores

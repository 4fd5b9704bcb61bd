"""Checkpoints in object stores: `s3://`, `gs://`, `az://`, `memory://`, any fsspec protocol
with ranged reads.

An `ObjectPath` names an object or a prefix (a "directory") the way a `pathlib.Path` names a
local file, with the part of pathlib's API dcpctl calls on both (`/`, `name`, `parent`,
`exists`, `is_dir`, `is_file`, `stat`, `iterdir`, `read_bytes`, `unlink`), so code that walks a
checkpoint reads the same for both. What pathlib lacks, an `ObjectStore` adds: one listing of
everything under a prefix, ranged reads, writes in pieces, conditional creates and replaces
(promised by S3, checked just before elsewhere) and batch delete. S3 gets its own store
(s3.py); any other protocol goes through fsspec's generic calls.
"""

from __future__ import annotations

import contextlib
import datetime
import io
import posixpath
import stat
import threading
import time
from dataclasses import dataclass
from typing import Callable, Iterator, Mapping

from dcpctl.errors import TRY_AGAIN_EXIT_CODE, DcpctlError, name_and_message


class StorageError(DcpctlError):
    """The object store refused or failed a request: no credentials, no such bucket, access
    denied, a connection that kept failing after retries, an object changed while read."""


class ObjectChangedError(StorageError):
    """An object was replaced while dcpctl read it (its ETag changed), or before a write
    that was to replace it only as first read."""

    exit_code = TRY_AGAIN_EXIT_CODE


class WriteOutcomeUnknownError(StorageError):
    """A write failed, and the store would not say whether it happened all the same (its
    reply lost, then every read refused)."""


@dataclass(frozen=True)
class ObjectInfo:
    """What a listing says of one object."""

    size: int
    etag: str | None = None
    modified: float = 0.0
    """When it was last written, in seconds since the epoch (0 where the store does not say)."""


@dataclass(frozen=True)
class ObjectStat:
    """The part of os.stat_result that dcpctl reads, for an object."""

    st_size: int
    st_mode: int = stat.S_IFREG | 0o644


class ObjectStore:
    """One fsspec file system, with the operations dcpctl needs expressed on keys (paths
    without the protocol, as fsspec takes them)."""

    def __init__(self, protocol: str, filesystem) -> None:
        self.protocol = protocol
        self.fs = filesystem
        self._seen: dict[str, ObjectInfo] = {}  # by key: each object as first listed or read
        self._seen_lock = threading.Lock()
        self._written_etags: dict[str, str] = {}  # by key: the ETag of this run's own write

    def url(self, key: str) -> str:
        """The URL a user would write for key."""
        return f"{self.protocol}://{key.lstrip('/')}"

    # listing

    def list_tree(self, prefix: str, pin_current: bool = False) -> dict[str, ObjectInfo]:
        """Every object under prefix (one paginated listing), by key relative to it, as listed
        now. Reads and replaces of an object are held to the object first seen under its key
        (another job's object put there since is refused, not taken): a listing pins only the
        objects not seen before, or, with pin_current, every object it lists (a new load)."""
        base = prefix.rstrip("/") + "/"
        with self.translated_errors(prefix):
            found = self.fs.find(prefix, detail=True, withdirs=False)
        tree = {}
        for key, details in found.items():
            relative = key[len(base):] if key.startswith(base) else ""
            if relative and not relative.endswith("/"):  # not a folder marker (`sub/`)
                info = tree[relative] = _info_of(details)
                self._remember(base + relative, info, replace=pin_current)
        return tree

    def folder_markers(self, prefix: str) -> list[str]:
        """The keys of the empty folder markers under prefix (`sub/`, and `prefix/` itself),
        which S3 consoles and some tools put for folders: no listing of list_tree's shows
        them, and they hold nothing."""
        base = prefix.rstrip("/") + "/"
        with self.translated_errors(prefix):
            found = self.fs.find(prefix, detail=True, withdirs=False)
        return sorted(key for key, details in found.items()
                      if key.startswith(base) and key.endswith("/") and not details.get("size"))

    def list_children(self, prefix: str) -> dict[str, bool]:
        """The names directly under prefix, each with whether it is a prefix (a directory)."""
        with self.translated_errors(prefix):
            try:
                entries = self.fs.ls(prefix, detail=True, refresh=True)
            except FileNotFoundError:
                return {}
        base = prefix.rstrip("/")
        children = {}
        for entry in entries:
            name = posixpath.basename(entry["name"].rstrip("/"))
            if entry["name"].rstrip("/") != base and name:
                children[name] = entry.get("type") == "directory"
        return children

    def info(self, key: str) -> ObjectInfo | None:
        """The object's size and ETag (as first seen: reads are held to that object); None
        where no object has that key."""
        with self._seen_lock:
            seen = self._seen.get(key)
        if seen is not None:
            return seen
        with self.translated_errors(key):
            try:
                details = self.fs.info(key)
            except FileNotFoundError:
                return None
        if details.get("type") == "directory":
            return None
        info = _info_of(details)
        self._remember(key, info)
        return info

    def info_now(self, key: str) -> ObjectInfo | None:
        """info(key) as the store says now, not as first seen (dcpctl's own write or another
        job's may have replaced it); reads are held to this answer from then on."""
        self.forget(key)
        self.fs.invalidate_cache(key)  # asked of the store, not of fsspec's listings
        return self.info(key)

    def holds_exactly(self, key: str, data: bytes) -> bool | None:
        """Whether the object under key, asked now, holds data (a write of it that failed to
        say so did land); None where the store will not say."""
        try:
            now = self.info_now(key)
            return (now is not None and now.size == len(data)
                    and self.read_range(key, 0, len(data)) == data)
        except Exception:  # noqa: BLE001 - the failed write is the error to report
            return None

    def is_prefix(self, key: str) -> bool:
        """Whether some object lies under key/."""
        with self.translated_errors(key):
            return bool(self.fs.isdir(key))

    # reading

    def read_range(self, key: str, start: int, end: int) -> bytes:
        """Bytes [start, end) of the object (fewer where it ends sooner)."""
        if end <= start:
            return b""
        with self.translated_errors(key):
            return self.fs.cat_file(key, start=start, end=end)

    # writing

    def open_writer(self, key: str, if_absent: bool = False) -> ObjectWriter:
        """A new object being written in pieces; it appears only once finished, and with
        if_absent only where no object has its name (else FileExistsError)."""
        return FileObjectWriter(self, key, if_absent)

    def put(self, key: str, data: bytes, if_absent: bool = False,
            if_etag: str | None = None) -> None:
        """Write a whole object, only if none has its name (if_absent: else FileExistsError),
        or only if it is still the object with ETag if_etag (else ObjectChangedError). Here
        the condition is checked just before the write; a store that can promise it (S3)
        also makes the write itself conditional."""
        with self.translated_errors(key):
            self.refuse_unmet_condition(key, if_absent, if_etag)
            self.fs.pipe_file(key, bytes(data))
        self.note_written(key)

    def refuse_unmet_condition(self, key: str, if_absent: bool, if_etag: str | None) -> None:
        """Raise FileExistsError (if_absent) or ObjectChangedError (if_etag) where the object
        under key, asked now, does not meet a write's condition."""
        self.fs.invalidate_cache(key)  # asked of the store, not of fsspec's listings
        if if_absent and self.fs.exists(key):
            raise FileExistsError(17, "exists", self.url(key))
        if if_etag is not None:
            try:
                etag = _info_of(self.fs.info(key)).etag
            except FileNotFoundError:
                etag = None
            if etag != if_etag:
                raise ObjectChangedError("the object changed while dcpctl read or replaced it "
                                         "(its ETag is not the one first seen); nothing was "
                                         "published", path=self.url(key))

    def abort_uploads(self, prefix: str, wanted: Callable[[str], bool] = lambda name: True,
                      written_before: float | None = None) -> list[str]:
        """Abort the unfinished uploads under prefix/ (as a killed process leaves them) whose
        name relative to prefix is wanted, and, given written_before (seconds since the epoch),
        that nothing added to since; their names. Only S3 has them: here, none."""
        return []

    def unfinished_uploads(self, prefix: str) -> dict[str, float | None]:
        """The unfinished uploads under prefix/ (objects being written, in no listing yet), by
        name relative to prefix: when each was started or last given a part (seconds since the
        epoch), or None where the store does not say. Only S3 has them: here, none."""
        return {}

    def abort_open_uploads(self, prefix: str) -> None:
        """Abort the uploads this process started under prefix (or of the object prefix names;
        every one for "") that were neither completed nor aborted: a writer still held by a
        thread a stop did not wait for (pipeline.STOP_SECONDS). Only S3 has them: here, none."""

    def delete(self, keys: list[str], if_etags: Mapping[str, str | None] | None = None) -> None:
        """Delete the objects of exactly these keys (fsspec's `rm` would take a key holding
        `*`, `?` or `[` for a pattern, and delete what it matches), in batches where the store
        has them; missing ones are no error. if_etags gives the ETag a key's object must still
        have, where a store can promise it (S3); elsewhere the caller checks just before.
        Raises StorageError naming an object the store did not delete."""
        for key in keys:
            self.note_written(key)
            with self.translated_errors(key):
                try:
                    self.fs.rm_file(key)
                except FileNotFoundError:
                    pass

    # errors and changes

    def remembered_etag(self, key: str) -> str | None:
        """The ETag of the object when first listed or read, for reads that must find the same
        object."""
        with self._seen_lock:
            seen = self._seen.get(key)
        return None if seen is None else seen.etag

    def _remember(self, key: str, info: ObjectInfo, replace: bool = False) -> None:
        with self._seen_lock:
            if replace:
                self._seen[key] = info
            else:
                self._seen.setdefault(key, info)

    def forget(self, key: str) -> None:
        """Forget what was seen of key (dcpctl wrote or deleted it)."""
        with self._seen_lock:
            self._seen.pop(key, None)

    def note_written(self, key: str, etag: str | None = None) -> None:
        """This run wrote (or deleted) the object of key: what was seen of it is forgotten,
        and the ETag the store gave the write is kept, where it gave one."""
        self.forget(key)
        with self._seen_lock:
            if etag:
                self._written_etags[key] = str(etag).strip('"')
            else:
                self._written_etags.pop(key, None)

    def etags_written(self) -> dict[str, str]:
        """The ETag the store gave this run's last write of each key it gave one (what a worker
        process hands its coordinator: staging checks them)."""
        with self._seen_lock:
            return dict(self._written_etags)

    def etag_written(self, key: str) -> str | None:
        """The ETag the store gave this run's last write of key; None where it gave none, or
        this run did not write it."""
        with self._seen_lock:
            return self._written_etags.get(key)

    def translated_errors(self, key: str):
        """A context that turns what the store's client raises into dcpctl's errors."""
        return _TranslatedErrors(self, key)

    def why_absent(self, key: str) -> str:
        """Why there is nothing at key, as an error line says it (asked once it was not found:
        this may ask the store)."""
        return "No such file or directory"

    def describe(self, error: Exception) -> tuple[type[StorageError], str] | None:
        """The kind of StorageError and its one-line reason for an error the client raised;
        None for one left as it is."""
        return None


class _TranslatedErrors:
    def __init__(self, store: ObjectStore, key: str) -> None:
        self.store = store
        self.key = key

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind, error, traceback) -> bool:
        if error is None or isinstance(error, (DcpctlError, KeyboardInterrupt, SystemExit)):
            return False
        url = self.store.url(self.key)
        if isinstance(error, FileNotFoundError):
            if error.filename != url:
                raise FileNotFoundError(2, self.store.why_absent(self.key), url) from None
            return False
        if isinstance(error, FileExistsError):
            raise FileExistsError(17, "exists", url) from None
        described = self.store.describe(error)
        if described is None and isinstance(error, PermissionError):
            described = StorageError, "access denied"
        if described is None and isinstance(error, TimeoutError):
            described = StorageError, (f"the store did not answer in time "
                                       f"({name_and_message(error)})")
        if described is None and (isinstance(error, (OSError, ConnectionError))
                                  or _raised_by_a_client_library(error)):
            described = StorageError, name_and_message(error)
        if described is None:
            return False
        kind, reason = described
        raise kind(reason, path=url) from None


def _raised_by_a_client_library(error: Exception) -> bool:
    """Whether error is a class of the store's client library (httpx's ConnectError under
    hf://, say), not Python's own (a TypeError, a KeyError: a bug, reported as one)."""
    module = type(error).__module__
    return module != "builtins" and module.partition(".")[0] != "dcpctl"


class ObjectWriter:
    """An object written in pieces; published only by finish(), where it was opened with
    if_absent only if no object has its name (else FileExistsError)."""

    def write(self, data) -> None:
        raise NotImplementedError

    def finish(self) -> None:
        """Publish the object."""
        raise NotImplementedError

    def discard(self) -> None:
        raise NotImplementedError


class FileObjectWriter(ObjectWriter):
    """Through fsspec's file objects, which upload in blocks as they fill. Some stores write
    the object in place as it grows, so with if_absent the name is asked for before anything
    is written (a store without conditional writes leaves a racing writer that moment)."""

    def __init__(self, store: ObjectStore, key: str, if_absent: bool) -> None:
        self.store = store
        self.key = key
        self._if_absent = if_absent
        with store.translated_errors(key):
            store.refuse_unmet_condition(key, if_absent, None)
            self._file = store.fs.open(key, "wb")

    def write(self, data) -> None:
        with self.store.translated_errors(self.key):
            self._file.write(data)

    def finish(self) -> None:
        with self.store.translated_errors(self.key):
            self._file.close()
        self.store.note_written(self.key)

    def discard(self) -> None:
        """Drop the object. An fsspec buffered file (gcsfs's, adlfs's) publishes nothing
        before it is closed, but closes itself when collected, and closing uploads and commits
        what it holds (at the interpreter's exit, where fsspec's event loop is gone, that waits
        forever): so the store's own cancel runs where the file class has one (an upload begun
        is aborted), and the file is marked closed with nothing flushed. Its key is left as it
        is: it may hold the object this one was to replace, or another run's that took the
        output over meanwhile. Other files (memory://, a local file system's) write where they
        are as they grow: they are closed, and a new object's key (opened if_absent: no object
        had it) is deleted. A store that stopped answering is given DISCARD_SECONDS for each
        step: the command is failing already, and a leftover temporary object is removed by a
        later run."""
        from fsspec.spec import AbstractBufferedFile

        file = self._file
        if isinstance(file, AbstractBufferedFile):
            if type(file).discard is not AbstractBufferedFile.discard:  # fsspec's does nothing
                run_within(DISCARD_SECONDS, file.discard)
            file.buffer = io.BytesIO()
            file.closed = True
            return
        run_within(DISCARD_SECONDS, file.close)
        if self._if_absent:
            run_within(DISCARD_SECONDS, lambda: self.store.delete([self.key]))


DISCARD_SECONDS = 20
"""How long each step of dropping an object being written may wait on the store."""


def run_within(seconds: float, call: Callable[[], object]) -> None:
    """Run call, giving up on it after seconds (it goes on in a daemon thread, which the
    process's exit does not wait for): cleaning up after a failure, against a store that may
    have stopped answering. Its own failure is dropped: the failure being handled is the one
    to report."""
    def run() -> None:
        try:
            call()
        except Exception:  # noqa: BLE001 - see the docstring
            pass

    worker = threading.Thread(target=run, name="dcpctl-discard", daemon=True)
    worker.start()
    worker.join(seconds)


class ObjectPath:
    """An object or prefix in an object store, named like a pathlib.Path (see module
    docstring). Two paths are equal when they name the same key in the same store."""

    __slots__ = ("store", "key")

    def __init__(self, store: ObjectStore, key: str) -> None:
        self.store = store
        self.key = key.rstrip("/") if key not in ("/", "") else key

    def __str__(self) -> str:
        return self.store.url(self.key)

    def __repr__(self) -> str:
        return f"ObjectPath({str(self)!r})"

    def __eq__(self, other) -> bool:
        return (isinstance(other, ObjectPath) and other.store is self.store
                and other.key == self.key)

    def __hash__(self) -> int:
        return hash((id(self.store), self.key))

    def __truediv__(self, name: str) -> ObjectPath:
        """The key of name below this one. A key is a string, not a path: a name that starts
        with `/` (listed under a key holding `//`) lies below it too, never at the root of the
        store or in another bucket, as posixpath.join would have it."""
        name = str(name)
        if self.key in ("", "/"):  # a store's root (memory://)
            return ObjectPath(self.store, posixpath.join(self.key, name))
        return ObjectPath(self.store, f"{self.key}/{name}" if name else self.key)

    @property
    def name(self) -> str:
        return posixpath.basename(self.key)

    @property
    def suffix(self) -> str:
        return posixpath.splitext(self.name)[1]

    @property
    def parent(self) -> ObjectPath:
        return ObjectPath(self.store, posixpath.dirname(self.key))

    def exists(self) -> bool:
        return self.store.info(self.key) is not None or self.store.is_prefix(self.key)

    def is_dir(self) -> bool:
        return self.store.is_prefix(self.key)

    def is_file(self) -> bool:
        return self.store.info(self.key) is not None

    def stat(self) -> ObjectStat:
        info = self.store.info(self.key)
        if info is None:
            raise FileNotFoundError(2, "No such file or directory", str(self))
        return ObjectStat(info.size)

    def iterdir(self) -> Iterator[ObjectPath]:
        for name in sorted(self.store.list_children(self.key)):
            yield self / name

    def read_bytes(self) -> bytes:
        info = self.store.info(self.key)
        if info is None:
            raise FileNotFoundError(2, "No such file or directory", str(self))
        return self.store.read_range(self.key, 0, info.size) if info.size else b""

    def unlink(self, missing_ok: bool = False) -> None:
        if not missing_ok and self.store.info(self.key) is None:
            raise FileNotFoundError(2, "No such file or directory", str(self))
        self.store.delete([self.key])


def _info_of(details: dict) -> ObjectInfo:
    """What fsspec's details of an object say, whatever the protocol calls its fields."""
    etag = details.get("ETag") or details.get("etag")
    return ObjectInfo(int(details.get("size") or 0), None if etag is None else str(etag).strip('"'),
                      _modified_of(details))


_MODIFIED_FIELDS = ("LastModified", "mtime", "modified", "last_modified", "modify", "created")
"""What fsspec's file systems call an object's last write: s3fs, local and sftp, webdav4,
gcsfs and adlfs, ftp (`YYYYMMDDHHMMSS`), memory (its creation)."""
_CLOCK_SKEW_SECONDS = 86400


def _modified_of(details: dict) -> float:
    """When the object was last written, in seconds since the epoch; 0 where no field says
    so in a form read here, or says a time past tomorrow (a number in another unit)."""
    latest = time.time() + _CLOCK_SKEW_SECONDS
    for name in _MODIFIED_FIELDS:
        value = details.get(name)
        for seconds in _times_in(value):
            if 0 < seconds <= latest:
                return seconds
    return 0.0


def _times_in(value) -> Iterator[float]:
    """The readings of value as seconds since the epoch, likeliest first."""
    if isinstance(value, datetime.datetime):
        yield (value if value.tzinfo else value.replace(tzinfo=datetime.timezone.utc)
               ).timestamp()
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        yield float(value)
    elif isinstance(value, str):
        with contextlib.suppress(ValueError):
            yield float(value)
        for parse in (datetime.datetime.fromisoformat,
                      lambda text: datetime.datetime.strptime(text, "%Y%m%d%H%M%S")):
            with contextlib.suppress(ValueError):
                yield from _times_in(parse(value.strip()))

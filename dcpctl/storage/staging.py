"""A new output file or directory, written so that a killed run never leaves a half output
under the real name: locally under a hidden temporary sibling name renamed into place at the
end; in an object store straight under the destination prefix, whose `.metadata` (written last)
is what makes it a checkpoint, and an object only appears once its upload completes."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import stat
from pathlib import Path
from typing import Collection, Iterable, Mapping, Sequence

from dcpctl.errors import OutputError, OutputTakenError, describe_os_error
from dcpctl.failpoints import Failpoint, failpoint
from dcpctl.format.file_names import METADATA_FILE_NAME, METADATA_TEMPORARY_FILE_NAME
from dcpctl.stopping import finishing_first
from dcpctl.storage.local import (SCRATCH_INFIX, empty_directory, exchange, final_name_of,
                                  fsync_directory, is_temporary_name, new_token,
                                  open_directory_at, remove_directory, staging_directory_name,
                                  temporary_name)
from dcpctl.storage.locks import lock_descriptor, locked_checkpoint
from dcpctl.storage.claims import OutputClaim
from dcpctl.storage.objects import ObjectInfo, ObjectPath, StorageError
from dcpctl.storage.paths import StoragePath, abort_stale_uploads


class StagedOutput:
    """Where an output is written (`path`) before `publish` renames it to `destination`. A
    destination that is, holds or lies inside the source is refused; an existing one is
    refused unless overwrite (an empty directory is always taken).

    It is written in a hidden staging directory beside the destination (the output itself, or
    the directory the output file is written in), locked (flock) until the run ends: a run
    killed outright leaves it behind unlocked, and the next run for the same destination
    removes it (remove_dead_stagings), while a live run's stays."""

    claim = None
    """No other run writes into the staging directory: nothing to claim (see OutputClaim)."""

    def __init__(self, destination: Path, overwrite: bool, source: Path,
                 is_directory: bool = True) -> None:
        if destination.name in ("", ".", ".."):  # `-o .`, `-o run/..`: the directory it means
            destination = Path(os.path.realpath(destination))
        refuse_overlap(source, destination)
        check_destination(destination, overwrite, is_directory)
        if overwrite:
            with locked_checkpoint(destination, exclusive=True):  # held by another dcpctl?
                pass  # fails at once; publish() takes the lock again to replace it
        self.destination = destination
        self.overwrite = overwrite
        self.is_directory = is_directory
        self.token = new_token()
        self._made_parents = _missing_directories(destination.parent)
        destination.parent.mkdir(parents=True, exist_ok=True)
        self.removed_stagings = remove_dead_stagings(destination)
        self._staging = destination.parent / staging_directory_name(destination.name, self.token)
        try:
            self._staging.mkdir()
        except OSError as error:  # named as the output the user gave, not its staging name
            raise OSError(error.errno, error.strerror, str(destination)) from None
        self._lock: int | None = os.open(self._staging,
                                         os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        # where flock is not supported nothing tells a dead run's apart: none is removed
        lock_descriptor(self._lock, exclusive=True, path=self._staging,
                        what="another dcpctl holds this run's own staging directory")
        self.path = self._staging if is_directory else self._staging / destination.name

    def confirm(self, names: Iterable[str] = (), sizes: Mapping[str, int] | None = None
                ) -> None:
        """Before the output's last file is written: check that every one of names (the files
        written for it, by every process) is in the staging directory, of the size sizes gives
        it where it does; raises OutputError, nothing published, where one is not. No other
        run writes there, but a torchrun rank on another machine writes into its own where
        the path lies on no file system they share."""
        sizes = sizes or {}
        for name in sorted({*names, *sizes}):
            try:
                size = os.lstat(self.path / name).st_size
            except FileNotFoundError:
                size = None
            if size is None or (name in sizes and size != sizes[name]):
                found = "is not there" if size is None else f"holds {size} bytes, not {sizes[name]}"
                raise OutputError(f"{name}, written for this output, {found} (ranks on machines "
                                  "that do not share this file system?): nothing was published",
                                  path=self.destination)

    def confirm_published(self, names: Iterable[str], sizes: Mapping[str, int], last_file: str,
                          last_bytes: bytes) -> None:
        """Nothing to check here either (see ObjectStoreOutput.confirm_published)."""

    def publish(self) -> None:
        """Rename the finished output into place: replacing what is there with overwrite;
        without, only an empty directory, so that what someone put there while this ran (or
        another run published) is never deleted: that is refused (OutputError)."""
        if self.is_directory:
            fsync_directory(self.path)
        failpoint(Failpoint.BEFORE_PUBLISH)
        # never stopped between moving the old output aside and in
        with finishing_first(finished="the output is published whole"):
            if not self.overwrite:
                self._publish_without_replacing()
            elif self.is_directory and self.destination.exists():
                # as an in-place rewrite would: never under another dcpctl reading or
                # changing it, which works on through its path
                with locked_checkpoint(self.destination, exclusive=True):
                    self._replace_destination()
            else:
                with locked_checkpoint(self.destination, exclusive=True):
                    os.replace(self.path, self.destination)
            if not self.is_directory:
                os.rmdir(self._staging)
            fsync_directory(self.destination.parent)
        self._unlock()

    def _replace_destination(self) -> None:
        """Put the staged directory in the destination's place, and delete the old one, held
        by the caller: in one step where the system can (the old one then lies under the
        staging name), else moved aside first, under a staging name of its own (a run killed
        between the two renames leaves no destination). Either way a run killed before the
        old one is gone leaves it under a staging name, unlocked: the next run for this
        destination removes it (remove_dead_stagings)."""
        if not stat.S_ISDIR(os.lstat(self.destination).st_mode):  # a file or link came
            raise OutputError("is no longer a directory (it was replaced while this run "
                              "wrote): nothing was replaced", path=self.destination)
        if exchange(self.path, self.destination):
            self._remove_replaced(self.path)
            return
        aside = self.destination.parent / temporary_name(f".{self.destination.name}",
                                                         new_token())
        os.replace(self.destination, aside)
        os.replace(self.path, self.destination)
        self._remove_replaced(aside)

    def _remove_replaced(self, old_output: Path) -> None:
        """Delete the output the new one replaced, now under a staging name; where that fails,
        say so (the new output is in place, and the next run for it removes the old)."""
        try:
            remove_directory(old_output)
        except OSError as error:
            raise OutputError(f"holds the new output, but removing the one it replaced, moved "
                              f"to {old_output.name}, failed ({describe_os_error(error)}); the "
                              "next run for this output removes it", path=self.destination
                              ) from None

    def _publish_without_replacing(self) -> None:
        # rename(2) takes the place of an empty directory only, in one step; a file's place is
        # taken by a hard link, which fails where a file is (a filesystem without hard links
        # gets a look first, and a moment's race).
        try:
            if self.is_directory:
                os.rename(self.path, self.destination)
                return
            try:
                os.link(self.path, self.destination)
            except OSError as error:
                if error.errno not in (errno.EPERM, errno.ENOTSUP, errno.EXDEV):
                    raise
                if os.path.lexists(self.destination):
                    raise FileExistsError(errno.EEXIST, "exists", self.destination) from None
                os.rename(self.path, self.destination)
                return
            os.unlink(self.path)
        except OSError as error:
            if error.errno not in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOTDIR, errno.EISDIR):
                raise
            raise OutputTakenError("was filled while dcpctl wrote the output (it was empty or "
                                   "absent when the run started): nothing was replaced; run "
                                   "again with --overwrite to replace it",
                                   path=self.destination) from None

    def abort(self, upload_names: Collection[str] = ()) -> None:
        """Remove the unfinished output, and the directories made for it where nothing else
        came to be in them; the destination stays as it was. (Files are never left half
        uploaded here: upload_names is for ObjectStoreOutput.abort.)"""
        with contextlib.suppress(OSError):
            remove_directory(self._staging)
        self._unlock()
        for directory in self._made_parents:  # the deepest first
            try:
                directory.rmdir()
            except OSError:
                break

    def _unlock(self) -> None:
        if self._lock is not None:
            lock, self._lock = self._lock, None
            os.close(lock)


def _missing_directories(directory: Path) -> list[Path]:
    """directory and those of its parents that do not exist, the deepest first."""
    missing = []
    while not os.path.lexists(directory) and directory != directory.parent:
        missing.append(directory)
        directory = directory.parent
    return missing


def remove_dead_stagings(destination: Path) -> list[str]:
    """Remove the staging directories that runs killed outright left for destination (see
    StagedOutput), those beside it of its temporary names whose lock nobody holds, with the
    scratch directories those runs kept beside them (storage/local.py
    scratch_directory_beside); the names removed. Never follows a symlink; where flock is
    not supported, removes nothing."""
    prefix = f".{destination.name}"
    removed: list[str] = []
    parent = os.open(destination.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        names = sorted(os.listdir(parent))
        for name in names:
            if is_temporary_name(name) and final_name_of(name) == prefix and _remove_unlocked(
                    parent, name, lock=True):
                removed.append(name)
                removed += [scratch for scratch in names
                            if scratch.startswith(f".{name}{SCRATCH_INFIX}")
                            and _remove_unlocked(parent, scratch, lock=False)]
    finally:
        os.close(parent)
    return removed


def _remove_unlocked(parent: int, name: str, lock: bool) -> bool:
    """Remove directory name of the open parent, with all in it, unless (with lock) another
    process holds its lock; whether it was removed. A live run renames its staging directory
    into place before it lets go of its lock: one locked here is removed only while it still
    has its name, else it is that run's published output."""
    try:
        descriptor = open_directory_at(parent, name)
    except OSError:
        return False  # gone, or not a directory (a symlink is never followed)
    try:
        if lock:
            fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
            opened = os.fstat(descriptor)
            named = os.stat(name, dir_fd=parent, follow_symlinks=False)
            if (named.st_dev, named.st_ino) != (opened.st_dev, opened.st_ino):
                return False  # published (or replaced) since it was opened
        empty_directory(descriptor)
        os.rmdir(name, dir_fd=parent)
        return True
    except OSError:
        return False  # a live run's, gone meanwhile, or no flock here: left alone
    finally:
        os.close(descriptor)


class ObjectStoreOutput:
    """An output in an object store, written in place: `path` is the destination. What stands
    there is refused unless overwrite; with overwrite it is deleted first, `.metadata` before
    the rest, so it is never seen half gone as a whole checkpoint.

    A file is one object, written whole or not at all: what stood there stays until it is
    replaced, and a run that fails leaves it.

    A directory is claimed before anything is written: `.metadata.tmp` (what a save in
    progress holds) is created only if absent, holding this run's token, and the prefix must
    then hold nothing else. So a second run that starts while this one writes, or once it has
    published, is refused instead of writing over its objects (where the store can promise a
    write only if absent: stores that ignore the condition, rclone's, cannot tell two runs
    apart). A run with overwrite takes over an output another run is writing: it deletes that
    run's claim with the rest and makes its own, and the other run, which checks its claim
    before it starts or completes each file (OutputClaim.check) and before it publishes,
    stops there; objects it completed after the takeover all the same are deleted by
    confirm() and confirm_published(). The claim is given up in
    confirm(), just before the output's last file (a checkpoint's `.metadata`), once the
    objects written are found all there and the claim still this run's; abort() deletes what
    lies under the prefix only while it is this run's output: its claim, or, after confirm(),
    no `.metadata` that another run published."""

    def __init__(self, destination: ObjectPath, overwrite: bool, source: StoragePath,
                 is_directory: bool = True) -> None:
        refuse_overlap(source, destination)
        self.destination = self.path = destination
        self.is_directory = is_directory
        self.token = new_token()
        self.overwrite = overwrite
        self.claim: OutputClaim | None = None
        self._claimed = self._confirmed = False
        store = destination.store
        if not is_directory:
            if "/" not in destination.key.strip("/") and store.protocol != "memory":
                raise OutputError(f"names a bucket, not an object in it; give "
                                  f"{store.protocol}://BUCKET/NAME", path=destination)
            self._standing_etag = _current_etag(destination)
            if self._standing_etag is not None and not overwrite:
                raise OutputError("exists (pass --overwrite to replace it)", path=destination)
            return
        if destination.is_file():
            raise OutputError("exists and is not a directory (an object has this name)",
                              path=destination)
        standing = sorted(store.list_tree(destination.key))
        if standing and not overwrite:
            writing = (METADATA_TEMPORARY_FILE_NAME in standing
                       and METADATA_FILE_NAME not in standing)
            raise OutputError(
                f"holds {METADATA_TEMPORARY_FILE_NAME}: another run is writing this output, or "
                "one was stopped before it finished (pass --overwrite to replace it)" if writing
                else "exists and is not empty (pass --overwrite to replace it)", path=destination)
        if standing:
            delete_checkpoint_objects(destination)
        self.claim = OutputClaim(destination / METADATA_TEMPORARY_FILE_NAME,
                                 f"dcpctl {self.token}\n".encode(), takes_over=overwrite)
        try:
            store.put(self.claim.path.key, self.claim.data, if_absent=True)
        except FileExistsError:
            if store.holds_exactly(self.claim.path.key, self.claim.data) is not True:  # lost?
                raise OutputTakenError(
                    f"another run is writing this output (it holds "
                    f"{METADATA_TEMPORARY_FILE_NAME}, as a save in progress does); "
                    + ("it claimed the output as this run cleared it: run again to replace "
                       "its output" if overwrite else "if none is, pass --overwrite to replace "
                       "it"), path=destination) from None
        self._claimed = True
        # with overwrite, what appeared since the output was cleared is a run's this one took
        # over (its claim went with the rest): confirm() deletes what it still leaves
        if not overwrite and set(store.list_tree(destination.key)) - {
                METADATA_TEMPORARY_FILE_NAME}:
            self._give_up_claim()
            raise OutputTakenError("another run wrote here meanwhile: the output is not empty "
                                   "(pass --overwrite to replace it)", path=destination)

    def confirm(self, names: Iterable[str] = (), sizes: Mapping[str, int] | None = None
                ) -> None:
        """Before the output's last file is written: check that the claim is still this run's
        and that every one of names (the files it wrote) is there, with the size sizes gives
        it where it does, and give the claim up; raises OutputError, nothing published, where
        another run took the output over. With overwrite, the other objects under the prefix
        (a run this one took over wrote them after it was cleared) are deleted first."""
        if not self._claimed:
            return
        sizes = sizes or {}
        standing = self._refuse_replaced(names, sizes)
        self.claim.check()  # after the listing: what it lists is this run's output's
        if self.overwrite:
            self._delete_strays(standing, {*names, *sizes})
        self._give_up_claim()
        self._confirmed = True

    def confirm_published(self, names: Iterable[str], sizes: Mapping[str, int], last_file: str,
                          last_bytes: bytes) -> None:
        """Once the last file (last_bytes) is written: check the files again, as confirm()
        did. A run with --overwrite may have deleted them and written its own since the claim
        was given up; then the last file is taken back where it is still this run's, the rest
        left to that run, and OutputError raised. With overwrite, other objects under the
        prefix go again, as in confirm()."""
        if not self._confirmed:
            return
        try:
            standing = self._refuse_replaced([*names, last_file],
                                             {**sizes, last_file: len(last_bytes)})
        except OutputError:
            self._confirmed = False  # the output is the other run's now: abort leaves it
            store, last = self.destination.store, (self.destination / last_file).key
            with contextlib.suppress(StorageError, OSError):
                if store.holds_exactly(last, last_bytes):
                    store.delete([last], if_etags={last: store.remembered_etag(last)})
            raise
        if self.overwrite:  # what a run this one took over wrote since confirm()
            self._delete_strays(standing, {*names, *sizes, last_file})

    def _refuse_replaced(self, names: Iterable[str], sizes: Mapping[str, int]
                         ) -> dict[str, ObjectInfo]:
        """Raise OutputError where one of names is gone, or is not the object this run wrote:
        of another size than sizes gives it, or of another ETag than the store gave this run's
        write (where the store gives ETags: a replacement of the same size). Returns what
        stands under the prefix, by name."""
        store = self.destination.store
        standing = store.list_tree(self.destination.key)
        for name in sorted({*names, *sizes}):
            info = standing.get(name)
            if info is None:
                raise OutputTakenError(f"{name} was deleted while this run wrote the output "
                                       "(another run?): nothing was published",
                                       path=self.destination)
            if name in sizes and info.size != sizes[name]:
                raise OutputTakenError(f"{name} was replaced while this run wrote the output "
                                       f"(it holds {info.size} bytes, not the {sizes[name]} "
                                       "this run wrote; another run with --overwrite?): "
                                       "nothing was published", path=self.destination)
            written = store.etag_written((self.destination / name).key)
            if written is not None and info.etag is not None and info.etag != written:
                raise OutputTakenError(f"{name} was replaced while this run wrote the output "
                                       "(its ETag is not the one this run's write was given; "
                                       "another run with --overwrite?): nothing was published",
                                       path=self.destination)
        return standing

    def _delete_strays(self, standing: Mapping[str, ObjectInfo], own: set[str]) -> None:
        """Delete the objects of standing not named in own, nor the claim (this run's, or
        one another run made since), each only as listed (by ETag, where the store promises
        it)."""
        strays = sorted(set(standing) - own - {METADATA_TEMPORARY_FILE_NAME})
        if strays:
            keys = {name: (self.destination / name).key for name in strays}
            self.destination.store.delete(
                list(keys.values()), if_etags={keys[name]: standing[name].etag for name in strays})

    def publish(self) -> None:
        """Nothing to move: every object is in place once its write finished; the claim is
        given up if confirm() has not already."""
        failpoint(Failpoint.BEFORE_PUBLISH)
        self.confirm()

    def abort(self, upload_names: Collection[str] = ()) -> None:
        """Delete what was written under the destination, where it is this run's output, and
        abort this run's uploads there that a thread it did not wait for still holds, and
        those of upload_names (files this run writes under the prefix, which a worker or rank
        killed mid-write leaves unfinished: S3 keeps, and bills, their parts). Where
        another run took it over, nothing more: an object this run wrote cannot be told from
        one of the same bytes that run wrote (their ETags are the same), and that run deletes
        what it finds of this one's (confirm()). A store that fails meanwhile (the one that failed
        the run, say) leaves it: the error that stopped the run is the one to report, and a
        run with --overwrite clears it."""
        try:
            self.destination.store.abort_open_uploads(self.destination.key)
            if not self.is_directory:
                # the object is written whole or not at all: one that stood there stays
                now = _current_etag(self.destination)
                if now is not None and now != self._standing_etag:
                    self.destination.unlink(missing_ok=True)
            elif (self._claimed and self.claim.is_held()) or (
                    self._confirmed and not (self.destination / METADATA_FILE_NAME).exists()):
                delete_checkpoint_objects(self.destination)
                if upload_names:
                    self.destination.store.abort_uploads(self.destination.key,
                                                         set(upload_names).__contains__)
        except (StorageError, OSError):
            pass

    def _give_up_claim(self) -> None:
        self.claim.path.unlink(missing_ok=True)
        self._claimed = False


def _current_etag(path: ObjectPath) -> str | None:
    """The ETag of the object at path as the store says now ("" where it gives none), None
    where there is none."""
    info = path.store.info_now(path.key)
    return None if info is None else info.etag or ""


def delete_checkpoint_objects(directory: ObjectPath,
                              metadata_names: Sequence[str] = (METADATA_FILE_NAME,),
                              seen: Mapping[str, ObjectInfo] | None = None) -> None:
    """Delete every object under a checkpoint's prefix, its `.metadata` files first (so that
    a deletion cut short leaves an incomplete checkpoint rather than one that looks complete;
    `part/.metadata` where its parts are DCP directories), then the rest, listed once they
    are gone, in batches.

    Given seen, what a scan listed under the prefix (by name relative to it), only those
    objects go, and only as they were (S3 makes each deletion conditional on its ETag too): a
    save that has started again there since (a trainer back at that step) keeps what it wrote.
    A `.metadata` written or replaced since is never deleted: found before anything goes, or
    before the data goes, it stops the deletion there; found once the data is gone (its save
    wrote no object the scan had not seen), it is named in the error. Other objects written
    since stay, and StorageError names them once the rest is gone. Uploads a killed run left
    unfinished under the prefix go too, once a day old (abort_stale_uploads), and the empty
    folder markers under it, which would still show the prefix."""
    store = directory.store

    def keys(names: Iterable[str]) -> list[str]:
        return [(directory / name).key for name in names]

    def as_seen(names: Iterable[str]) -> dict[str, str | None] | None:
        return None if seen is None else {
            (directory / name).key: seen[name].etag for name in names if name in seen}

    def refuse_new_metadata(listing: Mapping[str, ObjectInfo], outcome: str) -> None:
        changed = [name for name in metadata_names
                   if name in listing and listing[name] != seen.get(name)]
        if changed:
            raise StorageError(f"was written since dcpctl listed it (a save at work there?); "
                               f"{outcome}", path=directory / changed[0])

    if seen is not None:
        refuse_new_metadata(store.list_tree(directory.key),
                            "nothing of the checkpoint was deleted")
    listed_metadata = [name for name in metadata_names if seen is None or name in seen]
    store.delete(keys(listed_metadata), if_etags=as_seen(listed_metadata))  # never a new one
    failpoint(Failpoint.AFTER_METADATA_REMOVED)
    standing = store.list_tree(directory.key)
    if seen is not None:
        refuse_new_metadata(standing, "the rest of the checkpoint was left")
    names = sorted(name for name, info in standing.items()
                   if seen is None or seen.get(name) == info)
    store.delete(keys(names), if_etags=as_seen(names))
    store.delete(store.folder_markers(directory.key))  # they hold nothing, and show the prefix
    abort_stale_uploads(directory)
    if seen is not None:  # a `.metadata` that came as the data went stands over nothing
        refuse_new_metadata(store.list_tree(directory.key),
                            "its data, as listed before, was deleted: the save there must be "
                            "made again")
    new = sorted(set(standing) - set(names))
    if new:
        raise StorageError(f"holds {len(new)} object(s) written since dcpctl listed it, left "
                           f"where they are (the first: {new[0]!r}); the rest was deleted, "
                           ".metadata first", path=directory)


def staged_output(destination: StoragePath, overwrite: bool, source: StoragePath,
                  is_directory: bool = True) -> StagedOutput | ObjectStoreOutput:
    """Where a new output is written before it is published (see the two classes)."""
    if isinstance(destination, ObjectPath):
        return ObjectStoreOutput(destination, overwrite, source, is_directory)
    return StagedOutput(destination, overwrite, source, is_directory)


def refuse_overlap(source: StoragePath, destination: StoragePath) -> None:
    """Refuse an output that is the input, holds it, or lies inside it, whatever --overwrite
    says: replacing it would delete the input, and writing inside it would change it."""
    if isinstance(source, ObjectPath) or isinstance(destination, ObjectPath):
        if not (isinstance(source, ObjectPath) and isinstance(destination, ObjectPath)
                and source.store is destination.store):
            return  # different stores never overlap
        source_real, destination_real = "/" + source.key, "/" + destination.key
    else:
        source_real, destination_real = os.path.realpath(source), os.path.realpath(destination)
    if destination_real == source_real:
        raise OutputError(f"is the input {source}; give another output", path=destination)
    if _lies_within(source_real, destination_real):
        raise OutputError(f"holds the input {source}: replacing it would delete the input; "
                          "give another output", path=destination)
    if _lies_within(destination_real, source_real):
        raise OutputError(f"lies inside the input {source}; give an output outside it",
                          path=destination)


def _lies_within(inner: str, outer: str) -> bool:
    return os.path.commonpath([inner, outer]) == outer and inner != outer


def check_destination(destination: Path, overwrite: bool, is_directory: bool = True) -> None:
    """Refuse a destination of the wrong kind, or one holding data, unless overwrite."""
    if os.path.ismount(destination):  # found after the whole output was written beside it
        raise OutputError("is a mount point, which no output can be renamed onto (dcpctl "
                          "writes an output beside its destination, on that file system, "
                          "then renames it into place); give a path inside it",
                          path=destination)
    if is_directory:
        if destination.is_symlink() or (destination.exists() and not destination.is_dir()):
            raise OutputError("exists and is not a directory", path=destination)
        holds_data = destination.exists() and any(destination.iterdir())
    else:
        if destination.is_dir() and not destination.is_symlink():
            raise OutputError("is a directory; give a file name", path=destination)
        holds_data = destination.exists() or destination.is_symlink()
        if holds_data and not (destination.is_symlink() or destination.is_file()):
            raise OutputError("exists and is not a regular file (a device, FIFO or socket), "
                              "which dcpctl never replaces", path=destination)
    if holds_data and not overwrite:
        what = "exists and is not empty" if is_directory else "exists"
        raise OutputError(f"{what} (pass --overwrite to replace it)", path=destination)

"""Publishing a rewritten checkpoint atomically: data first, `.metadata` last, SHA256SUMS after.

Two destinations:
- a new directory: everything is written into a hidden temporary sibling, which is renamed to
  the destination at the end; a killed run leaves the sibling, never a half checkpoint at the
  destination. In an object store, which cannot rename, the data objects and SHA256SUMS go
  straight under the destination prefix and `.metadata` last, created only if none is there
  (where the store can promise it): a killed run leaves data objects without `.metadata`, an
  incomplete checkpoint, never a half one that looks whole;
- in place: new data files are written beside the old ones under temporary names, `.metadata`
  is switched to them with one atomic rename, and only then are the new files given their
  final names (hard link, then an atomic replace of the old name) before a second metadata
  switch. At every moment `.metadata` names files that exist and hold what it says, so a
  killed run leaves a checkpoint that loads, old or new, never a mix. In an object store (no
  hard links) and on a file system without them, the new files keep their new names; there
  `.metadata` is replaced only if it is still the object first read (where the store can
  promise it), so a checkpoint changed meanwhile by someone else is not overwritten.
Data files are hashed while written, so SHA256SUMS costs no second read.
"""

from __future__ import annotations

import dataclasses
import errno
import hashlib
import os
import posixpath
from pathlib import Path
from dataclasses import dataclass
from typing import Hashable, Iterable, Sequence

from dcpctl.errors import DataError, DcpctlError, describe_os_error
from dcpctl.failpoints import Failpoint, failpoint
from dcpctl.format.checkpoint.checksums import write_sha256sums
from dcpctl.format.checkpoint.problems import problems_error
from dcpctl.format.checkpoint.side_files import read_checked_side_file, side_file_problems
from dcpctl.format.file_names import METADATA_FILE_NAME, SHA256SUMS_FILE_NAME
from dcpctl.format.metadata.records import CheckpointMetadata, StorageInfo
from dcpctl.format.metadata.writing import serialize_metadata
from dcpctl.stopping import finishing_first
from dcpctl.storage.local import fsync_directory, new_token, temporary_name
from dcpctl.storage.objects import ObjectPath, WriteOutcomeUnknownError, run_within
from dcpctl.storage.paths import (StoragePath, is_remote, missing_files, new_output_file,
                                  write_whole)
from dcpctl.storage.claims import OutputClaim
from dcpctl.storage.staging import staged_output


class DataFileWriter:
    """One data file being written: its size so far and the SHA-256 of what was written."""

    def __init__(self, path: StoragePath, claim: OutputClaim | None = None) -> None:
        self.path = path
        self.size_bytes = 0
        self._digest = hashlib.sha256()
        self._file = new_output_file(path, claim)

    def write(self, piece: bytes) -> None:
        """Append a piece of bytes."""
        self._file.write(piece)
        self._digest.update(piece)
        self.size_bytes += len(piece)

    def close(self) -> str:
        """Flush to disk; returns the hex SHA-256 of the file."""
        self._file.finish()
        return self._digest.hexdigest()

    def discard(self) -> None:
        """Close without syncing (after a failure)."""
        self._file.discard()


class DataFileSet:
    """Data files of an output being written by one process: the whole output's in one
    process, a worker's share of it otherwise (it pickles into a fresh set, to send to a
    worker). Each file is named as the published metadata first names it, and hashed. Given
    the claim of an object store output, a new file is started only while it is this run's."""

    def __init__(self, directory: StoragePath, in_place_token: str | None,
                 claim: OutputClaim | None = None) -> None:
        self.directory = directory
        self.in_place_token = in_place_token
        self.claim = claim
        self.digests: dict[str, str] = {}
        """The SHA-256 of each file finished, by final name."""
        self._open_writers: dict[str, DataFileWriter] = {}  # by final name

    def __reduce__(self):
        return DataFileSet, (self.directory, self.in_place_token, self.claim)

    def data_file_name(self, final_name: str) -> str:
        """The name a data file has in the published metadata's first version."""
        if self.in_place_token is None:
            return final_name
        return temporary_name(final_name, self.in_place_token)

    def data_file(self, final_name: str) -> DataFileWriter:
        """The data file that will be called final_name, started on first use."""
        writer = self._open_writers.get(final_name)
        if writer is None:
            path = self.directory / self.data_file_name(final_name)
            # a name with directories: those are made inside the output's directory, never it
            # (a rank on a machine that does not share it fails to open the file, naming it)
            if (self.in_place_token is None and not is_remote(path)
                    and path.parent != self.directory and self.directory.is_dir()):
                path.parent.mkdir(parents=True, exist_ok=True)
            writer = self._open_writers[final_name] = DataFileWriter(path, self.claim)
        return writer

    def finish_data_file(self, final_name: str) -> None:
        """Sync and close a data file, remembering its checksum. Where the output was taken
        over meanwhile (OutputClaim.check), OutputTakenError instead: the object is never
        completed, and discard() abandons it: the writer stays listed until it closes."""
        self.digests[final_name] = self._open_writers[final_name].close()
        del self._open_writers[final_name]

    def finish_data_files(self) -> dict[str, str]:
        """Sync and close every data file still open; the digests of all, by final name."""
        for final_name in sorted(self._open_writers):
            self.finish_data_file(final_name)
        return self.digests

    def discard(self) -> None:
        """Close the files still open without syncing (after a failure)."""
        for writer in self._open_writers.values():
            writer.discard()
        self._open_writers.clear()


@dataclass
class WrittenShare:
    """What one worker's share of a rewrite wrote: the new storage record of each item, by the
    key its plan names it with, and each data file's SHA-256 by final name."""

    storage: dict[Hashable, StorageInfo]
    digests: dict[str, str]


def merge_shares(shares: Iterable[WrittenShare]
                 ) -> tuple[dict[Hashable, StorageInfo], dict[str, str]]:
    """Every share's storage records and digests, in one of each."""
    storage: dict[Hashable, StorageInfo] = {}
    digests: dict[str, str] = {}
    for share in shares:
        storage.update(share.storage)
        digests.update(share.digests)
    return storage, digests


ABORT_SECONDS = 60
"""How long an output in an object store may take to remove what a failed run wrote."""


class CheckpointOutput:
    """Where a rewritten checkpoint goes; see the module docstring for the two ways. Its data
    files are written through DataFileSets (data_files()), in this process or by workers,
    and published with their digests."""

    def __init__(self, destination: StoragePath, in_place: bool, source: StoragePath,
                 overwrite: bool = False, side_files: Sequence[str] = ()) -> None:
        """side_files: the source's trainer side files (side_files.py), copied into a new
        directory as they are (left as they are in place) and listed in SHA256SUMS; refused
        first where damaged (side_file_problems), as SHA256SUMS would certify them."""
        problems = side_file_problems(source, side_files)
        if problems:
            raise problems_error(problems, source)
        self.destination = destination
        self.in_place = in_place
        self._source = source
        self._side_files = tuple(side_files)
        self._sets: list[DataFileSet] = []
        self._planned_names: set[str] = set()
        self._metadata_switched = False
        if in_place:
            self._staged = None
            self._token = new_token()
            self.directory = destination
        else:
            self._staged = staged_output(destination, overwrite, source)
            self._token = self._staged.token
            self.directory = self._staged.path

    def data_files(self, final_names: Iterable[str]) -> DataFileSet:
        """A set for writing some of the data files, called final_names once published (abort
        removes them whoever wrote them)."""
        self._planned_names.update(final_names)
        files = DataFileSet(self.directory, self._token if self.in_place else None,
                            None if self.in_place else self._staged.claim)
        self._sets.append(files)
        return files

    def publish(self, metadata: CheckpointMetadata, digests: dict[str, str],
                replaced_files: frozenset[str] = frozenset()) -> None:
        """Write `.metadata` (whose storage_data names final file names) and SHA256SUMS, given
        every data file's digest by final name (DataFileSet.finish_data_files). In place, the
        data files the old metadata named (replaced_files) go once no longer used; no other file
        of the directory is touched."""
        if self.in_place:
            self._publish_in_place(metadata, dict(digests), replaced_files)
        else:
            self._publish_new_directory(metadata, dict(digests))

    def abort(self) -> None:
        """Remove everything this output wrote (workers stopped first); the source stays as it
        was. Once `.metadata` names the new files, they are the checkpoint and stay. In an
        object store, which may be what failed the run, the removal is given ABORT_SECONDS in
        all: each request to a store that stopped answering waits out its client's retries (a
        minute or more), and what is left, temporary objects no checkpoint names, the next run
        on it removes."""
        if is_remote(self.directory):
            run_within(ABORT_SECONDS, self._remove_written)
        else:
            self._remove_written()

    def _remove_written(self) -> None:
        for files in self._sets:
            files.discard()
        if self._metadata_switched:
            return
        names = self._planned_names | {name for files in self._sets for name in files.digests}
        if self.in_place:
            temporaries = {temporary_name(name, self._token) for name in names}
            if isinstance(self.directory, ObjectPath):
                # this run's unfinished uploads: of this process (a thread a stop did not wait
                # for still holds them), and of any (a worker or rank killed mid-write)
                self.directory.store.abort_open_uploads(self.directory.key)
                self.directory.store.abort_uploads(self.directory.key, temporaries.__contains__)
            for name in sorted(temporaries):
                (self.directory / name).unlink(missing_ok=True)
        else:
            self._staged.abort(upload_names=names)

    def _publish_new_directory(self, metadata: CheckpointMetadata, digests: dict[str, str]
                               ) -> None:
        claim = self._staged.claim  # each file checks it as it is started and completed
        for name in self._side_files:
            digests[name] = _copy_side_file(self._source, name, self.directory / name, claim)
        metadata_bytes = serialize_metadata(metadata)
        written = [*digests, SHA256SUMS_FILE_NAME]
        digests[METADATA_FILE_NAME] = hashlib.sha256(metadata_bytes).hexdigest()
        write_sha256sums(self.directory, digests, claim)
        sizes = _data_file_sizes(metadata)
        self._staged.confirm(written, sizes)  # in an object store: still this run's, whole
        write_whole(self.directory / METADATA_FILE_NAME, metadata_bytes, only_if_absent=True)
        self._staged.confirm_published(written, sizes, METADATA_FILE_NAME, metadata_bytes)
        _sync(self.directory, digests)
        self._staged.publish()

    def _publish_in_place(self, metadata: CheckpointMetadata, digests: dict[str, str],
                          replaced_files: frozenset[str]) -> None:
        directory = self.directory
        # hashed as they are checked, before the switch: a failure after it cannot leave the
        # checkpoint rewritten without its SHA256SUMS
        side_digests = {name: read_checked_side_file(directory, name)
                        for name in self._side_files}
        temporary_names = {name: temporary_name(name, self._token) for name in digests}
        switched_metadata = serialize_metadata(_renamed(metadata, temporary_names))
        if is_remote(directory):  # no locks there: another run may have taken them for stale
            missing = missing_files(directory, temporary_names.values())
            if missing:
                raise DataError(f"{missing[0]}, written by this run, is gone (another run took "
                                "it for a killed run's?): the checkpoint is unchanged",
                                path=directory)
        # from here on, a stop waits for the end
        with finishing_first(finished="the checkpoint is rewritten whole"):
            # SHA256SUMS describes the old files: it goes at the switch, so a run that fails
            # or stops earlier leaves the source with its sums
            try:
                switched_digest = write_whole(directory / METADATA_FILE_NAME, switched_metadata,
                                              made_stale=directory / SHA256SUMS_FILE_NAME,
                                              only_if_unchanged=True)
            except WriteOutcomeUnknownError as error:
                self._metadata_switched = True  # it may have: abort must keep the new files
                raise WriteOutcomeUnknownError(
                    f"{error.message}; the old and the new data files are both kept, so the "
                    ".metadata there loads whichever it is: check with dcpctl verify, and run "
                    "the command again", path=error.path) from None
            self._metadata_switched = True
            self._finish_in_place(metadata, digests, temporary_names, replaced_files,
                                  switched_digest, side_digests)

    def _finish_in_place(self, metadata: CheckpointMetadata, digests: dict[str, str],
                         temporary_names: dict[str, str], replaced_files: frozenset[str],
                         switched_digest: str, side_digests: dict[str, str]) -> None:
        """From `.metadata` naming the new files by their temporary names (its SHA-256:
        switched_digest): their final names, the second switch, the old files gone,
        SHA256SUMS (listing the side files by side_digests)."""
        directory = self.directory
        _sync(directory, temporary_names.values())
        failpoint(Failpoint.AFTER_FIRST_METADATA_SWITCH)
        if not is_remote(directory) and _give_final_names(directory, temporary_names):
            metadata_digest = write_whole(directory / METADATA_FILE_NAME,
                                          serialize_metadata(metadata))
            fsync_directory(directory)
            failpoint(Failpoint.AFTER_SECOND_METADATA_SWITCH)
            for temporary in temporary_names.values():
                (directory / temporary).unlink()
        else:  # no hard links here: the new files keep their temporary names
            metadata_digest = switched_digest
            digests = {temporary_names[name]: digest for name, digest in digests.items()}
        old_files = sorted(replaced_files - set(digests))
        try:
            _remove(directory, old_files)
        except (DcpctlError, OSError) as error:
            removal_error = error
        else:
            removal_error = None
        digests[METADATA_FILE_NAME] = metadata_digest
        write_sha256sums(directory, {**digests, **side_digests})
        _sync(directory, [*digests, *replaced_files])
        if removal_error is not None:
            reason = (describe_os_error(removal_error) if isinstance(removal_error, OSError)
                      else str(removal_error))
            raise DcpctlError(f"was rewritten (its .metadata and SHA256SUMS name the new files), "
                              f"but removing the {len(old_files)} old data files failed "
                              f"({reason}); run the command again to remove them",
                              path=directory) from None


def _data_file_sizes(metadata: CheckpointMetadata) -> dict[str, int]:
    """The size of each data file dcpctl wrote for metadata: its items lie back to back from
    its first byte, so it ends where its last item does."""
    sizes: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        sizes[info.relative_path] = max(sizes.get(info.relative_path, 0),
                                        info.offset + info.length)
    return sizes


def _copy_side_file(source: StoragePath, name: str, destination: StoragePath,
                    claim: OutputClaim | None = None) -> str:
    """Copy a side file of the checkpoint in source in pieces (claim: its object store
    output's); the hex SHA-256 of what was copied."""
    writer = DataFileWriter(destination, claim)
    try:
        read_checked_side_file(source, name, writer.write)  # what is copied is what is checked
    except BaseException:
        writer.discard()
        raise
    return writer.close()


def _sync(directory: StoragePath, names: Iterable[str] = ()) -> None:
    """Make a local directory's entries durable, and those of the subdirectories the named
    files lie in; an object store's writes are once done."""
    if not is_remote(directory):
        for below in sorted({posixpath.dirname(name) for name in names} - {""}):
            fsync_directory(directory / below)
        fsync_directory(directory)


def _remove(directory: StoragePath, names: list[str]) -> None:
    """Delete the named files of directory (in batches, in an object store)."""
    if is_remote(directory):
        directory.store.delete([(directory / name).key for name in names])
        return
    for name in names:
        (directory / name).unlink(missing_ok=True)


_NO_HARD_LINKS = (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EXDEV, errno.ENOSYS)
"""What link(2) answers on a file system that takes no hard links."""


def _give_final_names(directory: Path, temporary_names: dict[str, str]) -> bool:
    """Hard-link each new file under its final name, replacing the old file atomically; False
    when the file system has no hard links (nothing is changed then)."""
    for final_name, temporary in temporary_names.items():
        link = directory / f"{temporary}.link"
        try:
            os.link(directory / temporary, link)
        except OSError as error:
            if final_name == next(iter(temporary_names)) and error.errno in _NO_HARD_LINKS:
                return False
            raise  # the new file gone (its directory replaced?) is no lack of hard links
        os.replace(link, directory / final_name)
        failpoint(Failpoint.AFTER_FINAL_NAME)
    _sync(directory, temporary_names)
    return True


def _renamed(metadata: CheckpointMetadata, names: dict[str, str]) -> CheckpointMetadata:
    storage_data = {key: dataclasses.replace(info, relative_path=names[info.relative_path])
                    for key, info in (metadata.storage_data or {}).items()}
    return dataclasses.replace(metadata, storage_data=storage_data)


def storage_with(info: StorageInfo, relative_path: str, offset: int, length: int,
                 descriptors: tuple[str, ...] | None) -> StorageInfo:
    """A copy of info pointing at a new byte range with new transforms."""
    return dataclasses.replace(info, relative_path=relative_path, offset=offset, length=length,
                               transform_descriptors=descriptors or None)

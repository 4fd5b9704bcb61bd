"""SHA256SUMS files in the coreutils format, so `sha256sum -c SHA256SUMS` checks a checkpoint."""

from __future__ import annotations

import re
from typing import Callable, Iterable

from dcpctl.errors import DataError
from dcpctl.failpoints import Failpoint, failpoint
from dcpctl.format.checkpoint.problems import Problem, Rule, problems_error
from dcpctl.format.checkpoint.side_files import files_beside_data
from dcpctl.format.checkpoint.view import Checkpoint, holds_a_regular_file
from dcpctl.format.file_names import SHA256SUMS_FILE_NAME, is_plain_file_name
from dcpctl.pipeline import default_thread_count
from dcpctl.storage.claims import OutputClaim
from dcpctl.storage.file_digests import sha256_of_file
from dcpctl.storage.objects import ObjectPath
from dcpctl.storage.paths import (StoragePath, missing_files, new_output_file, read_whole,
                                  storage_path, write_whole)
from dcpctl.thread_pools import thread_pool

_LINE = re.compile(r"^([0-9a-fA-F]{64}) [ *](.+)$")  # sha256sum -c takes either case


def sha256_of_files(directory: StoragePath, names: Iterable[str], threads: int,
                    on_progress: Callable[[int], None] | None = None) -> dict[str, str]:
    """The hex SHA-256 of each named file of directory, hashed by `threads` threads at once
    (hashlib lets go of the GIL), the largest files first."""
    directory = storage_path(directory)
    by_size = sorted(names, key=lambda name: -(directory / name).stat().st_size)
    with thread_pool(threads, "dcpctl-sha256") as pool:
        futures = {name: pool.submit(sha256_of_file, directory / name, on_progress)
                   for name in by_size}
        return {name: future.result() for name, future in futures.items()}


def checksum_mismatch(name: str, actual: str, listed: str, end: int | None = None,
                      fqns: tuple[str, ...] = ()) -> Problem:
    """The problem of a file whose SHA-256 is not the one SHA256SUMS lists."""
    return Problem(Rule.CHECKSUM_MISMATCH, f"SHA-256 is {actual}, SHA256SUMS says {listed}",
                   name, 0 if end is not None else None, end, fqns)


def refuse_sha256sums_mismatch(checkpoint: Checkpoint, threads: int | None = None,
                               on_progress: Callable[[int, int], None] | None = None) -> None:
    """When the checkpoint holds SHA256SUMS, refuse it where a file it lists is absent (the
    last rank's shard of a checkpoint without `.metadata`, a trainer's side file: nothing else
    tells they are gone), then hash `.metadata` and the data files it lists, on `threads`
    threads, and raise DataError naming the first that does not match.
    on_progress(bytes_done, total_bytes) follows the hashing."""
    sums = read_sha256sums(checkpoint.path)
    if sums is None:
        return
    absent = absent_listed_files(checkpoint.path, sums)
    if absent:
        raise problems_error(absent, checkpoint.path)
    listed = [name for name in checksummed_files(checkpoint) if name in sums]
    total = sum((checkpoint.path / name).stat().st_size for name in listed)

    def advance(done_bytes: int) -> None:
        if on_progress is not None:
            on_progress(done_bytes, total)

    digests = sha256_of_files(checkpoint.path, listed, threads or default_thread_count(),
                              advance)
    mismatches = [checksum_mismatch(name, digests[name], sums[name]) for name in sorted(listed)
                  if digests[name] != sums[name]]
    if mismatches:
        raise problems_error(mismatches, checkpoint.path)


def absent_listed_files(directory: StoragePath, sums: dict[str, str]) -> list[Problem]:
    """A problem for each file SHA256SUMS lists that is not in directory as a regular file, or
    a link to one where a data file's link may lead (view.regular_file_inside: inside it, or
    into its hub cache blobs); a FIFO, or a link out put in its place, is not it: no command
    reads or carries one."""
    problems = [Problem(Rule.MISSING_FILE, "listed in SHA256SUMS but absent", name)
                for name in missing_files(directory, sums)]
    if not isinstance(directory, ObjectPath):
        problems += [Problem(Rule.NOT_REGULAR_FILE, "listed in SHA256SUMS but not a regular "
                             "file here (a FIFO, a directory, or a symlink out of the "
                             "checkpoint)", name)
                     for name in sorted(set(sums) - {problem.file for problem in problems})
                     if not holds_a_regular_file(directory, name)]
    return problems


def checksummed_files(checkpoint: Checkpoint) -> list[str]:
    """The files SHA256SUMS covers: the data files and the checkpoint's own files beside them
    (`.metadata`, the trainer's side files: side_files.py)."""
    return sorted({*checkpoint.files, *files_beside_data(checkpoint)})


def format_sha256sums(digests: dict[str, str]) -> str:
    """`<hex>  <name>` lines sorted by name, as `sha256sum` prints them."""
    for name in digests:
        if not is_plain_file_name(name):
            raise DataError(f"{name!r}: a checksummed file name must be a plain name")
    return "".join(f"{digests[name]}  {name}\n" for name in sorted(digests))


def parse_sha256sums(text: str, source: str = SHA256SUMS_FILE_NAME) -> dict[str, str]:
    """File name to lower-case hex digest; raises DataError naming the line that is not a
    checksum line, names no plain file of the checkpoint (`../x`, `/x`: every command refuses
    what verify calls damaged), or gives a file another digest than a line before it
    (`sha256sum -c` fails one of them: neither may be taken)."""
    digests: dict[str, str] = {}
    lines: dict[str, int] = {}
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        match = _LINE.match(line)
        if match is None:
            raise DataError(f"{source}:{number}: not a `sha256sum` line: {line[:80]!r}")
        digest, name = match.group(1).lower(), match.group(2)
        if not is_plain_file_name(name):
            raise DataError(f"{source}:{number}: names {name[:80]!r}, not a plain file name in "
                            "the checkpoint directory")
        if digests.setdefault(name, digest) != digest:
            raise DataError(f"{source}:{number}: gives {name!r} another digest than line "
                            f"{lines[name]} does")
        lines.setdefault(name, number)
    return digests


def read_sha256sums(directory: StoragePath) -> dict[str, str] | None:
    """The digests recorded in directory/SHA256SUMS, or None when there is no such file."""
    path = storage_path(directory) / SHA256SUMS_FILE_NAME
    try:
        text = read_whole(path).decode()
    except FileNotFoundError:
        return None
    except UnicodeDecodeError:
        raise DataError("not a text file of `sha256sum` lines", path=path) from None
    return parse_sha256sums(text, str(path))


def write_sha256sums(directory: StoragePath, digests: dict[str, str],
                     claim: OutputClaim | None = None) -> StoragePath:
    """Write directory/SHA256SUMS atomically (a reader sees the old file or the new one). In a
    new object store output, given its claim: only where no object has the name, and only while
    the claim holds (ObjectOutputFile), so that a run taken over never writes over the SHA256SUMS
    of the run that took its output over."""
    path = storage_path(directory) / SHA256SUMS_FILE_NAME
    data = format_sha256sums(digests).encode()
    if claim is None:
        write_whole(path, data)
        return path
    with new_output_file(path, claim) as stream:
        stream.write(data)
        failpoint(Failpoint.BEFORE_ATOMIC_RENAME)  # as write_whole: about to be put in place
        stream.finish()
    return path

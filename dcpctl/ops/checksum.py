"""Write SHA256SUMS for a checkpoint: the SHA-256 of `.metadata`, of every data file and of the
trainer's side files (side_files.py), once each item is checked."""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from typing import Callable

from dcpctl.errors import ChangedWhileReadError, DataError
from dcpctl.format.checkpoint.checksums import (absent_listed_files, read_sha256sums,
                                                write_sha256sums)
from dcpctl.format.checkpoint.problems import Problem, ProblemsError, problems_error
from dcpctl.format.checkpoint.side_files import read_checked_side_file, side_files_of
from dcpctl.format.checkpoint.structure import checked_checkpoint, list_stored_items
from dcpctl.execution.running import (plan_ahead, sharing_processes, threads_per_worker,
                                      workers_started)
from dcpctl.ops.verify.scan import items_to_check
from dcpctl.ops.verify.scan_job import ScanJob, ScanPlanning, run_scan
from dcpctl.ops.verify.verifier import unknown_file_problems
from dcpctl.storage.paths import StoragePath, remove_stale_temporaries, storage_path


@dataclass
class ChecksumReport:
    """Where SHA256SUMS was written, and the digest of each file it covers."""

    path: str
    sums_path: str
    digests: dict[str, str]
    hashed_bytes: int

    def to_json(self) -> dict:
        """A JSON-ready dict."""
        return {"path": self.path, "sums_path": self.sums_path, "hashed_bytes": self.hashed_bytes,
                "files": self.digests}


def checksum_checkpoint(path: str | os.PathLike, threads: int | None = None,
                        on_progress: Callable[[int, int], None] | None = None,
                        workers: int = 1) -> ChecksumReport:
    """Hash `.metadata` and every data file the metadata names, in parallel (`workers`
    processes of `threads` threads each), and write
    CKPT/SHA256SUMS, holding the checkpoint. It is not certified damaged: as the files are read,
    every item is checked as `verify` checks it, and any SHA256SUMS already there must hold;
    a checkpoint with any problem is refused, nothing written. on_progress(done_bytes,
    total_bytes) follows the reading."""
    # workers plan ahead from SHA256SUMS read early (in an object store, before the listing
    # that would have it: two requests more, worth it only with workers)
    ahead = (functools.partial(_plan_ahead, storage_path(path))
             if sharing_processes(workers) > 1 else None)
    with workers_started(workers), \
            checked_checkpoint(path, exclusive=True, check_sums=False,
                               once_held=ahead) as checkpoint:
        remove_stale_temporaries(checkpoint.path, set(checkpoint.files))
        old_sums = read_sha256sums(checkpoint.path)
        absent = absent_listed_files(checkpoint.path, old_sums or {})
        if absent:  # a file certified before is gone: not to be certified away
            raise problems_error(absent, checkpoint.path)
        unknown = unknown_file_problems(checkpoint)
        if unknown:  # verify would call the checkpoint damaged: nothing to certify
            raise problems_error(unknown, checkpoint.path)
        planning = _planning(checkpoint.path, old_sums)
        archive_items, safetensors_items, problems = items_to_check(
            checkpoint, list_stored_items(checkpoint))
        units = planning.units(checkpoint, archive_items, safetensors_items)
        job = ScanJob(planning, threads_per_worker(threads, checkpoint.path, workers))
        problems += run_scan(job, units, workers, on_progress)
        side_digests = {}
        for name in side_files_of(checkpoint):
            try:  # hashed again as checked: what is certified is what was checked
                side_digests[name] = read_checked_side_file(checkpoint.path, name)
            except ProblemsError as error:
                problems += error.problems
        if problems:
            raise problems_error(sorted(problems, key=_problem_order), checkpoint.path)
        digests = {unit.name: unit.sha256 for unit in units if unit.hashing}
        changed = [name for name, digest in side_digests.items() if digests.get(name) != digest]
        if changed:
            raise ChangedWhileReadError(f"{changed[0]} changed while dcpctl read it (a trainer "
                                        "writing it?): run the command again",
                                        path=checkpoint.path)
        sums_path = write_sha256sums(checkpoint.path, digests)
    return ChecksumReport(str(checkpoint.path), str(sums_path), dict(sorted(digests.items())),
                          sum(unit.read_bytes for unit in units if unit.hashing))


def _planning(directory: StoragePath, old_sums: dict[str, str] | None) -> ScanPlanning:
    """The scan of checksum: every file SHA256SUMS covers, hashed, each against the digest of
    the SHA256SUMS already there (old_sums) if it lists it, every item checked."""
    return ScanPlanning(directory, True, dict(old_sums or {}), every_checksummed_file=True)


def _plan_ahead(directory: StoragePath) -> None:
    """Have the workers plan the scan while the checkpoint is checked; a SHA256SUMS that
    cannot be read is reported once it is (the command reads it again)."""
    try:
        old_sums = read_sha256sums(directory)
    except (DataError, OSError):
        return
    plan_ahead(_planning(directory, old_sums))


def _problem_order(problem: Problem) -> tuple:
    return problem.file or "", problem.start or 0

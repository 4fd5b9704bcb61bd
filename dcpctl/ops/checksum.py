"""Write SHA256SUMS for a checkpoint: the SHA-256 of `.metadata`, of every data file and of the
trainer's side files (side_files.py), once each item is checked."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable

from dcpctl.format.checkpoint.checksums import (checksummed_files, read_sha256sums,
                                                write_sha256sums)
from dcpctl.format.checkpoint.problems import Problem, problems_error
from dcpctl.format.checkpoint.structure import checked_checkpoint, list_stored_items
from dcpctl.execution.running import threads_per_worker
from dcpctl.ops.verify.scan import items_to_check, plan_scan
from dcpctl.ops.verify.scan_job import ScanJob, run_scan
from dcpctl.storage.paths import remove_stale_temporaries


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
    with checked_checkpoint(path, exclusive=True, check_sums=False) as checkpoint:
        remove_stale_temporaries(checkpoint.path, set(checkpoint.files))
        old_sums = read_sha256sums(checkpoint.path) or {}
        names = checksummed_files(checkpoint)
        archive_items, safetensors_items, problems = items_to_check(
            checkpoint, list_stored_items(checkpoint))
        sums = {name: old_sums.get(name) for name in names}
        units = plan_scan(checkpoint.path, archive_items, safetensors_items, sums)
        job = ScanJob(checkpoint.path, True, sums,
                      threads_per_worker(threads, checkpoint.path, workers))
        problems += run_scan(job, units, workers, on_progress)
        if problems:
            raise problems_error(sorted(problems, key=_problem_order), checkpoint.path)
        digests = {unit.name: unit.sha256 for unit in units if unit.hashing}
        sums_path = write_sha256sums(checkpoint.path, digests)
    return ChecksumReport(str(checkpoint.path), str(sums_path), dict(sorted(digests.items())),
                          sum(unit.read_bytes for unit in units if unit.hashing))


def _problem_order(problem: Problem) -> tuple:
    return problem.file or "", problem.start or 0

"""The data pass of verify and checksum (scan.py) as a job: its units shared among worker
processes or torchrun ranks (execution/jobs.py), each file read by one of them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from dcpctl.errors import DcpctlError
from dcpctl.execution.running import run_job
from dcpctl.format.checkpoint.checksums import checksummed_files
from dcpctl.format.checkpoint.problems import Problem
from dcpctl.format.checkpoint.structure import StoredItem, list_stored_items
from dcpctl.format.checkpoint.view import Checkpoint, open_checkpoint
from dcpctl.format.checkpoint.rank_metadata import replicated_keys
from dcpctl.ops.verify.scan import ItemPlace, ScanUnit, items_to_check, plan_scan, scan_units
from dcpctl.storage.paths import StoragePath


@dataclass(frozen=True)
class ScanPlanning:
    """What a scan's units are a pure function of (execution/jobs.py): read the checkpoint's
    files, checking its items (deep) and hashing the files named in sums (against the digest
    given, if any), or, with every_checksummed_file, every file SHA256SUMS covers (against
    the digest in sums, if any)."""

    directory: StoragePath
    deep: bool
    sums: dict[str, str | None]
    every_checksummed_file: bool = False

    def plan(self) -> list[ScanUnit]:
        try:
            checkpoint = open_checkpoint(self.directory, check_files=False)
        except DcpctlError:  # the coordinator reports it; the files are hashed all the same
            checkpoint = None
        items = list_stored_items(checkpoint) if checkpoint is not None else []
        archive_items, safetensors_items, _ = items_to_check(checkpoint, items, self.deep)
        return self.units(checkpoint, archive_items, safetensors_items)

    def units(self, checkpoint: Checkpoint | None, archive_items: list[StoredItem],
              safetensors_items: list[StoredItem]) -> list[ScanUnit]:
        """The plan, from the checkpoint (None: unreadable) and its items to check
        (items_to_check)."""
        compared = replicated_keys(checkpoint.replicas) if checkpoint is not None else set()
        return plan_scan(self.directory, archive_items, safetensors_items,
                         self.hashed_files(checkpoint), compared)

    def hashed_files(self, checkpoint: Checkpoint | None) -> dict[str, str | None]:
        """The files to hash, each with the digest it must have (None: any)."""
        if not self.every_checksummed_file or checkpoint is None:
            return self.sums
        return {name: self.sums.get(name) for name in checksummed_files(checkpoint)}


@dataclass(frozen=True)
class ScanJob:
    """A scan's work (ScanPlanning), for any process to do a share of: its lanes are the scan
    units, by bytes read."""

    planning: ScanPlanning
    threads: int

    def lane_sizes(self, units: list[ScanUnit]) -> list[int]:
        return [unit.read_bytes for unit in units]

    def run_share(self, units: list[ScanUnit], lanes: list[int],
                  advance: Callable[[int], None]) -> ScanShare:
        problems = scan_units([units[lane] for lane in lanes], self.threads, advance)
        return ScanShare(problems, {lane: units[lane].sha256 for lane in lanes},
                         {lane: units[lane].content_crcs for lane in lanes
                          if units[lane].content_crcs})


@dataclass
class ScanShare:
    """What a share of the scan found, and the SHA-256 of each unit it hashed (by index), and
    the content_crcs of the compared items of each unit that has some."""

    problems: list[Problem]
    sha256_by_unit: dict[int, str | None]
    content_crcs_by_unit: dict[int, dict[ItemPlace, tuple | None]]


def run_scan(job: ScanJob, units: list[ScanUnit], workers: int = 1,
             on_progress: Callable[[int, int], None] | None = None) -> list[Problem]:
    """Run the job's units (as its planning plans them) on `workers` processes; the problems
    found. Each unit's sha256 and content_crcs are filled in. on_progress(done_bytes,
    total_bytes) follows the reading."""
    shares = run_job(job, units, workers, on_progress)
    for share in shares:
        for lane, sha256 in share.sha256_by_unit.items():
            units[lane].sha256 = sha256
        for lane, content_crcs in share.content_crcs_by_unit.items():
            units[lane].content_crcs = content_crcs
    return [problem for share in shares for problem in share.problems]

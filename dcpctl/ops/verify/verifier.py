"""Prove a checkpoint whole, or list everything wrong with it: structure, checksums, and (deep)
every item decoded and checked against its CRC-32s and the metadata."""

from __future__ import annotations

import os
import posixpath
from dataclasses import dataclass, field
from typing import Callable

from dcpctl.cycle_collector import paused_cycle_collector
from dcpctl.errors import (NO_SIGN_OF_DAMAGE, DataError, IncompleteCheckpointError, MetadataError,
                           UnsafePathError)
from dcpctl.format.checkpoint.checksums import absent_listed_files, read_sha256sums
from dcpctl.format.checkpoint.hf_storage import SAFETENSORS_SUFFIX
from dcpctl.format.checkpoint.problems import Problem, Rule
from dcpctl.format.checkpoint.rank_metadata import item_key, replicated_keys
from dcpctl.format.checkpoint.rewrites import rewrite_error, rewrite_named, rewritten_since_read
from dcpctl.format.checkpoint.side_files import (empty_writer_files, files_beside_data,
                                                 misplaced_side_files, side_file_bytes,
                                                 side_file_problems, side_files_of)
from dcpctl.format.checkpoint.structure import check_structure, list_stored_items
from dcpctl.format.checkpoint.view import Checkpoint, open_checkpoint
from dcpctl.format.file_names import (METADATA_FILE_NAME, SHA256SUMS_FILE_NAME,
                                      rank_of_file_name, rank_of_metadata_file_name)
from dcpctl.execution.running import plan_ahead, threads_per_worker, workers_started
from dcpctl.ops.verify.consolidation import consolidation_problems
from dcpctl.ops.verify.scan import ScanUnit, items_to_check
from dcpctl.ops.verify.scan_job import ScanJob, ScanPlanning, run_scan
from dcpctl.storage.local import is_temporary_name, names_stood_in_for
from dcpctl.storage.locks import locked_checkpoint
from dcpctl.storage.paths import StoragePath, file_names_in, storage_path

OK, DAMAGED, INCOMPLETE, UNREADABLE = "ok", "damaged", "incomplete", "unreadable"


@dataclass
class VerifyReport:
    """What `dcpctl verify` found; `to_json` gives the stable machine-readable form."""

    path: str
    deep: bool
    status: str = OK
    checksummed_files: int | None = None
    """Files listed in SHA256SUMS, or None when there is no (readable) SHA256SUMS."""
    items_checked: int = 0
    bytes_read: int = 0
    problems: list[Problem] = field(default_factory=list)
    leftover_temporaries: list[str] = field(default_factory=list)
    """Files under dcpctl's temporary names that the metadata does not name: what a stopped
    (or a running) dcpctl left; not the checkpoint's, and no damage to it."""
    divergent_copies: list[str] | None = None
    """Of a checkpoint saved with use_collectives=False: the items a rank saved under a key a
    lower rank saved too, holding other bytes than the copy kept (`fqn (file)`): other
    values, or equal ones stored otherwise (a set pickled in another order, a tensor of other
    strides, -0.0). No damage (each rank loads its own), but one `.metadata` holds one copy:
    reshard and convert write the kept one. None where not compared (--quick)."""
    checkpoint: Checkpoint | None = field(default=None, repr=False, compare=False)
    """The checkpoint as its metadata was read (None where it could not be): millions of
    records at a million chunks, held as long as the report is."""

    @property
    def exit_code(self) -> int:
        """0 when whole, 1 when damaged or incomplete."""
        return 0 if self.status == OK else 1

    def to_json(self) -> dict:
        """A JSON-ready dict: counts, then one object per problem."""
        return {
            "path": self.path, "status": self.status, "deep": self.deep,
            "checksummed_files": self.checksummed_files, "items_checked": self.items_checked,
            "bytes_read": self.bytes_read,
            "problems": [problem.to_json() for problem in self.problems],
            "leftover_temporaries": self.leftover_temporaries,
            "divergent_copies": self.divergent_copies,
        }


def verify_checkpoint(path: str | os.PathLike, deep: bool = True, threads: int | None = None,
                      on_progress: Callable[[int, int], None] | None = None,
                      workers: int = 1) -> VerifyReport:
    """Check a checkpoint directory and report every problem found (see VerifyReport), its
    files read by `workers` processes of `threads` threads each; on_progress(done_bytes,
    total_bytes) follows the reading. Damage that came of another run rewriting the checkpoint
    while it was read (in an object store) is no report: ObjectChangedError says so."""
    directory = storage_path(path)
    with (workers_started(workers), locked_checkpoint(path, exclusive=False),
          rewrite_named(directory)):
        report = _verify(directory, deep, threads_per_worker(threads, directory, workers),
                         workers, on_progress)
        if report.problems and rewritten_since_read(directory):
            raise rewrite_error(directory)
        return report


def _verify(directory: StoragePath, deep: bool, threads: int, workers: int,
            on_progress: Callable[[int, int], None] | None) -> VerifyReport:
    report = VerifyReport(str(directory), deep)
    unreadable = False
    try:
        checkpoint = report.checkpoint = open_checkpoint(directory, check_files=False)
    except IncompleteCheckpointError as error:
        report.status = INCOMPLETE
        report.problems.append(Problem(Rule.INCOMPLETE, error.message))
        return report
    except (MetadataError, UnsafePathError, DataError) as error:
        checkpoint = None  # .metadata, or the safetensors headers it is read from (hf_storage.py)
        unreadable = isinstance(error, NO_SIGN_OF_DAMAGE)
        report.problems.append(Problem(Rule.METADATA, error.message,
                                       _name_below(directory, error.path) or (
                                           METADATA_FILE_NAME if (directory / METADATA_FILE_NAME
                                                                  ).exists() else None)))
    try:
        sums = read_sha256sums(directory)  # after the listing, which has it in an object store
    except DataError as error:
        sums = None
        report.problems.append(Problem(Rule.CHECKSUMS_FILE, error.message, SHA256SUMS_FILE_NAME))
    planning = ScanPlanning(directory, deep, dict(sums or {}))
    if deep or sums:  # workers plan the scan while this process checks the structure
        plan_ahead(planning)
    report.checksummed_files = None if sums is None else len(sums)
    with paused_cycle_collector():
        if checkpoint is not None:
            report.problems += check_structure(checkpoint)
        items = list_stored_items(checkpoint) if checkpoint is not None and deep else []
    present = _present_files(directory, checkpoint)
    report.problems += _listing_problems(directory, checkpoint, present, sums, report.problems)
    if checkpoint is not None:
        report.leftover_temporaries = leftover_temporaries(checkpoint, present)
    archive_items, safetensors_items, undecodable = items_to_check(checkpoint, items, deep)
    report.problems += undecodable
    side_bytes = 0
    if checkpoint is not None:
        side_files = side_files_of(checkpoint)
        said = {(problem.rule, problem.file) for problem in report.problems}
        report.problems += [problem for problem in side_file_problems(directory, side_files, deep)
                            if (problem.rule, problem.file) not in said]  # SHA256SUMS's too
        side_bytes = side_file_bytes(checkpoint, side_files) if deep else 0
    units = planning.units(checkpoint, archive_items, safetensors_items)
    job = ScanJob(planning, threads)
    report.problems += run_scan(job, units, workers, on_progress)
    if deep:
        report.divergent_copies = (divergent_copies(checkpoint, units)
                                   if checkpoint is not None and checkpoint.replicas else [])
    report.items_checked = len(archive_items) + len(safetensors_items) + len(undecodable)
    report.bytes_read = sum(unit.read_bytes for unit in units) + side_bytes
    if checkpoint is not None:
        found, read = consolidation_problems(checkpoint, deep)
        report.problems += found
        report.bytes_read += read
    report.problems.sort(key=lambda problem: (problem.file or "", problem.start or 0))
    if report.problems:
        # a class outside DCP's in .metadata, and nothing else found: a checkpoint dcpctl will
        # not unpickle, which torch may read (a custom planner's class, a quantized dtype), or
        # a class name damaged: nothing tells which; or a .metadata the file system failed
        report.status = UNREADABLE if unreadable and len(report.problems) == 1 else DAMAGED
    return report


def divergent_copies(checkpoint: Checkpoint, units: list[ScanUnit]) -> list[str]:
    """The replicas (rank_metadata.py) whose content, as the scan of units found it (their
    content_crcs), is not the copy kept's: each as `fqn (file)`."""
    found = {place: crcs for unit in units for place, crcs in unit.content_crcs.items()}
    compared = replicated_keys(checkpoint.replicas)
    kept = {(tensor.fqn, tuple(chunk.offsets)): chunk.storage for tensor in checkpoint.tensors
            for chunk in tensor.chunks if (tensor.fqn, tuple(chunk.offsets)) in compared}
    kept.update(((entry.fqn, None), entry.storage) for entry in checkpoint.objects
                if (entry.fqn, None) in compared)
    divergent = []
    for replica in checkpoint.replicas:
        first, copy = kept.get(item_key(replica.key)), replica.storage
        first_crcs = None if first is None else found.get(
            (first.relative_path, first.offset, replica.key.fqn))
        copy_crcs = found.get((copy.relative_path, copy.offset, replica.key.fqn))
        if None not in (first_crcs, copy_crcs) and first_crcs != copy_crcs:
            divergent.append(f"{replica.key.fqn} ({copy.relative_path})")
    return divergent


def _name_below(directory: StoragePath, path: str | None) -> str | None:
    """The name of path below directory, or None when it is not below it."""
    prefix = str(directory).rstrip("/") + "/"
    return path[len(prefix):] if path and path.startswith(prefix) else None


def unknown_file_problems(checkpoint: Checkpoint, present: set[str] | None = None
                          ) -> list[Problem]:
    """Files in the checkpoint directory (present: its listing, read when None) that neither
    the metadata nor the trainer's layout knows (side_files.py), and the side files' names that
    no regular file holds (misplaced_side_files)."""
    if present is None:
        present = _present_files(checkpoint.path, checkpoint)
    misplaced = misplaced_side_files(checkpoint)
    known = _known_files(checkpoint) | {problem.file for problem in misplaced}
    # Beside safetensors files, a Hugging Face directory holds config.json, tokenizer files and
    # the like: only a stray safetensors file is unknown there.
    candidates = ({name for name in present if name.endswith(SAFETENSORS_SUFFIX)}
                  if checkpoint.hf_storage else present)
    unknown = candidates - known - {SHA256SUMS_FILE_NAME} - set(
        leftover_temporaries(checkpoint, present))
    return misplaced + [Problem(Rule.UNKNOWN_FILE, _unknown_file_message(name), name)
                        for name in sorted(unknown - set(empty_writer_files(checkpoint, unknown)))]


def _unknown_file_message(name: str) -> str:
    """What verify says of a file the metadata does not name; of a data file named as torch's
    writer names them, where it most likely comes from: saving again into one directory with
    fewer ranks or writer threads, which overwrites `.metadata` and the files it names and
    leaves the rest."""
    if rank_of_metadata_file_name(name) is not None:
        return ("file is not named by the metadata: a rank's own metadata, of a save with "
                "use_collectives=False into this directory before or after the one that wrote "
                f"{METADATA_FILE_NAME}; the data files may be either's (torch loads by "
                f"{METADATA_FILE_NAME})")
    if rank_of_file_name(name) is None:
        return "file is not named by the metadata"
    return ("file is not named by the metadata: most likely left by an earlier save into this "
            "directory with more ranks or writer threads; the checkpoint loads without it")


def leftover_temporaries(checkpoint: Checkpoint, present: set[str]) -> list[str]:
    """The files in the checkpoint directory (present: its listing) under dcpctl's temporary
    names that the metadata does not name: a stopped run's, which the next run rewriting the
    checkpoint in place removes (in an object store, where no lock tells a running one's
    apart, once a day old: storage/paths.py remove_stale_temporaries), or a running one's.
    And the old data files of an in-place rewrite stopped once `.metadata` named the new ones
    by their temporary names (`__0_0.distcp` beside the `__0_0.distcp.dcpctl-<token>.tmp` it
    names), which the next run in place removes as well."""
    known = _known_files(checkpoint)
    replaced = names_stood_in_for(checkpoint.files)
    return sorted(name for name in present if name not in known and (
        is_temporary_name(posixpath.basename(name)) or name in replaced))


def _known_files(checkpoint: Checkpoint) -> set[str]:
    """The files the metadata names and those the trainer's layout keeps beside them."""
    return {*checkpoint.files, *files_beside_data(checkpoint)}


def _present_files(directory: StoragePath, checkpoint: Checkpoint | None) -> set[str]:
    if checkpoint is not None and checkpoint.listing is not None:
        return set(checkpoint.listing)
    return set(file_names_in(directory))


def _listing_problems(directory: StoragePath, checkpoint: Checkpoint | None, present: set[str],
                      sums: dict[str, str] | None, problems_so_far: list[Problem]
                      ) -> list[Problem]:
    """Files neither the metadata nor the trainer's layout knows (side_files.py), among those
    present (the directory's listing); files SHA256SUMS lists that are absent, and files of
    the checkpoint it does not list (a side file need not be listed)."""
    known = _known_files(checkpoint) if checkpoint is not None else {METADATA_FILE_NAME}
    problems = unknown_file_problems(checkpoint, present) if checkpoint is not None else []
    if sums is None:
        return problems
    reported_missing = {p.file for p in problems_so_far if p.rule == Rule.MISSING_FILE}
    problems += [problem for problem in absent_listed_files(directory, sums)
                 if problem.file not in reported_missing]
    side_files = set(side_files_of(checkpoint)) if checkpoint is not None else set()
    for name in sorted(known & present - side_files - set(sums)):
        problems.append(Problem(Rule.NOT_CHECKSUMMED, "file is not listed in SHA256SUMS", name))
    return problems

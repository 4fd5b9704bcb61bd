"""Re-encode every item of a checkpoint with another codec: compress and decompress are this.

The codec names, zstd levels and defaults that compress takes are named here for the command
line (COMPRESSING_CODEC_NAMES, MIN_ZSTD_LEVEL..MAX_ZSTD_LEVEL, DEFAULT_ZSTD_LEVEL).

The plan is a pure function of the checkpoint and the target codec: which items, from which
byte ranges, into which output file and in what order, and whether each is copied as stored or
decoded and encoded again. Running it streams every item through the shared pipeline.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import time
from dataclasses import dataclass
from typing import Callable, Iterator

from dcpctl.errors import InvalidOptionError, UnsupportedLayoutError
from dcpctl.format.checkpoint.checksums import checksummed_files, read_sha256sums
from dcpctl.format.checkpoint.items import (DEFAULT_PIECE_BYTES, StoredSpan,
                                            iter_checked_stored_pieces, iter_item_pieces,
                                            iter_stored_pieces)
from dcpctl.format.checkpoint.locations import ExpectedTensor, ItemLocation, locate_item
from dcpctl.format.checkpoint.publishing import (CheckpointOutput, DataFileSet, WrittenShare,
                                                 merge_shares, storage_with)
from dcpctl.format.checkpoint.side_files import carried_side_files
from dcpctl.format.checkpoint.view import SAFETENSORS, Checkpoint, open_checkpoint
from dcpctl.format.codecs.base import PayloadHint, iter_encoded
from dcpctl.format.codecs.names import ZSTD
from dcpctl.format.codecs.registry import (COMPRESSING_CODEC_NAMES, DEFAULT_ZSTD_LEVEL, IDENTITY,
                                           MAX_ZSTD_LEVEL, MIN_ZSTD_LEVEL, Codec, codec_by_name)
from dcpctl.execution.running import (checked_job_source, run_job, threads_per_worker,
                                      workers_started)
from dcpctl.format.metadata.records import MetadataIndex, StorageInfo
from dcpctl.pipeline import Pipeline, Run, coalesce, group_into_runs, produce_run
from dcpctl.storage.local import final_name_of
from dcpctl.storage.paths import (StoragePath, is_remote,
                                  remove_stale_temporaries, storage_path)

# The codec names and zstd levels are named here for the command line, which reaches the
# format only through the operations.
__all__ = ["COMPRESSING_CODEC_NAMES", "DEFAULT_ZSTD_LEVEL", "MAX_ZSTD_LEVEL", "MIN_ZSTD_LEVEL",
           "ZSTD", "TranscodeReport", "compress_checkpoint", "decompress_checkpoint",
           "execute_transcode", "plan_transcode", "transcode_checkpoint"]

# Called with (bytes just done, total bytes) as work advances.
ProgressCallback = Callable[[int, int], None]
HELD_PIECES = 8
"""Pieces (of the job's piece size) made and not yet written, at most, whatever the threads."""


@dataclass(frozen=True)
class ItemTask:
    """One item to carry into the output: copied as stored, or decoded and encoded again."""

    key: MetadataIndex
    source: StorageInfo
    """The item's entry in the source metadata, which its new entry copies."""
    location: ItemLocation
    output_file: str
    transcode: bool

    @property
    def payload(self) -> PayloadHint | None:
        """For tensor items: the dtype and size of the tensor's bytes, for codecs that split
        them."""
        expected = self.location.expected
        return None if expected is None else PayloadHint.of_contiguous(
            expected.dtype.name, expected.dtype.itemsize, expected.sizes)


@dataclass
class TranscodePlan:
    """Every item of a checkpoint, grouped by output file in source byte order."""

    codec: Codec
    recode_same_codec: bool
    tasks: list[ItemTask]

    @functools.cached_property
    def stored_bytes(self) -> int:
        """Bytes the items take in the source."""
        return sum(task.location.length for task in self.tasks)

    @functools.cached_property
    def output_file_bytes(self) -> dict[str, int]:
        """Each output file's name and the source bytes of its items, by name."""
        sizes: dict[str, int] = {}
        for task in self.tasks:
            sizes[task.output_file] = sizes.get(task.output_file, 0) + task.location.length
        return dict(sorted(sizes.items()))


@dataclass
class TranscodeReport:
    """What a compress or decompress did (or, with dry_run, would do)."""

    source: str
    output: str
    in_place: bool
    codec: str
    level: int | None
    dry_run: bool
    threads: int
    """Threads of each worker."""
    workers: int
    items: int
    items_transcoded: int
    items_copied: int
    stored_bytes_before: int
    stored_bytes_after: int | None
    seconds: float
    removed_stale_files: list[str]
    unchanged: bool = False
    """In place, with every item in the codec already (and no level asked) and every file
    certified by its SHA256SUMS (_nothing_to_rewrite): the checkpoint is left as it is, not
    rewritten for nothing (a full rewrite, and a new age for prune)."""

    @property
    def ratio(self) -> float | None:
        """Stored bytes after over before."""
        if self.stored_bytes_after is None or not self.stored_bytes_before:
            return None
        return self.stored_bytes_after / self.stored_bytes_before

    def to_json(self) -> dict:
        """A JSON-ready dict."""
        return {**dataclasses.asdict(self), "ratio": self.ratio,
                "bytes_per_second": (self.stored_bytes_before / self.seconds
                                     if self.seconds and not self.dry_run else None)}


def plan_transcode(checkpoint: Checkpoint, codec: Codec, recode_same_codec: bool) -> TranscodePlan:
    """Plan carrying every item into `codec`; items already in it are copied unless
    recode_same_codec (for instance to change the zstd level)."""
    if checkpoint.rank_metadata:
        raise UnsupportedLayoutError(
            f"saved with use_collectives=False ({checkpoint.rank_metadata[0]}, ...: each "
            "rank's own metadata, and no .metadata); compress and decompress keep a "
            "checkpoint's layout and do not rewrite this one. reshard reads it and writes it "
            "with one .metadata, which torch loads at any world size, in any codec: "
            f"`dcpctl reshard {checkpoint.path} --ranks {len(checkpoint.rank_metadata)} -o OUT "
            f"--codec {codec.name}`", path=checkpoint.path)
    for data_file in checkpoint.files.values():
        if data_file.serialization == SAFETENSORS:
            raise UnsupportedLayoutError(
                "SAFETENSORS-serialized data file; compress and decompress rewrite checkpoints "
                "saved with the default TORCH_SAVE layout. reshard reads this one and writes "
                f"that layout, in any codec: `dcpctl reshard {checkpoint.path} --ranks N -o OUT "
                "--codec zstd` (or floatsplit; none stores items uncompressed), N the world "
                "size to lay it out for", path=checkpoint.path / data_file.name)
    expected = {(tensor.fqn, tuple(chunk.offsets)): ExpectedTensor(tensor.dtype, tuple(chunk.sizes))
                for tensor in checkpoint.tensors for chunk in tensor.chunks}
    storage_data = checkpoint.metadata.storage_data or {}
    ordered = sorted(storage_data.items(),
                     key=lambda item: (item[1].relative_path, item[1].offset))
    tasks = []
    for key, info in ordered:
        location = locate_item(checkpoint, key.fqn, info, expected.get((key.fqn, key.offset)))
        same_codec = location.codec.descriptors == codec.descriptors
        tasks.append(ItemTask(key, info, location, final_name_of(info.relative_path),
                              transcode=not same_codec or (recode_same_codec and
                                                           bool(codec.descriptors))))
    return TranscodePlan(codec, recode_same_codec, tasks)


def _produce(codec: Codec, piece_bytes: int) -> Callable[[Run[ItemTask]], Iterator[bytes]]:
    def item_pieces(task: ItemTask, span: StoredSpan | None) -> Iterator[bytes]:
        if not task.transcode:
            yield from iter_checked_stored_pieces(
                task.location, iter_stored_pieces(task.location, piece_bytes, span))
            return
        known_size = task.location.length if not task.location.codec.descriptors else None
        yield from iter_encoded(codec.new_encoder(known_size, task.payload),
                                iter_item_pieces(task.location, piece_bytes, span))

    def produce(run: Run[ItemTask]) -> Iterator[bytes]:
        first, last = run.tasks[0].location, run.tasks[-1].location
        span = (StoredSpan(first.path, first.start, last.start + last.length, first.fqn)
                if len(run.tasks) > 1 else None)
        # decoders hand out pieces of at most one zstd block, a run many small items: the
        # writer wants fewer, larger pieces; an encoder's output of a whole piece passes as it
        # is (joined to the next, both and their join would be held at once)
        return coalesce(produce_run(run, lambda task: item_pieces(task, span)),
                        piece_bytes // 4)

    return produce


def _back_to_back(before: ItemTask, after: ItemTask) -> bool:
    """Whether after's stored bytes follow before's in the same source file."""
    return (after.location.path == before.location.path
            and after.location.start == before.location.start + before.location.length)


def group_items_into_runs(tasks: list[ItemTask], max_bytes: int) -> list[Run[ItemTask]]:
    """Runs of items that lie back to back in one source file and go to one output file, read
    with one read and written with few writes."""
    return group_into_runs(tasks, lambda task: task.output_file,
                           lambda task: task.location.length, max_bytes, _back_to_back)


@dataclass(frozen=True)
class TranscodePlanning:
    """What a transcode's plan is a pure function of (execution/jobs.py), known before anything
    is read: a worker plans it while the command checks the checkpoint."""

    source: str
    codec: Codec
    recode_same_codec: bool

    def plan(self) -> TranscodePlan:
        return self.plan_for(open_checkpoint(self.source, check_files=False))

    def plan_for(self, checkpoint: Checkpoint) -> TranscodePlan:
        """The plan, for the checkpoint at source opened already."""
        return plan_transcode(checkpoint, self.codec, self.recode_same_codec)


@dataclass(frozen=True)
class TranscodeJob:
    """A transcode's work, for any process to do a share of (execution/jobs.py): its lanes
    are the output files, sized by the stored bytes of their items."""

    planning: TranscodePlanning
    files: DataFileSet
    threads: int
    piece_bytes: int = DEFAULT_PIECE_BYTES

    def lane_sizes(self, plan: TranscodePlan) -> list[int]:
        return list(plan.output_file_bytes.values())

    def run_share(self, plan: TranscodePlan, lanes: list[int], advance: Callable[[int], None]
                  ) -> WrittenShare:
        names = list(plan.output_file_bytes)
        mine = {names[lane] for lane in lanes}
        tasks = [task for task in plan.tasks if task.output_file in mine]
        storage = _write_items(tasks, plan.codec, self.files, self.threads, advance,
                               self.piece_bytes)
        return WrittenShare(storage, self.files.finish_data_files())


def _write_items(tasks: list[ItemTask], codec: Codec, files: DataFileSet, threads: int,
                 advance: Callable[[int], None], piece_bytes: int
                 ) -> dict[MetadataIndex, StorageInfo]:
    """Write the tasks' items into their output files; their new storage records."""
    new_storage: dict[MetadataIndex, StorageInfo] = {}
    runs = group_items_into_runs(tasks, piece_bytes)
    last_run_of_file = {run.lane: run for run in runs}

    def consume(run: Run[ItemTask], pieces: Iterator[bytes]) -> None:
        writer = files.data_file(run.lane)
        offset = writer.size_bytes
        for piece in pieces:
            writer.write(piece)
        for task, length in zip(run.tasks, run.produced_bytes, strict=True):
            descriptors = codec.descriptors if task.transcode else \
                task.location.codec.descriptors
            new_storage[task.key] = storage_with(task.source, run.lane, offset, length,
                                                 descriptors)
            offset += length
        if last_run_of_file[run.lane] is run:  # files stay few at a time open
            files.finish_data_file(run.lane)
        advance(run.size_bytes)

    # held pieces: four per thread, but no more than HELD_PIECES (in an object store, many
    # threads wait on the network; their number should not multiply memory)
    pipeline = Pipeline(_produce(codec, piece_bytes), threads=threads,
                        bytes_in_flight=min(4 * threads, HELD_PIECES) * piece_bytes)
    pipeline.run(runs, consume, lane_of=lambda run: run.lane)
    return new_storage


def execute_transcode(planning: TranscodePlanning, plan: TranscodePlan, checkpoint: Checkpoint,
                      output: CheckpointOutput, threads: int,
                      on_progress: ProgressCallback | None = None,
                      piece_bytes: int = DEFAULT_PIECE_BYTES, workers: int = 1) -> int:
    """Write every item of the plan (of planning) into output, on `workers` processes (or the
    ranks of a torchrun job), and publish it; returns the stored bytes after."""
    job = TranscodeJob(planning, output.data_files(plan.output_file_bytes), threads,
                       piece_bytes)
    new_storage, digests = merge_shares(run_job(job, plan, workers, on_progress))
    in_plan_order = {task.key: new_storage[task.key] for task in plan.tasks}
    output.publish(dataclasses.replace(checkpoint.metadata, storage_data=in_plan_order),
                   digests, replaced_files=frozenset(checkpoint.files))
    return sum(info.length for info in new_storage.values())


def transcode_checkpoint(path: str | os.PathLike, codec: Codec, output_path: str | None = None,
                         recode_same_codec: bool = False, threads: int | None = None,
                         dry_run: bool = False, overwrite: bool = False,
                         on_progress: ProgressCallback | None = None,
                         workers: int = 1) -> TranscodeReport:
    """Rewrite the checkpoint at path with every item in `codec`, into output_path or in place
    (holding the checkpoint: exclusively in place, shared otherwise), on `workers` processes of
    `threads` threads each."""
    source = storage_path(path)
    in_place = output_path is None or _same_directory(source, storage_path(output_path))
    planning = TranscodePlanning(str(source), codec, recode_same_codec)
    started_workers = 1 if dry_run else workers
    with workers_started(started_workers), \
            checked_job_source(path, None if dry_run else planning, threads, started_workers,
                               on_progress, exclusive=in_place and not dry_run) as checkpoint:
        return _transcode(checkpoint, planning, output_path, in_place,
                          threads_per_worker(threads, checkpoint.path, workers), workers,
                          dry_run, overwrite, on_progress)


def _transcode(checkpoint: Checkpoint, planning: TranscodePlanning, output_path: str | None,
               in_place: bool, threads: int, workers: int, dry_run: bool, overwrite: bool,
               on_progress: ProgressCallback | None) -> TranscodeReport:
    started = time.perf_counter()
    path = checkpoint.path
    codec = planning.codec
    plan = planning.plan_for(checkpoint)
    report = TranscodeReport(
        source=str(path), output=str(path if in_place else output_path), in_place=in_place,
        codec=codec.name, level=codec.level, dry_run=dry_run, threads=threads, workers=workers,
        items=len(plan.tasks), items_transcoded=sum(t.transcode for t in plan.tasks),
        items_copied=sum(not t.transcode for t in plan.tasks),
        stored_bytes_before=plan.stored_bytes, stored_bytes_after=None, seconds=0.0,
        removed_stale_files=[], unchanged=in_place and _nothing_to_rewrite(checkpoint, plan))
    if dry_run:
        return report
    if in_place:
        referenced = {info.relative_path for info in checkpoint.metadata.storage_data.values()}
        report.removed_stale_files = remove_stale_temporaries(checkpoint.path, referenced)
    if report.unchanged:
        report.stored_bytes_after = plan.stored_bytes
        return report
    output = CheckpointOutput(storage_path(report.output), in_place, checkpoint.path,
                              overwrite=overwrite, side_files=carried_side_files(checkpoint))
    try:
        report.stored_bytes_after = execute_transcode(planning, plan, checkpoint, output,
                                                      threads, on_progress, workers=workers)
    except BaseException:
        output.abort()
        raise
    report.seconds = time.perf_counter() - started
    return report


def _nothing_to_rewrite(checkpoint: Checkpoint, plan: TranscodePlan) -> bool:
    """Whether rewriting the checkpoint in place would write it back as it is: every item in
    the codec already, in a file of its final name (a rewrite gives the temporary names an
    interrupted run left theirs), and every file certified by the SHA256SUMS that opening it
    just checked (without one, the rewrite is what reads and checks every item)."""
    if any(task.transcode or task.output_file != task.source.relative_path
           for task in plan.tasks):
        return False
    sums = read_sha256sums(checkpoint.path)
    return sums is not None and all(name in sums for name in checksummed_files(checkpoint))


def _same_directory(first: StoragePath, second: StoragePath) -> bool:
    if is_remote(first) or is_remote(second):
        return first == second
    return second.exists() and os.path.samefile(first, second)


def compress_checkpoint(path: str | os.PathLike, codec_name: str = ZSTD,
                        level: int | None = None, output_path: str | None = None,
                        **options) -> TranscodeReport:
    """`dcpctl compress`: every item in the codec called codec_name (COMPRESSING_CODEC_NAMES).
    Items already in it are copied as they are unless a level is given, which re-codes them
    at that level. Other options as transcode_checkpoint takes them."""
    if codec_name not in COMPRESSING_CODEC_NAMES:
        raise InvalidOptionError(f"compress writes {', '.join(COMPRESSING_CODEC_NAMES)}, not "
                                 f"{codec_name!r} (decompress stores items as they are)")
    codec = codec_by_name(codec_name, DEFAULT_ZSTD_LEVEL if level is None else level)
    return transcode_checkpoint(path, codec, output_path, recode_same_codec=level is not None,
                                **options)


def decompress_checkpoint(path: str | os.PathLike, output_path: str | None = None,
                          **options) -> TranscodeReport:
    """`dcpctl decompress`: every item stored as it decodes, byte for byte as torch saved it.
    Options as transcode_checkpoint takes them."""
    return transcode_checkpoint(path, IDENTITY, output_path, **options)

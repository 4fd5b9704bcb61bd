"""Running a reshard plan (planning.py): each output chunk assembled from the overlapping byte
ranges of the input payloads (assembly.py) goes out through the shared ordered pipeline into
its rank file; the metadata naming them is published last.
"""

from __future__ import annotations

import dataclasses
import os
import resource
import time
from collections import Counter
from dataclasses import dataclass
from typing import Callable, Iterator

from dcpctl.cycle_collector import paused_cycle_collector
from dcpctl.format.checkpoint.mesh_sharding import Mesh, MeshPlacement, parse_mesh
from dcpctl.format.checkpoint.items import (DEFAULT_PIECE_BYTES, iter_checked_stored_pieces,
                                            iter_item_pieces, iter_stored_pieces)
from dcpctl.format.checkpoint.payloads import PayloadReader, open_payload_reader
from dcpctl.execution.running import (checked_job_source, run_job, threads_per_worker,
                                      workers_started)
from dcpctl.format.checkpoint.publishing import (CheckpointOutput, DataFileSet, WrittenShare,
                                                 merge_shares)
from dcpctl.format.checkpoint.rank_metadata import replicated_keys
from dcpctl.format.checkpoint.side_files import carried_side_files
from dcpctl.format.checkpoint.view import Checkpoint, open_checkpoint
from dcpctl.format.codecs.base import PayloadHint, iter_encoded
from dcpctl.format.codecs.registry import CODEC_NAMES, Codec, codec_by_name
from dcpctl.format.metadata.records import ChunkMetadata, MetadataIndex, StorageInfo
from dcpctl.ops.reshard.assembly import chunk_archive
from dcpctl.ops.reshard.planning import (KEEP, PER_RANK_OBJECT_CHOICES, ChunkTask, ObjectTask,
                                         PerRankObjects, ReshardPlan, group_tasks_into_runs,
                                         plan_reshard)
from dcpctl.pipeline import Pipeline, Run, coalesce, produce_run
from dcpctl.storage.local import scratch_directory_beside
from dcpctl.storage.paths import storage_path

# The codec names and the mesh are named here for the command line, which reaches the format
# only through the operations.
__all__ = ["CODEC_NAMES", "PER_RANK_OBJECT_CHOICES", "Mesh", "ReshardReport", "execute_reshard",
           "parse_mesh", "reshard_checkpoint"]

# Pieces smaller than this are joined before they reach the writer: a run's archives come as
# many small pieces, and per-piece costs (a write and a hash update, each a hand-over of the
# GIL) add up over many chunks.
_COALESCE_BYTES = 1 << 20


@dataclass
class ReshardReport:
    """What a reshard wrote."""

    source: str
    output: str
    world_size: int
    codec: str
    tensors: int
    chunks_written: int
    objects: int
    files: int
    logical_bytes: int
    stored_bytes_after: int
    seconds: float
    per_rank_objects: PerRankObjects | None = None
    items_several_ranks_saved: int = 0
    """Of a source saved with use_collectives=False: the items several of its ranks saved,
    each written from the lowest rank's copy (rank_metadata.py)."""
    mesh: str | None = None
    """For a 2-D target (`--mesh`): `DPxTP`."""
    placements: dict[str, int] | None = None
    """For a 2-D target: how many sharded tensors keep each placement over the tensor-parallel
    ranks (`replicated`, `dim 0`, `dim 1`, ...; `(replicated over data parallel)` where FSDP2
    did not shard it)."""

    def to_json(self) -> dict:
        """A JSON-ready dict."""
        return dataclasses.asdict(self)


def _produce(plan: ReshardPlan, reader: PayloadReader,
             piece_bytes: int) -> Callable[[Run[ChunkTask | ObjectTask]], Iterator[bytes]]:
    def encoded(pieces: Iterator[bytes], size_bytes: int | None,
                payload: PayloadHint | None) -> Iterator[bytes]:
        return iter_encoded(plan.codec.new_encoder(size_bytes, payload), pieces)

    def produce(task: ChunkTask | ObjectTask) -> Iterator[bytes]:
        if isinstance(task, ObjectTask):
            if task.location.codec.descriptors == plan.codec.descriptors:
                yield from iter_checked_stored_pieces(
                    task.location, iter_stored_pieces(task.location, piece_bytes))
            else:
                yield from encoded(iter_item_pieces(task.location, piece_bytes), None, None)
            return
        try:
            pieces, size_bytes = chunk_archive(task, reader, piece_bytes)
            if plan.codec.descriptors:  # stored as they are: the archive's pieces themselves
                pieces = encoded(pieces, size_bytes, PayloadHint.of_contiguous(
                    task.dtype.name, task.dtype.itemsize, task.sizes))
            yield from pieces
        except BaseException:
            for source in task.sources:
                reader.release(source.location, completed=False)
            raise
        for source in task.sources:  # the last user of an input item checks its CRC-32
            reader.release(source.location)

    def produce_run_pieces(run: Run[ChunkTask | ObjectTask]) -> Iterator[bytes]:
        return coalesce(produce_run(run, produce), _COALESCE_BYTES)

    return produce_run_pieces


@paused_cycle_collector()
def _new_metadata(checkpoint: Checkpoint, plan: ReshardPlan,
                  storage_by_task: dict[int, StorageInfo]):
    dropped = set(plan.per_rank_objects.dropped if plan.per_rank_objects else ())
    entries = {fqn: entry for fqn, entry in checkpoint.metadata.state_dict_metadata.items()
               if fqn not in dropped}
    planner_data = checkpoint.metadata.planner_data
    if dropped and isinstance(planner_data, dict):
        planner_data = {fqn: path for fqn, path in planner_data.items() if fqn not in dropped}
    chunks_by_fqn: dict[str, list[ChunkMetadata]] = {}
    storage_data: dict[MetadataIndex, StorageInfo] = {}
    for index, task in enumerate(plan.tasks):
        if isinstance(task, ChunkTask):
            chunks_by_fqn.setdefault(task.fqn, []).append(ChunkMetadata(task.offsets, task.sizes))
            storage_data[MetadataIndex(task.fqn, task.offsets, 0)] = storage_by_task[index]
        else:
            storage_data[MetadataIndex(task.fqn)] = storage_by_task[index]
    for fqn, chunks in chunks_by_fqn.items():
        entries[fqn] = dataclasses.replace(entries[fqn], chunks=chunks)
    return dataclasses.replace(checkpoint.metadata, state_dict_metadata=entries,
                               planner_data=planner_data, storage_data=storage_data)


@dataclass(frozen=True)
class ReshardPlanning:
    """What a reshard's plan is a pure function of (execution/jobs.py), known before anything
    is read: a worker plans it while the command checks the checkpoint."""

    source: str
    world_size: int
    codec: Codec | None
    """None: the input's."""
    per_rank_objects: str = KEEP
    tensor_parallel: int = 1

    def plan(self) -> ReshardPlan:
        return self.plan_for(open_checkpoint(self.source, check_files=False))

    def plan_for(self, checkpoint: Checkpoint) -> ReshardPlan:
        """The plan, for the checkpoint at source opened already."""
        return plan_reshard(checkpoint, self.world_size, self.codec, self.per_rank_objects,
                            self.tensor_parallel)


@dataclass(frozen=True)
class ReshardJob:
    """A reshard's work, for any process to do a share of (execution/jobs.py): its lanes are
    the rank files, sized by the bytes of their items."""

    planning: ReshardPlanning
    files: DataFileSet
    scratch: str
    """The scratch directory for payloads decoded whole (storage/local.py)."""
    threads: int
    piece_bytes: int = DEFAULT_PIECE_BYTES

    def lane_sizes(self, plan: ReshardPlan) -> list[int]:
        return list(plan.output_file_bytes.values())

    def run_share(self, plan: ReshardPlan, lanes: list[int], advance: Callable[[int], None]
                  ) -> WrittenShare:
        """Write the share's rank files; their tasks' storage records, by index in the plan."""
        names = list(plan.output_file_bytes)
        mine = {names[lane] for lane in lanes}
        plan.locate_sources(mine)
        indexed = [(index, task) for index, task in enumerate(plan.tasks)
                   if task.output_file in mine]
        inputs = {source.location.path for _, task in indexed if isinstance(task, ChunkTask)
                  for source in task.sources}
        _allow_open_files(len(mine) + len(inputs) + 64)
        storage = _write_tasks(plan, indexed, self.files, self.scratch, self.threads, advance,
                               self.piece_bytes)
        return WrittenShare(storage, self.files.finish_data_files())


def _write_tasks(plan: ReshardPlan, indexed: list[tuple[int, ChunkTask | ObjectTask]],
                 files: DataFileSet, scratch: str, threads: int,
                 advance: Callable[[int], None], piece_bytes: int) -> dict[int, StorageInfo]:
    """Write the tasks (with their indexes in the plan) into their rank files; their storage
    records by index."""
    tasks = [task for _, task in indexed]
    users = Counter(source.location for task in tasks if isinstance(task, ChunkTask)
                    for source in task.sources)
    storage_by_task: dict[int, StorageInfo] = {}
    index_of = {id(task): index for index, task in indexed}

    def consume(run: Run[ChunkTask | ObjectTask], pieces: Iterator[bytes]) -> None:
        writer = files.data_file(run.lane)
        offset = writer.size_bytes
        for piece in pieces:
            writer.write(piece)
        for task, length in zip(run.tasks, run.produced_bytes, strict=True):
            keeps_stored = isinstance(task, ObjectTask) and (
                task.location.codec.descriptors == plan.codec.descriptors)
            storage_by_task[index_of[id(task)]] = StorageInfo(
                run.lane, offset, length, (task.location.codec.descriptors if keeps_stored
                                           else plan.codec.descriptors) or None)
            offset += length
        advance(run.size_bytes)

    with open_payload_reader(scratch, users) as reader:
        Pipeline(_produce(plan, reader, piece_bytes), threads=threads,
                 bytes_in_flight=4 * threads * piece_bytes).run(
                     group_tasks_into_runs(tasks, piece_bytes), consume,
                     lane_of=lambda run: run.lane)
    return storage_by_task


def execute_reshard(planning: ReshardPlanning, plan: ReshardPlan, checkpoint: Checkpoint,
                    output: CheckpointOutput, threads: int,
                    on_progress: Callable[[int, int], None] | None = None,
                    piece_bytes: int = DEFAULT_PIECE_BYTES, workers: int = 1) -> int:
    """Write every item of the plan (of planning) into output, on `workers` processes (or the
    ranks of a torchrun job), and publish it; returns the stored bytes after."""
    with scratch_directory_beside(output.directory) as scratch:
        job = ReshardJob(planning, output.data_files(plan.output_file_bytes), str(scratch),
                         threads, piece_bytes)
        storage_by_task, digests = merge_shares(run_job(job, plan, workers, on_progress))
    output.publish(_new_metadata(checkpoint, plan, storage_by_task), digests)
    return sum(info.length for info in storage_by_task.values())


def _allow_open_files(count: int) -> None:
    """Every rank file stays open while tensors are written in order; lift the soft limit on
    open files towards the hard one if that many would not fit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < count:
        wanted = count if hard == resource.RLIM_INFINITY else min(count, hard)
        resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))


def reshard_checkpoint(path: str | os.PathLike, world_size: int, output_path: str,
                       codec_name: str | None = None, threads: int | None = None,
                       overwrite: bool = False,
                       on_progress: Callable[[int, int], None] | None = None,
                       piece_bytes: int = DEFAULT_PIECE_BYTES, workers: int = 1,
                       per_rank_objects: str = KEEP, tensor_parallel: int = 1) -> ReshardReport:
    """Write the checkpoint at path laid out for world_size ranks into output_path, its items
    in the codec called codec_name (one of CODEC_NAMES; default: the input's), on `workers`
    processes of `threads` threads each; output chunks are assembled in blocks of about
    piece_bytes. per_rank_objects: one of PER_RANK_OBJECT_CHOICES (planning.py).
    tensor_parallel > 1: a 2-D mesh of world_size / tensor_parallel data-parallel ranks that
    keeps the source's tensor-parallel layout of that size."""
    started = time.perf_counter()
    source = storage_path(path)
    threads = threads_per_worker(threads, source, workers)
    codec = codec_by_name(codec_name) if codec_name is not None else None
    destination = storage_path(output_path)
    planning = ReshardPlanning(str(source), world_size, codec, per_rank_objects, tensor_parallel)
    with workers_started(workers), \
            checked_job_source(path, planning, threads, workers, on_progress) as checkpoint:
        # Each share locates the sources of its own files before it writes (run_share): a
        # worker need not wait while this process locates the other shares' sources.
        plan = planning.plan_for(checkpoint)
        output = CheckpointOutput(destination, in_place=False, source=checkpoint.path,
                                  overwrite=overwrite, side_files=carried_side_files(checkpoint))
        try:
            stored = execute_reshard(planning, plan, checkpoint, output, threads, on_progress,
                                     piece_bytes, workers)
        except BaseException:
            output.abort()
            raise
    chunk_tasks = [task for task in plan.tasks if isinstance(task, ChunkTask)]
    return ReshardReport(
        source=str(path), output=str(destination), world_size=world_size, codec=plan.codec.name,
        tensors=len(checkpoint.tensors), chunks_written=len(chunk_tasks),
        objects=len(plan.tasks) - len(chunk_tasks),
        files=len({task.output_file for task in plan.tasks}),
        logical_bytes=sum(task.nbytes for task in chunk_tasks), stored_bytes_after=stored,
        seconds=time.perf_counter() - started, per_rank_objects=plan.per_rank_objects,
        items_several_ranks_saved=len(replicated_keys(checkpoint.replicas)),
        mesh=str(plan.mesh) if plan.mesh else None,
        placements=_count_placements(plan.placements))


def _count_placements(placements: dict[str, MeshPlacement] | None) -> dict[str, int] | None:
    """How many tensors keep each placement."""
    if placements is None:
        return None
    return dict(sorted(Counter(map(str, placements.values())).items()))

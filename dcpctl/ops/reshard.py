"""Lay a checkpoint out for a new world size, as a real N-rank FSDP2 save would write it.

The plan, a pure function of the checkpoint and N, gives every output chunk (`Shard(0)` with
torch.chunk semantics, format/sharding.py), the input chunks that overlap it and the rank
file it goes to. Running it assembles each output chunk from the overlapping byte ranges of the
input payloads, read straight into place, as a torch.save archive that goes out through the
shared ordered pipeline. A chunk of up to a piece (4 MiB) is built whole in one buffer, so its
bytes are copied once; a larger one streams in blocks of rows, never whole in memory.
"""

from __future__ import annotations

import dataclasses
import math
import os
import resource
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import numpy

from dcpctl.errors import InvalidOptionError, UnsupportedLayoutError
from dcpctl.format.checkpoint.items import (DEFAULT_PIECE_BYTES, ItemLocation, iter_item_pieces,
                                            iter_stored_pieces, locate_chunk, locate_object)
from dcpctl.format.checkpoint.payloads import PayloadReader, open_payload_reader
from dcpctl.format.checkpoint.publishing import CheckpointOutput
from dcpctl.format.checkpoint.sharding import shard_dim0_chunks
from dcpctl.format.checkpoint.view import SAFETENSORS, Checkpoint, TensorEntry, open_checkpoint
from dcpctl.format.codecs.base import PayloadHint, iter_encoded
# Named here for the command line, which reaches the format only through the operations.
from dcpctl.format.codecs.registry import CODEC_NAMES  # noqa: F401
from dcpctl.format.codecs.registry import Codec, codec_by_name, codec_for_descriptors
from dcpctl.format.dtypes import DType
from dcpctl.format.file_names import rank_file_name
from dcpctl.format.metadata.records import ChunkMetadata, MetadataIndex, StorageInfo
from dcpctl.format.torch_save.writer import iter_torch_save_archive, torch_save_archive
from dcpctl.pipeline import (Pipeline, Run, coalesce, default_thread_count, group_into_runs,
                             produce_run)

# Pieces smaller than this are joined before they reach the writer: a run's archives come as
# many small pieces, and per-piece costs (a write and a hash update, each a hand-over of the
# GIL) add up over many chunks.
_COALESCE_BYTES = 1 << 20
# Runs are formed within windows of this many bytes of tasks in plan order (see
# group_tasks_into_runs).
_WINDOW_BYTES = 64 << 20


@dataclass(frozen=True, slots=True)
class SourceChunk:
    """An input chunk that overlaps an output chunk."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    location: ItemLocation
    raw_tensor: bool


@dataclass(frozen=True, slots=True)
class ChunkTask:
    """One output chunk of a tensor: where it lies, from which input chunks, into which file."""

    fqn: str
    dtype: DType
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    sources: tuple[SourceChunk, ...]
    output_file: str

    @property
    def nbytes(self) -> int:
        """Bytes of the chunk's elements."""
        return math.prod(self.sizes) * self.dtype.itemsize


@dataclass(frozen=True, slots=True)
class ObjectTask:
    """A non-tensor item, carried over as stored into rank 0's file."""

    fqn: str
    location: ItemLocation
    output_file: str


@dataclass
class ReshardPlan:
    """Every output item in write order, and the codec they are written with."""

    world_size: int
    codec: Codec
    tasks: list[ChunkTask | ObjectTask]


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

    def to_json(self) -> dict:
        """A JSON-ready dict."""
        return dataclasses.asdict(self)


def plan_reshard(checkpoint: Checkpoint, world_size: int, codec: Codec | None = None
                 ) -> ReshardPlan:
    """Plan the output of a world_size-rank save of the checkpoint's state."""
    if world_size < 1:
        raise InvalidOptionError(f"--ranks must be at least 1, not {world_size}")
    codec = codec or _input_codec(checkpoint)
    tasks: list[ChunkTask | ObjectTask] = []
    for tensor in checkpoint.tensors:
        sources = _SourceChunks(checkpoint, tensor)
        for target in shard_dim0_chunks(tensor.shape, world_size):
            tasks.append(ChunkTask(tensor.fqn, tensor.dtype, target.offsets, target.sizes,
                                   sources.overlapping(target.offsets, target.sizes),
                                   rank_file_name(target.rank)))
    for entry in checkpoint.objects:
        tasks.append(ObjectTask(entry.fqn, locate_object(checkpoint, entry), rank_file_name(0)))
    return ReshardPlan(world_size, codec, tasks)


def _input_codec(checkpoint: Checkpoint) -> Codec:
    used = Counter(info.transform_descriptors
                   for info in (checkpoint.metadata.storage_data or {}).values())
    if len(used) > 1:
        raise UnsupportedLayoutError(f"items use several codecs ({', '.join(map(str, used))}); "
                                     "pass --codec", path=checkpoint.path)
    return codec_for_descriptors(next(iter(used), None))


class _SourceChunks:
    """The input chunks of one tensor as sources, each made once however many output chunks
    it overlaps."""

    def __init__(self, checkpoint: Checkpoint, tensor: TensorEntry) -> None:
        self._checkpoint = checkpoint
        self._tensor = tensor
        self._made: dict[int, SourceChunk] = {}

    def overlapping(self, offsets: tuple[int, ...], sizes: tuple[int, ...]
                    ) -> tuple[SourceChunk, ...]:
        """The input chunks holding any of the output chunk's rows."""
        chunks = self._tensor.chunks
        if not offsets:  # 0-d: the one chunk there is
            return (self._source(0, chunks[0]),)
        begin, end = offsets[0], offsets[0] + sizes[0]
        return tuple(self._source(index, chunk) for index, chunk in enumerate(chunks)
                     if chunk.sizes[0] and math.prod(chunk.sizes) and (
                         chunk.offsets[0] < end and begin < chunk.offsets[0] + chunk.sizes[0]))

    def _source(self, index: int, chunk: ChunkMetadata) -> SourceChunk:
        source = self._made.get(index)
        if source is None:
            location = locate_chunk(self._checkpoint, self._tensor, chunk)
            raw = (self._checkpoint.files[chunk.storage.relative_path].serialization
                   == SAFETENSORS)
            source = self._made[index] = SourceChunk(chunk.offsets, chunk.sizes, location, raw)
        return source


def _row_blocks(task: ChunkTask, piece_bytes: int) -> Iterator[tuple[int, int]]:
    """Absolute [first, last) row ranges of at most piece_bytes each (a whole row at least)."""
    if not task.offsets:
        yield 0, 1
        return
    row_bytes = task.nbytes // task.sizes[0] if task.sizes[0] else 0
    if not row_bytes:
        return
    step = max(1, piece_bytes // row_bytes)
    first, stop = task.offsets[0], task.offsets[0] + task.sizes[0]
    for begin in range(first, stop, step):
        yield begin, min(begin + step, stop)


def _fill_rows(task: ChunkTask, begin: int, end: int, reader: PayloadReader,
               out: memoryview) -> None:
    """Write rows [begin, end) of the output chunk into out, from the overlapping input rows."""
    itemsize = task.dtype.itemsize
    if not task.offsets:
        source = task.sources[0]
        reader.read_into(reader.source_of(source.location, source.raw_tensor, task.dtype, ()),
                         0, out)
        return
    inner = task.sizes[1:]
    whole_rows = [s for s in task.sources if s.sizes[1:] == inner
                  and s.offsets[0] <= begin and end <= s.offsets[0] + s.sizes[0]]
    if whole_rows:  # one input chunk holds these rows whole: a single contiguous read
        source = whole_rows[0]
        row_bytes = math.prod(inner) * itemsize
        payload = reader.source_of(source.location, source.raw_tensor, task.dtype, source.sizes)
        reader.read_into(payload, (begin - source.offsets[0]) * row_bytes, out)
        return
    block = numpy.frombuffer(out, dtype=numpy.uint8).reshape((end - begin, *inner, itemsize))
    for source in task.sources:
        first = max(begin, source.offsets[0])
        last = min(end, source.offsets[0] + source.sizes[0])
        if first >= last:
            continue
        row_bytes = math.prod(source.sizes[1:]) * itemsize
        payload = reader.source_of(source.location, source.raw_tensor, task.dtype, source.sizes)
        rows = memoryview(numpy.empty((last - first) * row_bytes, dtype=numpy.uint8))
        reader.read_into(payload, (first - source.offsets[0]) * row_bytes, rows)
        region = (slice(first - begin, last - begin),) + tuple(
            slice(offset, offset + size) for offset, size in zip(source.offsets[1:],
                                                                 source.sizes[1:]))
        block[region] = numpy.frombuffer(rows, dtype=numpy.uint8).reshape(
            (last - first, *source.sizes[1:], itemsize))


def _read_rows(task: ChunkTask, begin: int, end: int, reader: PayloadReader) -> memoryview:
    """Rows [begin, end) of the output chunk, in a buffer of their own."""
    row_bytes = task.nbytes // task.sizes[0] if task.offsets else task.nbytes  # 0-d: one "row"
    out = memoryview(numpy.empty((end - begin) * row_bytes, dtype=numpy.uint8))
    _fill_rows(task, begin, end, reader, out)
    return out


def _chunk_archive(task: ChunkTask, reader: PayloadReader, piece_bytes: int
                   ) -> tuple[Iterator[bytes], int | None]:
    """The output chunk's torch.save archive as pieces, and its size when known: a chunk of up
    to piece_bytes comes whole in one buffer, its rows read straight into place."""
    if task.nbytes <= piece_bytes:
        first_row = task.offsets[0] if task.offsets else 0
        last_row = first_row + (task.sizes[0] if task.offsets else 1)
        archive = torch_save_archive(task.dtype, task.sizes, lambda payload: _fill_rows(
            task, first_row, last_row, reader, payload))
        return iter([archive]), len(archive)
    rows = (_read_rows(task, begin, end, reader) for begin, end in _row_blocks(task, piece_bytes))
    return iter_torch_save_archive(task.dtype, task.sizes, rows), None


def _produce(plan: ReshardPlan, reader: PayloadReader,
             piece_bytes: int) -> Callable[[Run[ChunkTask | ObjectTask]], Iterator[bytes]]:
    def encoded(pieces: Iterator[bytes], size_bytes: int | None,
                payload: PayloadHint | None) -> Iterator[bytes]:
        return iter_encoded(plan.codec.new_encoder(size_bytes, payload), pieces)

    def produce(task: ChunkTask | ObjectTask) -> Iterator[bytes]:
        if isinstance(task, ObjectTask):
            if task.location.codec.descriptors == plan.codec.descriptors:
                yield from iter_stored_pieces(task.location, piece_bytes)
            else:
                yield from encoded(iter_item_pieces(task.location, piece_bytes), None, None)
            return
        try:
            yield from encoded(*_chunk_archive(task, reader, piece_bytes),
                               PayloadHint(task.dtype.name, task.nbytes))
        finally:
            for source in task.sources:
                reader.release(source.location)

    def produce_run_pieces(run: Run[ChunkTask | ObjectTask]) -> Iterator[bytes]:
        return coalesce(produce_run(run, produce), _COALESCE_BYTES)

    return produce_run_pieces


def _task_bytes(task: ChunkTask | ObjectTask) -> int:
    return task.nbytes if isinstance(task, ChunkTask) else task.location.length


def group_tasks_into_runs(tasks: list[ChunkTask | ObjectTask], max_bytes: int,
                          window_bytes: int = _WINDOW_BYTES) -> list[Run[ChunkTask | ObjectTask]]:
    """Runs of tasks of one output file, of at most max_bytes. Tasks are taken in windows of
    about window_bytes, each window's tasks grouped by output file (plan order kept within a
    file, so the output is the same): runs form for every rank file, while the users of an
    input item stay close in time, and a spooled item goes once they are done."""
    ordered: list[ChunkTask | ObjectTask] = []
    window: list[ChunkTask | ObjectTask] = []
    gathered = 0
    for task in tasks:
        window.append(task)
        gathered += _task_bytes(task)
        if gathered >= window_bytes:
            ordered += sorted(window, key=lambda task: task.output_file)
            window, gathered = [], 0
    ordered += sorted(window, key=lambda task: task.output_file)
    return group_into_runs(ordered, lambda task: task.output_file, _task_bytes, max_bytes)


def _new_metadata(checkpoint: Checkpoint, plan: ReshardPlan,
                  storage_by_task: dict[int, StorageInfo]):
    entries = dict(checkpoint.metadata.state_dict_metadata)
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
                               storage_data=storage_data)


def execute_reshard(plan: ReshardPlan, checkpoint: Checkpoint, output: CheckpointOutput,
                    threads: int, on_progress: Callable[[int, int], None] | None = None,
                    piece_bytes: int = DEFAULT_PIECE_BYTES) -> int:
    """Write every planned item into output and publish it; returns the stored bytes after."""
    users = Counter(source.location for task in plan.tasks if isinstance(task, ChunkTask)
                    for source in task.sources)
    storage_by_task: dict[int, StorageInfo] = {}
    index_of = {id(task): index for index, task in enumerate(plan.tasks)}
    total = sum(map(_task_bytes, plan.tasks))

    def consume(run: Run[ChunkTask | ObjectTask], pieces: Iterator[bytes]) -> None:
        writer = output.data_file(run.lane)
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
        if on_progress is not None:
            on_progress(run.size_bytes, total)

    with open_payload_reader(output.destination, users) as reader:
        Pipeline(_produce(plan, reader, piece_bytes), threads=threads,
                 bytes_in_flight=4 * threads * piece_bytes).run(
                     group_tasks_into_runs(plan.tasks, piece_bytes), consume,
                     lane_of=lambda run: run.lane)
    output.finish_data_files()
    output.publish(_new_metadata(checkpoint, plan, storage_by_task))
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
                       piece_bytes: int = DEFAULT_PIECE_BYTES) -> ReshardReport:
    """Write the checkpoint at path laid out for world_size ranks into output_path, its items
    in the codec called codec_name (one of CODEC_NAMES; default: the input's); output chunks
    are assembled in blocks of about piece_bytes."""
    started = time.perf_counter()
    threads = threads or default_thread_count()
    codec = codec_by_name(codec_name) if codec_name is not None else None
    checkpoint = open_checkpoint(path)
    plan = plan_reshard(checkpoint, world_size, codec)
    _allow_open_files(world_size + len(checkpoint.files) + 64)
    destination = Path(output_path)
    if destination.exists() and os.path.samefile(destination, checkpoint.path):
        raise InvalidOptionError("reshard writes a new checkpoint; the output must be another "
                                 "directory", path=destination)
    output = CheckpointOutput(destination, in_place=False, overwrite=overwrite)
    try:
        stored = execute_reshard(plan, checkpoint, output, threads, on_progress, piece_bytes)
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
        seconds=time.perf_counter() - started)

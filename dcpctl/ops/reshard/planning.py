"""The plan of a reshard: every output chunk of a world_size-rank save (`Shard(0)` with
torch.chunk semantics, format/checkpoint/sharding.py), the input chunks that overlap it and the
rank file it goes to; and how its tasks are grouped into runs for the pipeline. A pure function
of the checkpoint and the target."""

from __future__ import annotations

import functools
import math
from collections import Counter
from dataclasses import dataclass

from dcpctl.errors import UnsupportedLayoutError
from dcpctl.format.checkpoint.locations import ItemLocation, locate_chunk, locate_object
from dcpctl.format.checkpoint.sharding import check_world_size, shard_dim0_chunks
from dcpctl.format.checkpoint.view import Checkpoint, TensorEntry
from dcpctl.format.codecs.registry import Codec, codec_for_descriptors
from dcpctl.format.dtypes import DType
from dcpctl.format.file_names import rank_file_name
from dcpctl.format.metadata.records import ChunkMetadata
from dcpctl.pipeline import Run, group_into_runs

# Runs are formed within windows of this many bytes of tasks in plan order (see
# group_tasks_into_runs).
_WINDOW_BYTES = 64 << 20


@dataclass(frozen=True, slots=True)
class SourceChunk:
    """An input chunk that overlaps an output chunk."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    location: ItemLocation


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

    @functools.cached_property
    def output_file_bytes(self) -> dict[str, int]:
        """Each rank file's name and the bytes of its items, by name."""
        sizes: dict[str, int] = {}
        for task in self.tasks:
            sizes[task.output_file] = sizes.get(task.output_file, 0) + task_bytes(task)
        return dict(sorted(sizes.items()))


def plan_reshard(checkpoint: Checkpoint, world_size: int, codec: Codec | None = None
                 ) -> ReshardPlan:
    """Plan the output of a world_size-rank save of the checkpoint's state."""
    check_world_size(world_size)
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
            source = self._made[index] = SourceChunk(chunk.offsets, chunk.sizes, location)
        return source


def task_bytes(task: ChunkTask | ObjectTask) -> int:
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
        gathered += task_bytes(task)
        if gathered >= window_bytes:
            ordered += sorted(window, key=lambda task: task.output_file)
            window, gathered = [], 0
    ordered += sorted(window, key=lambda task: task.output_file)
    return group_into_runs(ordered, lambda task: task.output_file, task_bytes, max_bytes)

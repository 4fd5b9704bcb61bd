"""The plan of a reshard: every output item of a world_size-rank save, the input chunks that
overlap it and the rank file it goes to; and how its tasks are grouped into runs for the
pipeline. A pure function of the checkpoint and the target.

What a real save writes (format/checkpoint/sharding.py): sharded tensors split as FSDP2 splits
them (`Shard(0)`, torch.chunk semantics); a tensor that was never sharded (in a save of several
ranks, one chunk that covers it: a buffer, an RNG state, a counter; and any 0-d tensor) whole
and once, and objects once, each on the rank file DCP's deduplication picks; a per-rank object
(torchtitan's `dataloader.dp_rank_<r>`) on its own rank's file, kept, dropped or refused by
choice when the new world size has no such rank or lacks one.

With a tensor-parallel size (`--mesh DPxTP`), the target is a 2-D mesh that keeps the source's
tensor-parallel layout (format/checkpoint/mesh_sharding.py): each tensor's placement is told
from its saved chunks, and only the data-parallel size changes.
"""

from __future__ import annotations

import bisect
import functools
import math
from collections import Counter
from dataclasses import dataclass, field
from typing import Collection, Sequence

from dcpctl.cycle_collector import paused_cycle_collector
from dcpctl.errors import UnsupportedLayoutError
from dcpctl.format.checkpoint.locations import ItemLocation, locate_chunk, locate_object
from dcpctl.format.checkpoint.mesh_sharding import Mesh, MeshPlacement
from dcpctl.format.checkpoint.sharding import RankChunk, check_world_size, place_like_a_save
from dcpctl.format.checkpoint.view import Checkpoint, ObjectEntry, TensorEntry
from dcpctl.format.codecs.registry import Codec, codec_for_descriptors
from dcpctl.format.dtypes import DType
from dcpctl.format.file_names import natural_order, rank_file_name
from dcpctl.format.metadata.records import ChunkMetadata
from dcpctl.format.state_dict_layouts import rank_of_per_rank_entry
from dcpctl.ops.reshard.target_layout import object_holders, target_chunks, target_mesh
from dcpctl.pipeline import Run, group_into_runs
from dcpctl.wording import listed

# Runs are formed within windows of this many bytes of tasks in plan order (see
# group_tasks_into_runs).
_WINDOW_BYTES = 64 << 20


@dataclass(slots=True)
class SourceChunk:
    """An input chunk that overlaps an output chunk."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    location: ItemLocation


@dataclass(slots=True)
class ChunkTask:
    """One output chunk of a tensor: where it lies, from which input chunks, into which file."""

    fqn: str
    dtype: DType
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    sources: tuple[SourceChunk, ...] | None
    """None until ReshardPlan.locate_sources gives them."""
    output_file: str

    @property
    def nbytes(self) -> int:
        """Bytes of the chunk's elements."""
        return math.prod(self.sizes) * self.dtype.itemsize


@dataclass(slots=True)
class ObjectTask:
    """A non-tensor item, carried over as stored into a rank file."""

    fqn: str
    location: ItemLocation
    output_file: str


KEEP, DROP, REFUSE = "keep", "drop", "refuse"
PER_RANK_OBJECT_CHOICES = (KEEP, DROP, REFUSE)
"""What a reshard does with per-rank objects where the new world size does not match them:
keep them (on their own rank's file, rank 0's past the new world size), leave them out, or
refuse to reshard."""


@dataclass(frozen=True)
class PerRankObjects:
    """The per-rank objects of a checkpoint and what the reshard did with them."""

    fqns: tuple[str, ...]
    ranks: tuple[int, ...]
    """The ranks they belong to, in order."""
    choice: str
    dropped: tuple[str, ...]
    ranks_without: tuple[int, ...]
    """The new ranks that have none of their own."""


@dataclass
class ReshardPlan:
    """Every output item in write order, the codec they are written with, and what became of
    the per-rank objects (None where there are none); for a 2-D target, its mesh and the
    placement each sharded tensor keeps, by fqn."""

    world_size: int
    codec: Codec
    tasks: list[ChunkTask | ObjectTask]
    per_rank_objects: PerRankObjects | None = None
    mesh: Mesh | None = None
    placements: dict[str, MeshPlacement] | None = None
    _sources_by_fqn: dict[str, _SourceChunks] = field(default_factory=dict, repr=False)

    @paused_cycle_collector()
    def locate_sources(self, files: Collection[str] | None = None) -> None:
        """Give the chunk tasks written into `files` (None: every file) the input chunks they
        are read from, where they have none yet. That reads no data, but it is a search per
        task and a lookup per input chunk: a worker locates only its own share's."""
        for index, task in enumerate(self.tasks):
            if (isinstance(task, ChunkTask) and task.sources is None
                    and (files is None or task.output_file in files)):
                sources = self._sources_by_fqn[task.fqn].overlapping(task.offsets, task.sizes)
                self.tasks[index] = ChunkTask(task.fqn, task.dtype, task.offsets, task.sizes,
                                              sources, task.output_file)

    @property
    def tensor_parallel(self) -> int:
        """The target's tensor-parallel size (1: a 1-D layout)."""
        return self.mesh.tensor_parallel if self.mesh else 1

    @functools.cached_property
    def output_file_bytes(self) -> dict[str, int]:
        """Each rank file's name and the bytes of its items, in rank order (neighbouring
        ranks are cut from the same input chunks: execution/shares.py)."""
        sizes: dict[str, int] = {}
        for task in self.tasks:
            sizes[task.output_file] = sizes.get(task.output_file, 0) + task_bytes(task)
        return {name: sizes[name] for name in sorted(sizes, key=natural_order)}


@paused_cycle_collector()
def plan_reshard(checkpoint: Checkpoint, world_size: int, codec: Codec | None = None,
                 per_rank_objects: str = KEEP, tensor_parallel: int = 1) -> ReshardPlan:
    """Plan the output of a world_size-rank save of the checkpoint's state, its chunk tasks'
    sources not located yet (ReshardPlan.locate_sources); per_rank_objects is one of
    PER_RANK_OBJECT_CHOICES. tensor_parallel > 1: a save from a 2-D mesh of
    world_size / tensor_parallel data-parallel ranks that keeps the source's tensor-parallel
    layout of that size."""
    check_world_size(world_size)
    if per_rank_objects not in PER_RANK_OBJECT_CHOICES:
        raise ValueError(f"per_rank_objects must be one of {PER_RANK_OBJECT_CHOICES}")
    mesh = target_mesh(world_size, tensor_parallel)
    codec = codec or _input_codec(checkpoint)
    per_rank = _per_rank_objects(checkpoint, mesh.data_parallel, per_rank_objects)
    chunks_of, placements = target_chunks(checkpoint, mesh)
    tensors = {tensor.fqn: tensor for tensor in checkpoint.tensors}
    objects = {entry.fqn: entry for entry in checkpoint.objects}
    planned: list[tuple[TensorEntry | ObjectEntry, RankChunk | None]] = []
    holders_and_sizes: list[tuple[Sequence[int], int]] = []
    for fqn in _state_dict_order(checkpoint):
        if fqn in tensors:
            tensor = tensors[fqn]
            for chunk in chunks_of(tensor):
                planned.append((tensor, chunk))
                holders_and_sizes.append((chunk.holders, tensor.nbytes))
        elif fqn in objects and fqn not in (per_rank.dropped if per_rank else ()):
            planned.append((objects[fqn], None))
            holders_and_sizes.append((object_holders(fqn, mesh), 0))
    placed = place_like_a_save(holders_and_sizes, world_size)
    tasks: list[ChunkTask | ObjectTask] = []
    sources_by_fqn: dict[str, _SourceChunks] = {}
    file_names = [rank_file_name(rank) for rank in range(world_size)]
    for (entry, chunk), rank in zip(planned, placed):
        if chunk is None:
            tasks.append(ObjectTask(entry.fqn, locate_object(checkpoint, entry),
                                    file_names[rank]))
            continue
        if entry.fqn not in sources_by_fqn:
            sources_by_fqn[entry.fqn] = _SourceChunks(checkpoint, entry)
        tasks.append(ChunkTask(entry.fqn, entry.dtype, chunk.offsets, chunk.sizes, None,
                               file_names[rank]))
    return ReshardPlan(world_size, codec, tasks, per_rank,
                       mesh if mesh.tensor_parallel > 1 else None, placements, sources_by_fqn)


def _state_dict_order(checkpoint: Checkpoint) -> list[str]:
    """The fqns in the order of the saved state dict, which is the order of each rank's save
    plan. `.metadata` lists them as the plans kept them after deduplication; its planner_data
    (torch's flattening of the state dict, merged over the ranks) lists rank 0's in state-dict
    order, then what later ranks add."""
    entries = checkpoint.metadata.state_dict_metadata
    planner_data = checkpoint.metadata.planner_data
    order = [fqn for fqn in planner_data if fqn in entries] if isinstance(
        planner_data, dict) else []
    listed = set(order)
    return order + [fqn for fqn in entries if fqn not in listed]


def _per_rank_objects(checkpoint: Checkpoint, world_size: int, choice: str
                      ) -> PerRankObjects | None:
    """The per-rank objects and what becomes of them at world_size data-parallel ranks (refused
    by choice)."""
    by_rank = {entry.fqn: rank for entry in checkpoint.objects
               if (rank := rank_of_per_rank_entry(entry.fqn)) is not None}
    if not by_rank:
        return None
    present = set(by_rank.values())
    ranks = tuple(sorted(present))
    ranks_without = tuple(rank for rank in range(world_size) if rank not in present)
    fits = not ranks_without and ranks[-1] < world_size
    if not fits and choice == REFUSE:
        raise UnsupportedLayoutError(
            f"holds per-rank objects of ranks {describe_ranks(ranks)} ({_fqns_text(by_rank)}), "
            f"which a {world_size}-rank job cannot take as they are; --per-rank-objects keep "
            "writes them anyway, drop leaves them out", path=checkpoint.path)
    if choice == DROP and not fits:
        return PerRankObjects(tuple(by_rank), ranks, choice, tuple(by_rank),
                              tuple(range(world_size)))
    return PerRankObjects(tuple(by_rank), ranks, choice, (), ranks_without)


def describe_ranks(ranks: tuple[int, ...]) -> str:
    """`2-1023` for a run of more than two ranks, else the ranks listed."""
    contiguous = ranks == tuple(range(ranks[0], ranks[-1] + 1))
    if contiguous and len(ranks) > 2:
        return f"{ranks[0]}-{ranks[-1]}"
    return ", ".join(map(str, ranks))


def _fqns_text(by_rank: dict[str, int]) -> str:
    return listed(list(by_rank), 2)


def _input_codec(checkpoint: Checkpoint) -> Codec:
    used = Counter(info.transform_descriptors
                   for info in (checkpoint.metadata.storage_data or {}).values())
    if len(used) > 1:
        raise UnsupportedLayoutError(f"items use several codecs ({', '.join(map(str, used))}); "
                                     "pass --codec", path=checkpoint.path)
    return codec_for_descriptors(next(iter(used), None))


class _SourceChunks:
    """The input chunks of one tensor as sources, each made once however many output chunks
    it overlaps. Its non-empty chunks are kept ordered by their first row, so an output chunk
    looks only at those whose rows can reach its own (binary search), not at every chunk: a
    tensor saved from a thousand ranks and resharded to a thousand is not a million checks."""

    def __init__(self, checkpoint: Checkpoint, tensor: TensorEntry) -> None:
        self._checkpoint = checkpoint
        self._tensor = tensor
        self._made: dict[int, SourceChunk] = {}
        chunks = tensor.chunks
        self._by_first_row = sorted(
            (index for index, chunk in enumerate(chunks) if chunk.offsets and math.prod(
                chunk.sizes)), key=lambda index: chunks[index].offsets[0])
        self._first_rows = [chunks[index].offsets[0] for index in self._by_first_row]
        self._most_rows = max((chunks[index].sizes[0] for index in self._by_first_row),
                              default=0)
        self._row_ends = [chunk.offsets[0] + chunk.sizes[0] if chunk.offsets else 0
                          for chunk in chunks]
        self._inner_origin = (0,) * (len(tensor.shape) - 1)
        self._inner_shape = tuple(tensor.shape[1:])

    def overlapping(self, offsets: tuple[int, ...], sizes: tuple[int, ...]
                    ) -> tuple[SourceChunk, ...]:
        """The input chunks holding any of the output chunk's elements, in metadata order."""
        chunks = self._tensor.chunks
        if not offsets:  # 0-d: the one chunk there is
            return (self._source(0, chunks[0]),)
        begin, end = offsets[0], offsets[0] + sizes[0]
        # A chunk reaches row `begin` only if it starts after begin - _most_rows.
        reaching = self._by_first_row[
            bisect.bisect_right(self._first_rows, begin - self._most_rows):
            bisect.bisect_left(self._first_rows, end)]
        row_ends = self._row_ends
        if offsets[1:] == self._inner_origin and sizes[1:] == self._inner_shape:
            # An output chunk of whole rows (FSDP2's) overlaps, past dim 0, every non-empty
            # chunk: only the rows tell.
            return tuple([self._source(index, chunks[index]) for index in sorted(reaching)
                          if begin < row_ends[index]])
        inner = [(offset, offset + size) for offset, size in zip(offsets[1:], sizes[1:])]
        found = []
        for index in sorted(reaching):
            chunk = chunks[index]
            if begin < row_ends[index] and all(
                    offset < last and first < offset + size for (first, last), offset, size
                    in zip(inner, chunk.offsets[1:], chunk.sizes[1:])):
                found.append(self._source(index, chunk))
        return tuple(found)

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

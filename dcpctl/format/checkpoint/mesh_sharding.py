"""Where a save from a 2-D (data-parallel x tensor-parallel) device mesh puts each tensor's
chunks, and which placement a saved tensor had.

The layout is torchtitan's and `init_device_mesh("cpu", (dp, tp))`'s: rank `d * tp + t` is
data-parallel rank d and tensor-parallel rank t. A tensor is sharded over the tensor-parallel
ranks on one dim (`Shard(dim)`: ColwiseParallel's dim 0, RowwiseParallel's dim 1) or
replicated over them; FSDP2 then shards each tensor-parallel rank's part on dim 0 over the
data-parallel ranks (`fully_shard(..., mesh=mesh["dp"])`), or they each hold it whole (DDP, or
a module left out of fully_shard). Where both shard dim 0, FSDP2 splits
the tensor-parallel part (torch's `_StridedShard`; see _strided_rows). Every split is
torch.chunk's: ceil(size / parts) per part, the last parts smaller or empty; an empty
chunk starts at the end of its dim (torch's compute_local_shape_and_global_offset).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Iterable

from dcpctl.errors import InvalidOptionError, UnsupportedLayoutError
from dcpctl.format.checkpoint.sharding import (MAX_WORLD_SIZE, RankChunk, check_world_size,
                                               shard_dim0_chunks)
from dcpctl.format.checkpoint.view import Checkpoint, TensorEntry
from dcpctl.format.file_names import rank_of_file_name, world_size_of_rank_files

# Telling each tensor's placement costs work in proportion to the source's world size, which
# the highest rank file number gives. torch writes a file for every rank, dcpctl's reshard for
# every rank that holds an item; a world size this many times the files is a name that claims
# ranks nobody saved, refused before that work.
_RANKS_PER_FILE_AT_MOST = 64

REPLICATED = None
"""The tensor-parallel dim of a tensor that every tensor-parallel rank holds whole."""


@dataclass(frozen=True)
class MeshPlacement:
    """How a tensor lies on a 2-D mesh: sharded on tensor_parallel_dim over the tensor-parallel
    ranks (REPLICATED: each holds it whole), and by FSDP2 on dim 0 over the data-parallel ranks
    unless data_parallel_sharded is False (each holds its tensor-parallel part whole: DDP, or a
    module left out of fully_shard)."""

    tensor_parallel_dim: int | None
    data_parallel_sharded: bool = True

    def __str__(self) -> str:
        over_tensor_parallel = ("replicated" if self.tensor_parallel_dim is REPLICATED
                                else f"dim {self.tensor_parallel_dim}")
        return over_tensor_parallel + ("" if self.data_parallel_sharded
                                       else " (replicated over data parallel)")


@dataclass(frozen=True)
class Mesh:
    """A 2-D device mesh: data-parallel ranks by tensor-parallel ranks."""

    data_parallel: int
    tensor_parallel: int = 1

    def __post_init__(self) -> None:
        if self.data_parallel < 1 or self.tensor_parallel < 1:
            raise InvalidOptionError(f"a mesh needs at least one rank on each dimension, not "
                                     f"{self}")
        check_world_size(self.ranks)

    @property
    def ranks(self) -> int:
        """The world size: every rank of the mesh."""
        return self.data_parallel * self.tensor_parallel

    def __str__(self) -> str:
        return f"{self.data_parallel}x{self.tensor_parallel}"


def parse_mesh(text: str) -> Mesh:
    """`4x2` as Mesh(4, 2): data-parallel size by tensor-parallel size."""
    match = re.fullmatch(r"([0-9]+)x([0-9]+)", text.strip().lower())
    if match is None:
        raise InvalidOptionError(f"--mesh must be DPxTP, two whole numbers such as 4x2, not "
                                 f"{text!r}")
    data_parallel, tensor_parallel = match.groups()
    if max(int(data_parallel), int(tensor_parallel)) > MAX_WORLD_SIZE:
        raise InvalidOptionError(f"--mesh {text}: more than {MAX_WORLD_SIZE} ranks")
    return Mesh(int(data_parallel), int(tensor_parallel))


def _piece(size: int, parts: int, index: int) -> tuple[int, int]:
    """Start and length of part index of size split as torch.chunk splits it; an empty part
    starts at the end, as torch computes it."""
    per_part = -(-size // parts)
    start = min(per_part * index, size)
    return start, min(per_part, size - start)


def _strided_rows(rows: int, mesh: Mesh, data_rank: int) -> list[tuple[int, int]]:
    """First row and row count of each tensor-parallel rank of data_rank where both dimensions
    of the mesh shard dim 0, as torch's `(_StridedShard(0, split_factor=tp), Shard(0))` computes
    them: the rows are cut into tp blocks, the data-parallel rank takes its torch.chunk part of
    each block, and each tensor-parallel rank its part of those rows, taken in order. Evenly
    split, that is the tensor-parallel rank's block split over the data-parallel ranks.
    (Unevenly, torch's own saves write rows of other shapes than this under these offsets;
    dcpctl writes what torch's metadata says, which is what a load asks for.)"""
    tensor_parallel = mesh.tensor_parallel
    spans = []  # the data-parallel rank's rows: (first, count) in each block
    for block in range(tensor_parallel):
        block_start, block_rows = _piece(rows, tensor_parallel, block)
        start, count = _piece(block_rows, mesh.data_parallel, data_rank)
        spans.append((block_start + start, count))
    held = sum(count for _, count in spans)
    parts = []
    span, passed = 0, 0  # the span holding the next part's first row; rows in spans before it
    for tensor_rank in range(tensor_parallel):
        skip, count = _piece(held, tensor_parallel, tensor_rank)
        while span < len(spans) and passed + spans[span][1] <= skip:
            passed += spans[span][1]
            span += 1
        parts.append((spans[span][0] + skip - passed, count) if count else (rows, 0))
    return parts


def _row_parts(rows: int, mesh: Mesh, placement: MeshPlacement) -> list[list[tuple[int, int]]]:
    """For each data-parallel rank, each tensor-parallel rank's first row and row count."""
    tensor_parallel = mesh.tensor_parallel
    if not placement.data_parallel_sharded:  # every data-parallel rank holds the same rows
        if placement.tensor_parallel_dim == 0:
            parts = [_piece(rows, tensor_parallel, tensor_rank)
                     for tensor_rank in range(tensor_parallel)]
        else:
            parts = [(0, rows)] * tensor_parallel
        return [parts] * mesh.data_parallel
    if placement.tensor_parallel_dim == 0:
        return [_strided_rows(rows, mesh, data_rank) for data_rank in range(mesh.data_parallel)]
    return [[_piece(rows, mesh.data_parallel, data_rank)] * tensor_parallel
            for data_rank in range(mesh.data_parallel)]


def mesh_chunks(shape: tuple[int, ...], mesh: Mesh, placement: MeshPlacement
                ) -> list[RankChunk]:
    """The chunks a save from mesh writes for a tensor of this shape placed so; equal chunks
    of several ranks are one entry, as DCP deduplicates them, held by those ranks. An empty
    chunk starts at the end of its dim (_piece, _strided_rows), as torch computes it. A 0-d
    tensor is one chunk every rank holds."""
    if not shape:
        return [RankChunk((), (), range(mesh.ranks))]
    tensor_parallel = mesh.tensor_parallel
    if placement == MeshPlacement(REPLICATED):  # the 1-D split, each chunk held by a mesh row
        return [RankChunk(chunk.offsets, chunk.sizes,
                          range(chunk.holders[0] * tensor_parallel,
                                (chunk.holders[-1] + 1) * tensor_parallel))
                for chunk in shard_dim0_chunks(shape, mesh.data_parallel)]
    dim = placement.tensor_parallel_dim
    if dim is not REPLICATED and not 0 <= dim < len(shape):
        raise ValueError(f"dim {dim} of a {len(shape)}-d tensor")
    inner = dim if dim is not REPLICATED and dim > 0 else None
    inner_parts = [_piece(shape[dim], tensor_parallel, tensor_rank) if inner else (0, 0)
                   for tensor_rank in range(tensor_parallel)]
    offsets, sizes = [0] * len(shape), list(shape)
    holders: dict[tuple[tuple[int, ...], tuple[int, ...]], list[int]] = {}
    rank = 0
    for parts in _row_parts(shape[0], mesh, placement):
        for (first_row, rows), inner_part in zip(parts, inner_parts):
            offsets[0], sizes[0] = first_row, rows
            if inner:
                offsets[inner], sizes[inner] = inner_part
            key = (tuple(offsets), tuple(sizes))
            if key in holders:
                holders[key].append(rank)
            else:
                holders[key] = [rank]
            rank += 1
    return [RankChunk(offsets, sizes, tuple(ranks))
            for (offsets, sizes), ranks in holders.items()]


def source_mesh(checkpoint: Checkpoint, tensor_parallel: int) -> Mesh:
    """The mesh that saved the checkpoint, given its tensor-parallel size: its world size is
    told by its rank files (`__<rank>_<n>.distcp`)."""
    world_size = world_size_of_rank_files(checkpoint.files)
    if world_size is None:
        raise UnsupportedLayoutError("its data files are not named by rank (__<rank>_<n>.distcp)"
                                     ", so the mesh that saved it cannot be told",
                                     path=checkpoint.path)
    if world_size > _RANKS_PER_FILE_AT_MOST * len(checkpoint.files):
        raise UnsupportedLayoutError(
            f"its {len(checkpoint.files)} data files name ranks up to {world_size - 1}: no save "
            f"of {world_size} ranks writes so few (torch writes one or more for every rank), so "
            "the mesh that saved it cannot be told", path=checkpoint.path)
    if world_size % tensor_parallel:
        raise UnsupportedLayoutError(
            f"was saved by {world_size} ranks, which a tensor-parallel size of "
            f"{tensor_parallel} does not divide; --mesh keeps the saved tensor-parallel size",
            path=checkpoint.path)
    return Mesh(world_size // tensor_parallel, tensor_parallel)


def placements_of(ndim: int) -> list[MeshPlacement]:
    """Every placement of an ndim-d tensor on a 2-D mesh, in the order placement_of tries
    them: FSDP2-sharded ones first (replicated over tensor parallel, then each dim)."""
    dims = (REPLICATED, *range(ndim))
    return ([MeshPlacement(dim) for dim in dims]
            + [MeshPlacement(dim, data_parallel_sharded=False) for dim in dims[1:]])


def placement_of(tensor: TensorEntry, mesh: Mesh) -> MeshPlacement:
    """How a save from mesh placed the tensor, told by its chunks and the rank files they are
    in. Where several placements fit (a tensor too small to tell, or a mesh with one
    data-parallel rank), the first in placements_of's order is taken: they give the same
    chunks, if not always on the same rank files."""
    saved = {(tuple(chunk.offsets), tuple(chunk.sizes)):
             rank_of_file_name(chunk.storage.relative_path) if chunk.storage else None
             for chunk in tensor.chunks}
    for placement in placements_of(len(tensor.shape)):
        if _fits(mesh_chunks(tensor.shape, mesh, placement), saved):
            return placement
    raise UnsupportedLayoutError(
        f"its chunks (shape {list(tensor.shape)}) are not what a save from a {mesh} mesh "
        "(data parallel by tensor parallel) writes for any placement --mesh keeps (FSDP2's "
        "rows over data parallel, each tensor-parallel part whole or split on one dim; or "
        "tensor parallel alone), so its layout cannot be kept: it was saved with another "
        "tensor-parallel size, or with another placement (a dim other than 0 sharded over data "
        "parallel, say); pass --ranks for a 1-D layout", fqn=tensor.fqn)


def _fits(chunks: Iterable[RankChunk], saved: dict) -> bool:
    """Whether the saved chunks are these, each in the file of a rank that holds it."""
    expected = {(chunk.offsets, chunk.sizes): chunk.holders for chunk in chunks}
    return expected.keys() == saved.keys() and all(
        rank is None or rank in expected[key] for key, rank in saved.items())

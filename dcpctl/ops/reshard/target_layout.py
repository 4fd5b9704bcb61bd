"""The layout a reshard writes: which chunks each tensor is cut into for the target (a 1-D
FSDP2 world, or a 2-D mesh keeping the source's tensor-parallel layout), and which ranks' save
plans hold each chunk and object, for the deduplication to place them (sharding.py)."""

from __future__ import annotations

from typing import Callable, Sequence

from dcpctl.errors import DcpctlError, InvalidOptionError
from dcpctl.format.checkpoint.hf_storage import saving_ranks
from dcpctl.format.checkpoint.mesh_sharding import (Mesh, MeshPlacement, mesh_chunks,
                                                    placement_of, source_mesh)
from dcpctl.format.checkpoint.sharding import RankChunk, shard_dim0_chunks
from dcpctl.format.checkpoint.view import Checkpoint, TensorEntry
from dcpctl.format.file_names import rank_of_file_name
from dcpctl.format.state_dict_layouts import rank_of_per_rank_entry


def target_mesh(world_size: int, tensor_parallel: int) -> Mesh:
    """The target mesh: world_size ranks, tensor_parallel of them on its inner dimension."""
    if tensor_parallel < 1 or world_size % tensor_parallel:
        raise InvalidOptionError(f"a tensor-parallel size of {tensor_parallel} does not divide "
                                 f"{world_size} ranks")
    return Mesh(world_size // tensor_parallel, tensor_parallel)


def target_chunks(checkpoint: Checkpoint, mesh: Mesh
                  ) -> tuple[Callable[[TensorEntry], list[RankChunk]],
                             dict[str, MeshPlacement] | None]:
    """How each tensor is chunked for the target mesh, and for a 2-D one the placement each
    sharded tensor was found to have in the source (and keeps)."""
    if mesh.tensor_parallel == 1:
        never_sharded = _never_sharded(_several_ranks_saved(checkpoint))
        return (lambda tensor: _whole(tensor, mesh) if never_sharded(tensor)
                else shard_dim0_chunks(tensor.shape, mesh.ranks)), None
    source = source_mesh(checkpoint, mesh.tensor_parallel)
    never_sharded = _never_sharded(source.data_parallel > 1)
    placements: dict[str, MeshPlacement] = {}
    for tensor in checkpoint.tensors:
        if not never_sharded(tensor):
            try:
                placements[tensor.fqn] = placement_of(tensor, source)
            except DcpctlError as error:
                raise error.located(path=checkpoint.path)
    return (lambda tensor: mesh_chunks(tensor.shape, mesh, placements[tensor.fqn])
            if tensor.fqn in placements else _whole(tensor, mesh)), placements


def _whole(tensor: TensorEntry, mesh: Mesh) -> list[RankChunk]:
    """The one chunk of a tensor that every rank holds whole."""
    return [RankChunk((0,) * len(tensor.shape), tensor.shape, range(mesh.ranks))]


def object_holders(fqn: str, mesh: Mesh) -> Sequence[int]:
    """The ranks whose save plans hold an object: every rank; for a per-rank object of
    data-parallel rank r, the ranks of r's row of the mesh (rank 0 alone where the mesh has
    no such row)."""
    rank = rank_of_per_rank_entry(fqn)
    if rank is None:
        return range(mesh.ranks)
    if rank >= mesh.data_parallel:
        return range(1)
    return range(rank * mesh.tensor_parallel, (rank + 1) * mesh.tensor_parallel)


def _several_ranks_saved(checkpoint: Checkpoint) -> bool:
    """Whether several ranks saved the checkpoint, told by its data files (a consolidated
    Hugging Face save's, split by size, are not ranks')."""
    if checkpoint.hf_storage:
        return len(saving_ranks(checkpoint.files)) > 1
    ranks = {rank_of_file_name(name) for name in checkpoint.files}
    return len(ranks - {None}) > 1 or (None in ranks and len(checkpoint.files) > 1)


def _never_sharded(several_ranks: bool):
    """Whether a tensor was saved whole by every rank, not sharded: a 0-d tensor, or, where
    several (data-parallel) ranks saved it, one chunk that covers the tensor. A save of one
    rank cannot tell: its tensors are taken as sharded."""

    def never_sharded(tensor: TensorEntry) -> bool:
        if not tensor.shape:
            return True
        if not several_ranks or len(tensor.chunks) != 1:
            return False
        chunk = tensor.chunks[0]
        return tuple(chunk.sizes) == tuple(tensor.shape) and not any(chunk.offsets)

    return never_sharded

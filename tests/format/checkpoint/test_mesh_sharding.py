"""A 2-D mesh's chunks against torch's own placement arithmetic, and the tensor-parallel
placement told back from a save's chunks and rank files."""

from __future__ import annotations

import itertools

import pytest

from dcpctl.errors import InvalidOptionError, UnsupportedLayoutError
from dcpctl.format.checkpoint.mesh_sharding import (REPLICATED, Mesh, MeshPlacement, mesh_chunks,
                                                    parse_mesh, placement_of, placements_of)
from dcpctl.format.checkpoint.view import TensorEntry
from dcpctl.format.dtypes import dtype_by_name
from dcpctl.format.file_names import rank_file_name
from dcpctl.format.metadata.records import ChunkMetadata, StorageInfo


def _torch_placements(mesh: Mesh, placement: MeshPlacement):
    """The placements FSDP2 over tensor parallelism gives a parameter (fully_shard on
    mesh["dp"] of a DTensor on mesh["tp"]), or tensor parallelism alone."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    dim = placement.tensor_parallel_dim
    over_tensor_parallel = Replicate() if dim is REPLICATED else Shard(dim)
    if not placement.data_parallel_sharded:
        return [Replicate(), over_tensor_parallel]
    if dim == 0:
        return [_StridedShard(0, split_factor=mesh.tensor_parallel), Shard(0)]
    return [Shard(0), over_tensor_parallel]


def _torch_chunks(shape, mesh: Mesh, placement: MeshPlacement) -> dict:
    """Each (offsets, sizes) and the ranks holding it, by torch's compute of every rank's
    local shape and global offset."""
    from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset

    placements = _torch_placements(mesh, placement)
    chunks: dict = {}
    for rank in range(mesh.ranks):
        coordinate = [rank // mesh.tensor_parallel, rank % mesh.tensor_parallel]
        sizes, offsets = _compute_local_shape_and_global_offset(shape, (mesh.data_parallel,
                                                                        mesh.tensor_parallel),
                                                                coordinate, placements)
        chunks.setdefault((tuple(offsets), tuple(sizes)), []).append(rank)
    return {key: tuple(ranks) for key, ranks in chunks.items()}


SHAPES = [(0,), (1,), (5,), (7,), (8,), (11, 3), (13, 2), (3, 6), (2, 7), (16, 4), (1, 1), (7, 0),
          (0, 5), (9, 5), (5, 3, 2), (29, 3)]
MESHES = [Mesh(1, 2), Mesh(2, 2), Mesh(3, 2), Mesh(4, 2), Mesh(2, 3), Mesh(2, 4), Mesh(5, 3),
          Mesh(4, 3), Mesh(3, 4), Mesh(1, 1), Mesh(3, 1)]


@pytest.mark.parametrize("mesh", MESHES, ids=str)
def test_chunks_are_torchs(mesh):
    """Every shape, mesh and placement (FSDP2-sharded or not, replicated over tensor parallel
    or sharded on each dim), uneven and empty splits included: the chunks and their holders
    are what torch computes for each rank."""
    for shape in SHAPES:
        for placement in placements_of(len(shape)):
            ours = {(chunk.offsets, chunk.sizes): tuple(chunk.holders)
                    for chunk in mesh_chunks(shape, mesh, placement)}
            assert ours == _torch_chunks(shape, mesh, placement), (shape, placement)


def _saved_tensor(shape, mesh: Mesh, placement, pick=lambda holders: holders[0]
                  ) -> TensorEntry:
    chunks = [ChunkMetadata(chunk.offsets, chunk.sizes,
                            StorageInfo(rank_file_name(pick(chunk.holders)), 0, 1))
              for chunk in mesh_chunks(shape, mesh, placement)]
    return TensorEntry("layer.weight", dtype_by_name("torch.float32"), shape, chunks)


def test_placement_is_told_from_chunks_and_rank_files():
    """Each placement of tensors large enough to tell is found again, whichever holder's file
    a deduplicated chunk went to."""
    meshes = [Mesh(2, 2), Mesh(3, 2), Mesh(2, 4)]
    for mesh, shape in itertools.product(meshes, [(16, 12), (24,)]):
        for placement in placements_of(len(shape)):
            for pick in (lambda holders: holders[0], lambda holders: holders[-1]):
                found = placement_of(_saved_tensor(shape, mesh, placement, pick), mesh)
                assert found == placement, (mesh, shape, placement)


def test_one_data_parallel_rank_cannot_tell_fsdp_from_replication():
    """With one data-parallel rank, FSDP2 sharding and replication write the same chunks:
    the FSDP2 placement is taken, so a larger data-parallel size shards it."""
    saved = _saved_tensor((8, 4), Mesh(1, 2), MeshPlacement(1, data_parallel_sharded=False))
    assert placement_of(saved, Mesh(1, 2)) == MeshPlacement(1)


def test_rank_files_tell_strided_rows_from_a_one_dimensional_split():
    """A 1-D FSDP2 save of 4 ranks has the chunk rows a 2x2 mesh's dim-0 sharding has, on
    other ranks' files: it is not taken for a 2x2 save."""
    one_dimensional = _saved_tensor((16, 4), Mesh(4, 1), MeshPlacement(REPLICATED))
    with pytest.raises(UnsupportedLayoutError, match="2x2 mesh") as caught:
        placement_of(one_dimensional, Mesh(2, 2))
    assert caught.value.fqn == "layer.weight"


@pytest.mark.parametrize("text,mesh", [("4x2", Mesh(4, 2)), (" 1X8 ", Mesh(1, 8))])
def test_mesh_option_parses(text, mesh):
    assert parse_mesh(text) == mesh and mesh.ranks == mesh.data_parallel * mesh.tensor_parallel


@pytest.mark.parametrize("text", ["4", "4x", "x2", "0x2", "2x0", "4x2x2", "-1x2", "ax2",
                                  "99999999x99999999", "４x2"])
def test_bad_mesh_is_a_usage_error(text):
    with pytest.raises(InvalidOptionError):
        parse_mesh(text)

"""`reshard --mesh DPxTP` writes what a real save from a DP x TP mesh (FSDP2 over tensor
parallelism, as torchtitan runs it) writes, chunk by chunk and file by file, and stock torch
loads it on that mesh: compared against real saves from 2x2, 1x2 and 3x2 meshes."""

from __future__ import annotations

import io
import json
import pickle
import shutil
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from conftest import (assert_torch_loads_equal, entry_files, fixture_path, is_per_rank_object,
                      load_with_torch, torch_metadata)
from make_fixtures import run_gloo_job

from dcpctl.cli.main import cli
from dcpctl.errors import InvalidOptionError, UnsupportedLayoutError
from dcpctl.ops.reshard.execution import reshard_checkpoint


class TensorParallelModel(torch.nn.Module):
    """The parts of a transformer that tensor parallelism places differently: an embedding
    sharded on rows, column-wise and row-wise linears (dim 0 and dim 1, uneven where dim 1 is
    sharded), norms it leaves replicated, and a buffer."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(16, 6)
        self.norm = torch.nn.LayerNorm(6)
        self.up = torch.nn.Linear(6, 12)
        self.down = torch.nn.Linear(12, 7)
        self.wide = torch.nn.Linear(5, 4, bias=False)
        self.register_buffer("rope", torch.randn(5, 2))


def _mesh_state(rank: int, world_size: int, tensor_parallel: int) -> dict:
    """A torchtitan-shaped state of the model on a (world_size / tensor_parallel) x
    tensor_parallel mesh, after one AdamW step on fixed gradients."""
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                         get_optimizer_state_dict)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                   parallelize_module)

    data_parallel = world_size // tensor_parallel
    mesh = init_device_mesh("cpu", (data_parallel, tensor_parallel),
                            mesh_dim_names=("dp", "tp"))
    model = TensorParallelModel()
    parallelize_module(model, mesh["tp"], {"embed": RowwiseParallel(), "up": ColwiseParallel(),
                                           "down": RowwiseParallel(),
                                           "wide": RowwiseParallel()})
    fully_shard(model, mesh=mesh["dp"])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for index, parameter in enumerate(model.parameters()):
        parameter.grad = torch.ones_like(parameter) * (index + 1) / 7
    optimizer.step()
    data_rank = rank // tensor_parallel
    progress = io.BytesIO()
    torch.save({"data_rank": data_rank}, progress)
    progress.seek(0)
    return {"model": get_model_state_dict(model),
            "optimizer": get_optimizer_state_dict(
                model, optimizer, options=StateDictOptions(flatten_optimizer_state_dict=True)),
            "dataloader": {f"dp_rank_{data_rank}": progress}}


def _save(rank: int, world_size: int, tensor_parallel: int, path: str) -> None:
    import torch.distributed.checkpoint as dcp

    dcp.save(_mesh_state(rank, world_size, tensor_parallel), checkpoint_id=path)


def _load_on_mesh(rank: int, world_size: int, tensor_parallel: int, path: str,
                  out_file: str) -> None:
    """Load with stock torch into the state of that mesh; rank 0 writes each tensor's full
    value as a list."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.tensor import DTensor

    state = _mesh_state(rank, world_size, tensor_parallel)
    for value in state["model"].values():
        if isinstance(value, torch.Tensor):
            value.detach().zero_()
    del state["dataloader"]
    dcp.load(state, checkpoint_id=path)
    full = {f"{part}.{fqn}": (value.full_tensor() if isinstance(value, DTensor) else value)
            for part in ("model", "optimizer") for fqn, value in _flat(state[part]).items()}
    if rank == 0:
        Path(out_file).write_text(json.dumps({fqn: value.tolist() for fqn, value
                                              in full.items()}))


def _flat(state: dict, prefix: str = "") -> dict:
    flat = {}
    for key, value in state.items():
        if isinstance(value, dict):
            flat.update(_flat(value, f"{prefix}{key}."))
        elif isinstance(value, torch.Tensor):
            flat[f"{prefix}{key}"] = value
    return flat


@pytest.fixture(scope="module")
def mesh_saves(tmp_path_factory):
    """Real saves from 2x2, 1x2 and 3x2 meshes."""
    root = tmp_path_factory.mktemp("mesh_saves")
    saves = {}
    for data_parallel in (2, 1, 3):
        saves[data_parallel] = root / f"{data_parallel}x2"
        run_gloo_job(data_parallel * 2, _save, 2, str(saves[data_parallel]))
    return saves


@pytest.mark.slow
@pytest.mark.parametrize("data_parallel", [1, 3])
def test_mesh_output_is_a_real_save_of_that_mesh(mesh_saves, tmp_path, data_parallel):
    """From 2x2 to 1x2 and 3x2: every chunk, object and buffer in the file a real save from
    that mesh puts it, and the same values as the source."""
    out = tmp_path / "out"
    report = reshard_checkpoint(mesh_saves[2], data_parallel * 2, str(out), tensor_parallel=2)
    assert report.mesh == f"{data_parallel}x2"
    assert report.placements == {"dim 0": 9, "dim 1": 6, "replicated": 9}
    real = entry_files(mesh_saves[data_parallel], is_per_rank_object)
    assert entry_files(out, is_per_rank_object) == real
    written = entry_files(out)
    # each data-parallel rank's own object is in its mesh row's file; one past the new mesh
    # is kept on rank 0's file
    assert written[("dataloader.dp_rank_0", None)] in ("__0_0.distcp", "__1_0.distcp")
    assert written[("dataloader.dp_rank_1", None)] in (
        ("__2_0.distcp", "__3_0.distcp") if data_parallel > 1 else ("__0_0.distcp",))
    assert report.per_rank_objects.ranks_without == tuple(range(2, data_parallel))
    assert_torch_loads_equal(mesh_saves[2], out)


@pytest.mark.slow
def test_stock_torch_loads_the_output_on_the_new_mesh(mesh_saves, tmp_path):
    out = tmp_path / "out"
    result = CliRunner().invoke(cli, ["reshard", str(mesh_saves[2]), "--mesh", "1x2", "-o",
                                      str(out)])
    assert result.exit_code == 0, result.output
    assert "tensor-parallel placements kept: dim 0 9, dim 1 6, replicated 9" in result.output
    values_file = tmp_path / "values.json"
    run_gloo_job(2, _load_on_mesh, 2, str(out), str(values_file))
    values = json.loads(values_file.read_text())
    original = load_with_torch(mesh_saves[2])
    assert set(values) == {fqn for fqn, value in original.items()
                           if isinstance(value, torch.Tensor)}
    for fqn, value in values.items():
        assert torch.equal(torch.tensor(value, dtype=original[fqn].dtype), original[fqn]), fqn


@pytest.mark.slow
def test_a_tensor_parallel_size_the_source_was_not_saved_with_is_refused(mesh_saves, tmp_path):
    with pytest.raises(UnsupportedLayoutError, match=r"are not what a save from a 1x4 mesh"):
        reshard_checkpoint(mesh_saves[2], 8, str(tmp_path / "out"), tensor_parallel=4)
    with pytest.raises(UnsupportedLayoutError, match="6 ranks, which a tensor-parallel size "
                                                     "of 4 does not divide"):
        reshard_checkpoint(mesh_saves[3], 8, str(tmp_path / "out"), tensor_parallel=4)
    assert not (tmp_path / "out").exists()


def test_mixed_placements_of_distribute_tensor(tmp_path):
    """The 2x2 fixture's DTensors (FSDP-style, tensor-parallel only, both dims) keep their
    placements on a 3x2 mesh, and load back equal."""
    out = tmp_path / "out"
    report = reshard_checkpoint(fixture_path("mesh2d_4ranks"), 6, str(out), tensor_parallel=2)
    assert report.placements == {"dim 0 (replicated over data parallel)": 1, "dim 1": 1,
                                 "replicated": 1}
    chunks = {fqn: sorted((tuple(chunk.offsets), tuple(chunk.sizes)) for chunk in entry.chunks)
              for fqn, entry in torch_metadata(out).state_dict_metadata.items()}
    assert chunks["bias"] == [((0,), (3,)), ((3,), (2,))]  # only tensor parallel splits it
    assert_torch_loads_equal(fixture_path("mesh2d_4ranks"), out)
    by_workers = tmp_path / "by_workers"
    reshard_checkpoint(fixture_path("mesh2d_4ranks"), 6, str(by_workers), tensor_parallel=2,
                       workers=2)
    assert sorted(path.name for path in out.iterdir()) == sorted(
        path.name for path in by_workers.iterdir())
    for path in out.iterdir():
        assert path.read_bytes() == (by_workers / path.name).read_bytes(), path.name


def test_a_one_dimensional_source_is_not_taken_for_a_mesh(tmp_path):
    """A 4-rank FSDP2 layout read as a 2x2 mesh: the rows of its chunks could be a 2x2 save's,
    but not on those ranks' files; refused, nothing written."""
    one_dimensional = tmp_path / "four"
    reshard_checkpoint(fixture_path("fsdp2_adamw_3ranks"), 4, str(one_dimensional))
    with pytest.raises(UnsupportedLayoutError, match="not what a save from a 2x2 mesh .* "
                       "another tensor-parallel size, or with another placement"):
        reshard_checkpoint(one_dimensional, 4, str(tmp_path / "out"), tensor_parallel=2)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("arguments,message", [
    (["--ranks", "4", "--mesh", "2x2"], "one of the two"),
    ([], "one of the two"),
    (["--mesh", "2by2"], "DPxTP"),
    (["--mesh", "3x2"], "3 ranks, which a tensor-parallel size of 2 does not divide"),
])
def test_mesh_option_errors(tmp_path, arguments, message):
    result = CliRunner().invoke(cli, ["reshard", str(fixture_path("fsdp2_adamw_3ranks")),
                                      "-o", str(tmp_path / "out"), *arguments])
    assert message in result.output and "Traceback" not in result.output
    assert result.exit_code == (1 if "ranks, which" in message else 2), result.output
    assert not (tmp_path / "out").exists()


def test_tensor_parallel_size_must_divide_the_world_size():
    with pytest.raises(InvalidOptionError, match="does not divide 6 ranks"):
        reshard_checkpoint(fixture_path("mesh2d_4ranks"), 6, "unused", tensor_parallel=4)


def test_a_rank_file_claiming_a_huge_world_is_refused_at_once(tmp_path):
    """Telling placements costs work in proportion to the source's world size, which the rank
    file names give: rank 3's file renamed for rank 999,999 does not buy a million ranks of
    work."""
    source = tmp_path / "source"
    shutil.copytree(fixture_path("mesh2d_4ranks"), source)
    (source / "__3_0.distcp").rename(source / "__999999_0.distcp")
    metadata = torch_metadata(source)
    for info in metadata.storage_data.values():
        if info.relative_path == "__3_0.distcp":
            info.relative_path = "__999999_0.distcp"
    with open(source / ".metadata", "wb") as stream:
        pickle.dump(metadata, stream)
    with pytest.raises(UnsupportedLayoutError, match="4 data files name ranks up to 999999"):
        reshard_checkpoint(source, 4, str(tmp_path / "out"), tensor_parallel=2)
    assert not (tmp_path / "out").exists()

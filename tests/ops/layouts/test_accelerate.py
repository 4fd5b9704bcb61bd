"""Checkpoints written by accelerate's own FSDP2 checkpoint code (`save_fsdp_model` and
`save_fsdp_optimizer`, which `Accelerator.save_state` calls with SHARDED_STATE_DICT), read back
by accelerate's own loaders after dcpctl rewrote them. The one shim: accelerate runs FSDP only
on accelerators, so the jobs build the FSDP2 model themselves and hand accelerate's functions a
CPU `PartialState` where they expect the Accelerator."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from make_fixtures import run_gloo_job

from dcpctl.ops.inspection.report import inspect_checkpoint
from dcpctl.ops.reshard.execution import reshard_checkpoint
from dcpctl.ops.runs.listing import list_run_directory
from dcpctl.ops.transcode import compress_checkpoint, decompress_checkpoint
from dcpctl.ops.verify.verifier import verify_checkpoint

pytest.importorskip("accelerate")

PARTS = ("pytorch_model_fsdp_0", "optimizer_0")


class SmallNet(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Linear(8, 16)
        self.head = torch.nn.Linear(16, 5)

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.embed(inputs)))


def _fsdp2_job(world_size: int):
    from accelerate import PartialState
    from accelerate.utils import FullyShardedDataParallelPlugin
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = SmallNet()
    mesh = init_device_mesh("cpu", (world_size,))
    fully_shard(model.embed, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    plugin = FullyShardedDataParallelPlugin(fsdp_version=2,
                                            state_dict_type="SHARDED_STATE_DICT")
    return model, optimizer, plugin, PartialState(cpu=True)


def _save(rank: int, world_size: int, out: str, values_file: str) -> None:
    """One AdamW step, saved by accelerate; rank 0 writes the full state it saved."""
    from accelerate.utils.fsdp_utils import save_fsdp_model, save_fsdp_optimizer

    model, optimizer, plugin, state = _fsdp2_job(world_size)
    inputs = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
    model(inputs).sum().backward()
    optimizer.step()
    save_fsdp_model(plugin, state, model, out)
    save_fsdp_optimizer(plugin, state, optimizer, model, out)
    _write_values(rank, model, optimizer, values_file)


def _load(rank: int, world_size: int, checkpoint: str, values_file: str) -> None:
    """accelerate's loaders into a fresh job; rank 0 writes the full state loaded."""
    from accelerate.utils.fsdp_utils import load_fsdp_model, load_fsdp_optimizer

    model, optimizer, plugin, state = _fsdp2_job(world_size)
    model(torch.zeros(1, 8)).sum().backward()
    optimizer.step()  # the state the loader fills, with other values
    load_fsdp_model(plugin, state, model, checkpoint)
    load_fsdp_optimizer(plugin, state, optimizer, model, checkpoint)
    _write_values(rank, model, optimizer, values_file)


def _write_values(rank: int, model, optimizer, values_file: str) -> None:
    """Rank 0 writes the full model and optimizer state as lists, by name."""
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                         get_optimizer_state_dict)

    full = StateDictOptions(full_state_dict=True)
    values = {fqn: value.tolist() for fqn, value in get_model_state_dict(model,
                                                                         options=full).items()}
    for parameter, moments in get_optimizer_state_dict(model, optimizer,
                                                       options=full)["state"].items():
        values.update({f"state.{parameter}.{name}": value.tolist()
                       for name, value in moments.items()})
    if rank == 0:
        Path(values_file).write_text(json.dumps(values))


def _loaded_by_accelerate(checkpoint: Path, world_size: int, tmp_path: Path) -> dict:
    values_file = tmp_path / f"values-{checkpoint.name}-{world_size}.json"
    run_gloo_job(world_size, _load, str(checkpoint), str(values_file))
    return json.loads(values_file.read_text())


@pytest.fixture(scope="module")
def accelerate_save(tmp_path_factory):
    """A run directory with one checkpoint saved by accelerate from 2 ranks, and the state it
    saved."""
    run_dir = tmp_path_factory.mktemp("accelerate_run")
    checkpoint = run_dir / "checkpoint_0"
    values_file = run_dir.parent / "saved_values.json"
    run_gloo_job(2, _save, str(checkpoint), str(values_file))
    (checkpoint / "random_states_0.pkl").write_bytes(b"rng")  # save_state writes it last
    return checkpoint, json.loads(values_file.read_text())


@pytest.mark.slow
def test_dcpctl_reads_what_accelerate_writes(accelerate_save):
    accelerate_save, _ = accelerate_save
    model, optimizer = (inspect_checkpoint(accelerate_save / part) for part in PARTS)
    assert "accelerate" in model.layout and "accelerate" in optimizer.layout
    for part in PARTS:
        report = verify_checkpoint(accelerate_save / part)
        assert report.exit_code == 0 and not report.problems, report.problems
    listed = list_run_directory(accelerate_save.parent).checkpoints
    assert [item.entry.name for item in listed] == ["checkpoint_0"]
    assert listed[0].entry.parts == tuple(sorted(PARTS)) and listed[0].entry.complete


@pytest.mark.slow
def test_accelerate_loads_dcpctl_outputs_equal(accelerate_save, tmp_path):
    """Resharded to 3 ranks, compressed to zstd, and compressed then decompressed in place:
    accelerate's own loaders read each back equal to what it saved."""
    accelerate_save, saved = accelerate_save
    original = _loaded_by_accelerate(accelerate_save, 2, tmp_path)
    assert original == saved
    assert len(original) == 4 + 4 * 3  # weights and biases, with step, exp_avg, exp_avg_sq
    resharded, compressed, round_trip = (tmp_path / name for name in ("resharded", "zstd",
                                                                      "round_trip"))
    for part in PARTS:
        reshard_checkpoint(accelerate_save / part, 3, str(resharded / part))
        compress_checkpoint(accelerate_save / part, "zstd", output_path=str(compressed / part))
        compress_checkpoint(accelerate_save / part, "zstd", output_path=str(round_trip / part))
        decompress_checkpoint(round_trip / part)
    assert _loaded_by_accelerate(resharded, 3, tmp_path) == original
    assert _loaded_by_accelerate(compressed, 2, tmp_path) == original
    assert _loaded_by_accelerate(round_trip, 2, tmp_path) == original

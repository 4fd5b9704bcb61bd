"""A checkpoint written by torchtune's own CheckpointClient (asynchronous checkpointing, so its
DistributedCheckpointer: one file per item, `dist_epoch_N` directories; torchtune 0.6.1, FSDP2
on 2 gloo ranks; fixtures/trainers/torchtune_job.py): dcpctl reads and rewrites it the way
torchtune's users expect, and, where torchtune is installed, torchtune's client resumes
training from what dcpctl wrote with the losses of the uninterrupted run."""

from __future__ import annotations

import json
import math
import shutil

import pytest
import torch
from conftest import assert_torch_loads_equal, load_with_torch
from trainer_jobs import TRAINER_FIXTURES, import_job, run_job

from dcpctl.ops.convert.targets import SAFETENSORS_TARGET, convert_checkpoint
from dcpctl.ops.inspection.report import inspect_checkpoint
from dcpctl.ops.reshard.execution import reshard_checkpoint
from dcpctl.ops.runs.listing import list_run_directory
from dcpctl.ops.transcode import compress_checkpoint
from dcpctl.ops.verify.verifier import verify_checkpoint

FIXTURE = TRAINER_FIXTURES / "torchtune_0.6.1_2ranks"
EPOCH = FIXTURE / "run" / "dist_epoch_0"
EXPECTED = json.loads((FIXTURE / "expected.json").read_text())


@pytest.fixture(scope="module")
def torchtune_job():
    return import_job("torchtune_job")


def test_dcpctl_reads_the_layout():
    assert inspect_checkpoint(EPOCH).layout.startswith("torchtune")
    verified = verify_checkpoint(EPOCH)
    assert verified.exit_code == 0 and not verified.problems, verified.problems
    listed = list_run_directory(EPOCH.parent).checkpoints
    assert [(item.entry.name, item.entry.step) for item in listed] == [("dist_epoch_0", 0)]


def test_safetensors_holds_exactly_the_models_weights(tmp_path, torchtune_job):
    from safetensors.torch import load_file

    convert_checkpoint(EPOCH, SAFETENSORS_TARGET, tmp_path / "hf")  # the default selection
    weights = {}
    for path in sorted((tmp_path / "hf").glob("*.safetensors")):
        weights.update(load_file(path))
    model = torchtune_job.TuneShapedModel()
    assert sorted(weights) == sorted(model.state_dict())
    model.load_state_dict(weights, strict=True)
    saved = load_with_torch(EPOCH)
    for name, value in weights.items():
        assert torch.equal(value, saved[f"model.{name}"]), name


@pytest.fixture(scope="module")
def rewritten(tmp_path_factory):
    """The run copied, and its checkpoint resharded to 3 ranks and compressed to zstd, each
    as `dist_epoch_0` of a run directory of its own."""
    root = tmp_path_factory.mktemp("torchtune_outputs")
    shutil.copytree(FIXTURE / "run", root / "copy")
    reshard_checkpoint(EPOCH, 3, str(root / "resharded" / "dist_epoch_0"))
    compress_checkpoint(EPOCH, "zstd", output_path=str(root / "zstd" / "dist_epoch_0"))
    return root


def test_stock_torch_loads_the_outputs_equal(rewritten):
    assert_torch_loads_equal(EPOCH, rewritten / "resharded" / "dist_epoch_0",
                             rewritten / "zstd" / "dist_epoch_0")


def _resume(torchtune_job, run_dir, world_size: int, tmp_path) -> dict:
    return run_job(torchtune_job.resume, world_size, str(run_dir),
                   out_file=tmp_path / f"resumed-{run_dir.name}-{world_size}.json")


@pytest.mark.slow
def test_torchtune_resumes_from_dcpctl_outputs(rewritten, tmp_path, torchtune_job):
    """torchtune's client loads the zstd output on 2 ranks and the 3-rank output on 3, and
    training goes on with the losses the uninterrupted run had: bit for bit on 2 ranks; on 3
    the first (same weights) bit for bit, the next within float rounding, since 3 ranks sum
    gradients in another order."""
    pytest.importorskip("torchtune")
    expected = EXPECTED["losses_after_resume"]
    uninterrupted = {"epochs_run": 1, "seed": 7, "losses": expected}
    assert _resume(torchtune_job, rewritten / "copy", 2, tmp_path) == uninterrupted
    assert _resume(torchtune_job, rewritten / "zstd", 2, tmp_path) == uninterrupted
    resharded = _resume(torchtune_job, rewritten / "resharded", 3, tmp_path)
    assert resharded["epochs_run"] == 1 and resharded["losses"][0] == expected[0]
    assert math.isclose(resharded["losses"][1], expected[1], rel_tol=1e-5)

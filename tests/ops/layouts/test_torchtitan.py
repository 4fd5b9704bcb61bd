"""A checkpoint written by torchtitan's own CheckpointManager (fixtures/trainers/torchtitan_job.py,
torchtitan 0.3.0, FSDP2 on 2 gloo ranks): dcpctl reads and rewrites it the way torchtitan's
users expect, and, where torchtitan is installed, torchtitan's manager resumes training from
what dcpctl wrote with the losses of the uninterrupted run."""

from __future__ import annotations

import json
import math

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

FIXTURE = TRAINER_FIXTURES / "torchtitan_0.3.0_2ranks"
STEP = FIXTURE / "checkpoint" / "step-2"
EXPECTED = json.loads((FIXTURE / "expected.json").read_text())


@pytest.fixture(scope="module")
def torchtitan_job():
    return import_job("torchtitan_job")


def test_dcpctl_reads_the_layout(tmp_path, torchtitan_job):
    report = inspect_checkpoint(STEP)
    assert report.layout.startswith("torchtitan (model weights at the top level")
    verified = verify_checkpoint(STEP)
    assert verified.exit_code == 0 and not verified.problems, verified.problems
    listed = list_run_directory(STEP.parent).checkpoints
    assert [(item.entry.name, item.entry.step) for item in listed] == [("step-2", 2)]


def test_safetensors_holds_exactly_the_models_weights(tmp_path, torchtitan_job):
    from safetensors.torch import load_file

    convert_checkpoint(STEP, SAFETENSORS_TARGET, tmp_path / "hf")  # the default selection
    weights = {}
    for path in sorted((tmp_path / "hf").glob("*.safetensors")):
        weights.update(load_file(path))
    assert sorted(weights) == torchtitan_job.MODEL_KEYS
    model = torchtitan_job.TitanShapedModel()
    model.load_state_dict(weights, strict=True)
    saved = load_with_torch(STEP)
    for name, value in weights.items():
        assert torch.equal(value, saved[name]), name


@pytest.fixture(scope="module")
def rewritten(tmp_path_factory):
    """The checkpoint resharded to 3 ranks, and compressed to zstd, each as `step-2` of a run
    folder of its own."""
    root = tmp_path_factory.mktemp("torchtitan_outputs")
    reshard_checkpoint(STEP, 3, str(root / "resharded" / "step-2"))
    compress_checkpoint(STEP, "zstd", output_path=str(root / "zstd" / "step-2"))
    return root


def test_stock_torch_loads_the_outputs_equal(rewritten):
    assert_torch_loads_equal(STEP, rewritten / "resharded" / "step-2",
                             rewritten / "zstd" / "step-2")


def _resume(torchtitan_job, folder, world_size: int, tmp_path) -> dict:
    return run_job(torchtitan_job.resume, world_size, str(folder),
                   out_file=tmp_path / f"resumed-{folder.name}-{world_size}.json")


@pytest.mark.slow
def test_torchtitan_resumes_from_dcpctl_outputs(rewritten, tmp_path, torchtitan_job):
    """torchtitan's manager loads the zstd output on 2 ranks and the 3-rank output on 3, and
    training goes on with the losses the uninterrupted run had: bit for bit on 2 ranks; on 3
    the first (same weights) bit for bit, the next within float rounding, since 3 ranks sum
    gradients in another order."""
    pytest.importorskip("torchtitan")
    expected = EXPECTED["losses_after_resume"]
    uninterrupted = {"step": 2, "losses": expected}
    assert _resume(torchtitan_job, FIXTURE / "checkpoint", 2, tmp_path) == uninterrupted
    assert _resume(torchtitan_job, rewritten / "zstd", 2, tmp_path) == uninterrupted
    resharded = _resume(torchtitan_job, rewritten / "resharded", 3, tmp_path)
    assert resharded["step"] == 2 and resharded["losses"][0] == expected[0]
    assert math.isclose(resharded["losses"][1], expected[1], rel_tol=1e-5)

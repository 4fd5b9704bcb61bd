"""A checkpoint written by Megatron-Core's own `dist_checkpointing.save` (torch_dist backend,
megatron-core 0.16.1, 2 gloo ranks; fixtures/trainers/megatron_job.py): dcpctl reads and
rewrites it, and, where megatron-core is installed, Megatron's own loader reads what dcpctl
wrote equal to what was saved."""

from __future__ import annotations

import pytest
import torch
from trainer_jobs import TRAINER_FIXTURES, import_job, run_job

from dcpctl.ops.inspection.report import inspect_checkpoint
from dcpctl.ops.reshard.execution import reshard_checkpoint
from dcpctl.ops.runs.listing import list_run_directory
from dcpctl.ops.transcode import compress_checkpoint
from dcpctl.ops.verify.verifier import verify_checkpoint

RUN = TRAINER_FIXTURES / "megatron_core_0.16.1_2ranks"
ITERATION = RUN / "iter_0000007"


@pytest.fixture(scope="module")
def megatron_job():
    return import_job("megatron_job")


def test_dcpctl_reads_megatrons_own_save():
    assert inspect_checkpoint(ITERATION).layout.startswith("Megatron-Core torch_dist")
    verified = verify_checkpoint(ITERATION)
    assert verified.exit_code == 0 and not verified.problems, verified.problems
    listed = list_run_directory(RUN)
    assert [(item.entry.name, item.entry.step) for item in listed.checkpoints] == [
        ("iter_0000007", 7)]
    assert listed.to_json()["tracked_step"] == 7


@pytest.fixture(scope="module")
def rewritten(tmp_path_factory):
    """Compressed to zstd, and resharded to 4 ranks."""
    root = tmp_path_factory.mktemp("megatron_outputs")
    compress_checkpoint(ITERATION, "zstd", output_path=str(root / "zstd"))
    reshard_checkpoint(ITERATION, 4, str(root / "resharded"))
    return root


def test_side_files_travel_with_the_outputs(rewritten):
    for name in ("zstd", "resharded"):
        for side_file in ("common.pt", "metadata.json"):
            assert (rewritten / name / side_file).read_bytes() == (
                ITERATION / side_file).read_bytes()


def _loaded_by_megatron(megatron_job, checkpoint, world_size: int, tmp_path,
                        with_objects: bool = True) -> dict:
    return run_job(megatron_job.load, world_size, str(checkpoint), with_objects,
                   out_file=tmp_path / f"loaded-{checkpoint.name}-{world_size}.json")


@pytest.mark.slow
def test_megatron_loads_dcpctl_outputs_equal(rewritten, tmp_path, megatron_job):
    pytest.importorskip("megatron.core")
    torch.manual_seed(0)
    saved_weight = torch.randn(megatron_job.ROWS, 6, dtype=torch.bfloat16).float().tolist()
    original = _loaded_by_megatron(megatron_job, ITERATION, 2, tmp_path)
    assert original == {"weight": saved_weight, "bias": list(map(float, range(6))),
                        "rng_state": {"seed": 1234}, "iteration": 7}
    assert _loaded_by_megatron(megatron_job, rewritten / "zstd", 2, tmp_path) == original
    # Megatron's per-rank objects belong to the world size that saved them: at 4 ranks they
    # are left out of the load, as Megatron users do (--no-load-rng)
    assert _loaded_by_megatron(megatron_job, rewritten / "resharded", 4, tmp_path,
                               with_objects=False) == {**original, "rng_state": None}

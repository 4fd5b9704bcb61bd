"""Sharded checkpoints written by Lightning's own `Fabric.save` (the ModelParallel strategy's
FSDP2 model and optimizer as DCP files, the rest of the state in `meta.pt` beside them), read
back by Lightning's own `Fabric.load` after dcpctl rewrote them; and by its Trainer's
`save_checkpoint`, converted to safetensors. The jobs run under torchrun, from which Lightning
takes its CPU ranks (lightning_job.py)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from dcpctl.format.checkpoint.checksums import read_sha256sums
from dcpctl.ops.convert.key_selection import KeySelection
from dcpctl.ops.convert.to_safetensors import convert_to_safetensors
from dcpctl.ops.checksum import checksum_checkpoint
from dcpctl.ops.inspection.report import inspect_checkpoint
from dcpctl.ops.reshard.execution import reshard_checkpoint
from dcpctl.ops.transcode import compress_checkpoint
from dcpctl.ops.verify.verifier import verify_checkpoint

pytest.importorskip("lightning")
pytestmark = pytest.mark.slow  # each job is a torchrun of a few seconds

JOB = Path(__file__).with_name("lightning_job.py")


def _run_job(ranks: int, *args) -> None:
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           f"--nproc-per-node={ranks}", str(JOB), *map(str, args)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]


@pytest.fixture(scope="module")
def lightning_save(tmp_path_factory):
    """A checkpoint Fabric saved from 2 ranks after two AdamW steps, and the state it saved."""
    root = tmp_path_factory.mktemp("lightning")
    _run_job(2, "save", root / "ckpt", root / "saved.json")
    return root / "ckpt", json.loads((root / "saved.json").read_text())


def test_dcpctl_reads_what_lightning_writes(lightning_save, tmp_path):
    """meta.pt was an unknown file: verify called the checkpoint damaged, checksum refused."""
    checkpoint, _ = lightning_save
    assert inspect_checkpoint(checkpoint).layout.startswith(
        "Lightning (model weights under model.; trainer state: optimizer")
    copy = shutil.copytree(checkpoint, tmp_path / "ckpt")
    assert verify_checkpoint(copy).problems == []
    checksum_checkpoint(copy)
    assert set(read_sha256sums(copy)) == {".metadata", "__0_0.distcp", "__1_0.distcp", "meta.pt"}
    assert verify_checkpoint(copy).problems == []


@pytest.mark.parametrize("rewrite, ranks", [("reshard to 3 ranks", 3), ("compress -o", 2),
                                            ("compress in place", 2)])
def test_lightning_resumes_from_dcpctl_s_outputs(lightning_save, tmp_path, rewrite, ranks):
    """A new output left meta.pt behind: Lightning then takes the directory for no sharded
    checkpoint, and cannot load it."""
    checkpoint, saved = lightning_save
    source = shutil.copytree(checkpoint, tmp_path / "ckpt")
    output = tmp_path / "out"
    if rewrite == "reshard to 3 ranks":
        reshard_checkpoint(source, 3, str(output))
    elif rewrite == "compress -o":
        compress_checkpoint(source, "zstd", output_path=str(output))
    else:
        compress_checkpoint(source, "zstd")
        output = source
    assert (output / "meta.pt").read_bytes() == (checkpoint / "meta.pt").read_bytes()
    _run_job(ranks, "load", output, tmp_path / "loaded.json")
    assert json.loads((tmp_path / "loaded.json").read_text()) == saved


def test_a_lightning_trainer_checkpoint_converts_to_the_module_s_own_state_dict(tmp_path):
    """The Trainer saves the module under `state_dict.` beside `optimizer_0.`: both were taken
    for model weights, and safetensors got the optimizer's moments under names of their own."""
    from safetensors.torch import load_file

    _run_job(2, "trainer-save", tmp_path / "ckpt", tmp_path / "module.json")
    assert inspect_checkpoint(tmp_path / "ckpt").layout == (
        "Lightning (model weights under state_dict.; trainer state: optimizer_0; optimizer "
        "state nested)")
    convert_to_safetensors(tmp_path / "ckpt", tmp_path / "hf", KeySelection(strip_prefix=None))
    converted = {name: value.tolist()
                 for name, value in load_file(tmp_path / "hf" / "model.safetensors").items()}
    assert converted == json.loads((tmp_path / "module.json").read_text())

"""Commands on one checkpoint at once: one that changes it holds it exclusively, one that reads
its data holds it shared; a conflicting second dcpctl fails at once and changes nothing."""

from __future__ import annotations

import shutil
import subprocess
import sys
import time

import pytest
import torch
from conftest import MANIFEST, directory_state, fixture_path, load_with_torch, run_dcpctl
from make_fixtures import tensor_sha256

from dcpctl.storage.locks import locked_checkpoint

SOURCE = "fsdp2_adamw_3ranks"


@pytest.fixture
def checkpoint(copy_fixture):
    return copy_fixture(SOURCE)


@pytest.mark.parametrize("held, command", [
    ("shared", ["compress"]), ("shared", ["decompress"]), ("shared", ["checksum"]),
    ("exclusive", ["compress"]), ("exclusive", ["verify"]), ("exclusive", ["inspect"]),
    ("exclusive", ["reshard", "--ranks", "2", "-o", "{out}"]),
    ("exclusive", ["convert", "--to", "safetensors", "-o", "{out}"]),
    ("exclusive", ["compress", "-o", "{out}"]),
])
def test_a_conflicting_second_command_fails_at_once(run_cli, tmp_path, checkpoint, held,
                                                    command):
    before = directory_state(checkpoint)
    args = [part.format(out=tmp_path / "out") for part in command]
    with locked_checkpoint(checkpoint, exclusive=held == "exclusive"):
        result = run_cli(args[0], checkpoint, *args[1:])
    assert result.exit_code == 1, result.output
    assert result.output.startswith(f"Error: {checkpoint}: another dcpctl is ")
    assert directory_state(checkpoint) == before
    assert sorted(path.name for path in tmp_path.iterdir()) == [SOURCE]


def test_readers_share_a_checkpoint(run_cli, tmp_path, checkpoint):
    with locked_checkpoint(checkpoint, exclusive=False):
        assert run_cli("verify", checkpoint).exit_code == 0
        assert run_cli("reshard", checkpoint, "--ranks", "2", "-o", tmp_path / "out"
                       ).exit_code == 0
        assert run_cli("inspect", checkpoint).exit_code == 0


@pytest.mark.slow
def test_two_in_place_rewrites_started_together_never_lose_the_checkpoint(tmp_path):
    """The race that used to leave only `.metadata` and SHA256SUMS: one wins, the other
    fails at once or runs after it; the checkpoint always loads whole."""
    expected = {fqn: entry["sha256"] for fqn, entry in MANIFEST[SOURCE]["tensors"].items()}
    for trial in range(6):
        checkpoint = tmp_path / f"trial{trial}"
        shutil.copytree(fixture_path(SOURCE), checkpoint)
        commands = [[sys.executable, "-m", "dcpctl", codec_command, str(checkpoint)]
                    for codec_command in ("compress", "decompress")]
        first = subprocess.Popen(commands[0], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                 text=True)
        time.sleep(0.05 * trial)
        second = subprocess.run(commands[1], capture_output=True, text=True)
        _, first_stderr = first.communicate()
        for returncode, stderr in ((first.returncode, first_stderr),
                                   (second.returncode, second.stderr)):
            assert returncode == 0 or (
                returncode == 1 and "another dcpctl is reading or changing" in stderr), stderr
        loaded = {fqn: tensor_sha256(value) for fqn, value in load_with_torch(checkpoint).items()
                  if isinstance(value, torch.Tensor)}
        assert loaded == expected, trial
        assert run_dcpctl("verify", checkpoint).returncode == 0

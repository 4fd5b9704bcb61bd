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
    assert result.exit_code == 75, result.output
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
                returncode == 75 and "another dcpctl is reading or changing" in stderr), stderr
        loaded = {fqn: tensor_sha256(value) for fqn, value in load_with_torch(checkpoint).items()
                  if isinstance(value, torch.Tensor)}
        assert loaded == expected, trial
        assert run_dcpctl("verify", checkpoint).returncode == 0


@pytest.mark.parametrize("held", ["shared", "exclusive"])
def test_an_output_another_dcpctl_holds_is_not_replaced_with_overwrite(
        run_cli, tmp_path, copy_fixture, held):
    """`-o B --overwrite` moved B aside and deleted it under a compress rewriting B in place
    (which then finished its rewrite through the path, into the new B: exit 0, B damaged),
    and under a reshard reading B (which then read the rest of its files from the new B: an
    output of two checkpoints mixed, certified by its SHA256SUMS)."""
    held_output = copy_fixture(SOURCE)
    before = directory_state(held_output)
    with locked_checkpoint(held_output, exclusive=held == "exclusive"):
        result = run_cli("reshard", fixture_path("zstd_fsdp2_2ranks"), "--ranks", "2", "-o",
                         held_output, "--overwrite")
    assert result.exit_code == 75, result.output
    assert result.output.startswith(f"Error: {held_output}: another dcpctl is ")
    assert directory_state(held_output) == before


def test_an_output_held_once_written_is_not_replaced_either(tmp_path, copy_fixture):
    """Held only after the run began: the replacement waits for nothing and takes nothing."""
    import signal

    from conftest import dcpctl_stopped_at

    held_output = copy_fixture(SOURCE)
    before = directory_state(held_output)
    run = dcpctl_stopped_at("before-publish", "reshard", fixture_path("zstd_fsdp2_2ranks"),
                            "--ranks", "2", "-o", held_output, "--overwrite")
    try:
        with locked_checkpoint(held_output, exclusive=False):
            run.send_signal(signal.SIGCONT)
            _, error = run.communicate(timeout=60)
    finally:
        if run.poll() is None:
            run.kill()
    assert run.returncode == 75 and "another dcpctl is reading or changing" in error, error
    assert directory_state(held_output) == before
    assert sorted(path.name for path in held_output.parent.iterdir()) == [held_output.name]


def test_a_new_file_gone_before_its_final_name_is_no_lack_of_hard_links(tmp_path):
    """An in-place rewrite whose new file was deleted under it (its directory replaced) took
    link(2)'s ENOENT for a file system without hard links, and went on to report success."""
    from dcpctl.format.checkpoint.publishing import _give_final_names

    with pytest.raises(FileNotFoundError):
        _give_final_names(tmp_path, {"__0_0.distcp": "__0_0.distcp.dcpctl-gone.tmp"})


def test_a_file_or_safetensors_source_is_held_while_converted_to_dcp(run_cli, tmp_path):
    """convert --to dcp read its safetensors directory (or torch.save file) with no lock, so
    another dcpctl replaced it with --overwrite mid-read: the output mixed tensors of two
    checkpoints, exit 0, certified by its SHA256SUMS."""
    hf, model = tmp_path / "hf", tmp_path / "model.pt"
    assert run_cli("convert", fixture_path(SOURCE), "--to", "safetensors", "-o", hf
                   ).exit_code == 0
    assert run_cli("convert", fixture_path(SOURCE), "--to", "torch", "-o", model).exit_code == 0
    for source, to in ((hf, "safetensors"), (model, "torch")):
        before = directory_state(hf), directory_state(tmp_path)
        with locked_checkpoint(source, exclusive=False):  # as a convert reading it holds it
            result = run_cli("convert", fixture_path("zstd_fsdp2_2ranks"), "--to", to, "-o",
                             source, "--overwrite")
            assert result.exit_code == 75, result.output
            assert "another dcpctl is reading or changing" in result.output
        assert (directory_state(hf), directory_state(tmp_path)) == before
        with locked_checkpoint(source, exclusive=True):  # as one replacing it holds it
            result = run_cli("convert", source, "--to", "dcp", "-o", tmp_path / "dcp")
            assert result.exit_code == 75 and "another dcpctl is changing" in result.output
        assert not (tmp_path / "dcp").exists()

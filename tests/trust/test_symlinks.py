"""Files dcpctl writes are created new (exclusive, no-follow) or locks are held on directories
themselves: a symlink planted where dcpctl writes never makes it write through, and prune,
run from cron as a privileged user, never deletes outside its run directory."""

from __future__ import annotations

import shutil

import pytest
from conftest import add_checkpoint, directory_state, fixture_path, tree_listing

from dcpctl.storage.locks import locked_directory


def _victim(tmp_path):
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    return victim


@pytest.mark.parametrize("planted", [".dcpctl-prune.lock", "step-9/.metadata.tmp"])
def test_prune_writes_through_no_planted_symlink(run_cli, tmp_path, planted):
    victim = _victim(tmp_path)
    run_dir = tmp_path / "run"
    for name in ("step-1", "step-2", "step-9"):
        add_checkpoint(run_dir, name)
    (run_dir / planted).symlink_to(victim)
    result = run_cli("prune", run_dir, "--keep-last", "1")
    assert result.exit_code == 0, result.output
    assert victim.read_text() == "precious\n"


@pytest.mark.parametrize("command", [["checksum"], ["compress"], ["decompress"],
                                     ["compress", "--codec", "floatsplit"]])
@pytest.mark.parametrize("planted", [".SHA256SUMS.tmp", "SHA256SUMS.tmp", ".metadata.tmp"])
def test_commands_write_through_no_planted_symlink(run_cli, tmp_path, command, planted):
    victim = _victim(tmp_path)
    checkpoint = tmp_path / "ckpt"
    shutil.copytree(fixture_path("fsdp2_adamw_3ranks"), checkpoint)
    (checkpoint / planted).symlink_to(victim)
    run_cli(command[0], checkpoint, *command[1:])
    assert victim.read_text() == "precious\n"
    assert (checkpoint / planted).is_symlink()  # not ours: left as it was


def test_prune_leaves_a_checkpoint_another_dcpctl_is_using(run_cli, tmp_path):
    run_dir = tmp_path / "run"
    for name in ("step-1", "step-2", "step-3"):
        add_checkpoint(run_dir, name)
    with locked_directory(run_dir / "step-1", exclusive=False, what="a reader"):
        result = run_cli("prune", run_dir, "--keep-last", "1", "--json")
    assert result.exit_code == 1
    assert (run_dir / "step-1" / ".metadata").exists() and not (run_dir / "step-2").exists()
    assert "another dcpctl is using this checkpoint" in result.output


def test_prune_through_a_symlinked_checkpoint_deletes_nothing_outside(run_cli, tmp_path):
    outside = add_checkpoint(tmp_path, "outside")
    run_dir = tmp_path / "run"
    for name in ("step-2", "step-3"):
        add_checkpoint(run_dir, name)
    (run_dir / "step-1").symlink_to(outside, target_is_directory=True)
    before = directory_state(outside)
    result = run_cli("prune", run_dir, "--keep-last", "1")
    assert result.exit_code == 0
    assert directory_state(outside) == before and (run_dir / "step-1").is_symlink()
    assert sorted(p.name for p in run_dir.iterdir()) == ["step-1", "step-3"]
    assert tree_listing(outside)

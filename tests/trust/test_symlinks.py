"""Files dcpctl writes are created new (exclusive, no-follow) or locks are held on directories
themselves: a symlink planted where dcpctl writes never makes it write through, and prune,
run from cron as a privileged user, never deletes outside its run directory."""

from __future__ import annotations

import secrets
import shutil

import pytest
from conftest import add_checkpoint, back_date, directory_state, fixture_path, tree_listing

from dcpctl.storage.local import OutputFile, temporary_name, write_file_atomically
from dcpctl.storage.locks import locked_directory


def _victim(tmp_path):
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    return victim


@pytest.mark.parametrize("planted", ["step-1/.metadata.tmp", "step-1/__0_0.distcp",
                                     "step-1/data"])
def test_prune_deletes_a_planted_symlink_not_what_it_points_to(run_cli, tmp_path, planted):
    victim = _victim(tmp_path)
    victim_directory = tmp_path / "victim-directory"
    victim_directory.mkdir()
    (victim_directory / "file").write_text("precious\n")
    run_dir = tmp_path / "run"
    for name in ("step-1", "step-2", "step-9"):
        add_checkpoint(run_dir, name)
    (run_dir / planted).unlink(missing_ok=True)
    (run_dir / planted).symlink_to(victim_directory if planted.endswith("data") else victim)
    back_date(run_dir / "step-1", 3600)
    result = run_cli("prune", run_dir, "--keep-last", "1", "--incomplete-older-than", "1m")
    assert result.exit_code == 0, result.output
    # a data file linked out makes step-1 damaged, and kept: torch would follow the link
    assert (run_dir / "step-1").exists() == (planted == "step-1/__0_0.distcp")
    assert victim.read_text() == (victim_directory / "file").read_text() == "precious\n"


TOKEN = "0" * 12  # every temporary name a run gives, known in advance to plant a link there


@pytest.mark.parametrize("command, planted", [
    (["checksum"], "SHA256SUMS"), (["compress"], "__0_0.distcp"),
    (["compress"], ".metadata"), (["decompress", "--threads", "1"], "__1_0.distcp"),
    (["compress", "--codec", "floatsplit"], "__2_0.distcp")])
def test_commands_write_through_no_planted_symlink(run_cli, tmp_path, monkeypatch, command,
                                                   planted):
    """A link planted under the very temporary name the run will use is removed with the
    temporaries an interrupted run leaves, as a link, before anything is written."""
    monkeypatch.setattr(secrets, "token_hex", lambda size: TOKEN)
    victim = _victim(tmp_path)
    checkpoint = tmp_path / "ckpt"
    shutil.copytree(fixture_path("fsdp2_adamw_3ranks"), checkpoint)
    if command[0] == "decompress":
        assert run_cli("compress", checkpoint).exit_code == 0
    link = checkpoint / temporary_name(planted, TOKEN)
    link.symlink_to(victim)
    result = run_cli(command[0], checkpoint, *command[1:])
    assert result.exit_code == 0, result.output
    assert victim.read_text() == "precious\n" and not link.is_symlink()


@pytest.mark.parametrize("write", [
    lambda path: write_file_atomically(path, b"new"),
    lambda path: OutputFile(path.with_name(temporary_name(path.name, TOKEN)))])
def test_a_file_is_never_created_through_a_link_in_its_place(tmp_path, monkeypatch, write):
    """What stands where a file is created (a link planted after the stale temporaries went)
    stops the run, and stays."""
    monkeypatch.setattr(secrets, "token_hex", lambda size: TOKEN)
    victim = _victim(tmp_path)
    link = tmp_path / temporary_name("SHA256SUMS", TOKEN)
    link.symlink_to(victim)
    with pytest.raises(FileExistsError):
        write(tmp_path / "SHA256SUMS")
    assert victim.read_text() == "precious\n" and link.is_symlink()
    assert not (tmp_path / "SHA256SUMS").exists()


def test_prune_leaves_a_checkpoint_another_dcpctl_is_using(run_cli, tmp_path):
    """It exited 1, as for a deletion that failed for good: a cron job could not tell it from
    damage. Only in use, it is 75: try again later."""
    run_dir = tmp_path / "run"
    for name in ("step-1", "step-2", "step-3"):
        add_checkpoint(run_dir, name)
    with locked_directory(run_dir / "step-1", exclusive=False, what="a reader"):
        result = run_cli("prune", run_dir, "--keep-last", "1", "--json")
    assert result.exit_code == 75
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

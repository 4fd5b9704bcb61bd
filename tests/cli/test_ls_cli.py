"""`dcpctl ls` as a user runs it: table, JSON shape, exit codes."""

from __future__ import annotations

import json

import pytest
from conftest import add_checkpoint, back_date

from dcpctl.storage.locks import locked_checkpoint

DAY = 86400


def test_table_has_one_row_per_checkpoint_sorted_by_step(run_cli, tmp_path):
    add_checkpoint(tmp_path, "step_2000", fixture="zstd_fsdp2_2ranks", age_seconds=3 * DAY)
    add_checkpoint(tmp_path, "step-1000", age_seconds=3 * DAY)
    add_checkpoint(tmp_path, "step-3000", complete=False, age_seconds=7200)
    (tmp_path / "step-1000" / "SHA256SUMS").write_text("")
    back_date(tmp_path / "step-1000", 3 * DAY)
    (tmp_path / "step-4000").symlink_to(tmp_path / "step-1000")
    result = run_cli("ls", tmp_path)
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert lines[0].split() == ["STEP", "CHECKPOINT", "STATE", "SIZE", "AGE", "COMPRESSION",
                                "SHA256SUMS"]
    assert lines[1].split()[:3] + lines[1].split()[5:] == [
        "1000", "step-1000", "complete", "3d", "none", "yes"]
    assert lines[2].split()[:3] + lines[2].split()[5:] == [
        "2000", "step_2000", "complete", "3d", "zstd", "no"]
    assert lines[3].split()[:3] + lines[3].split()[5:] == [
        "3000", "step-3000", "incomplete", "2h", "-", "no"]
    assert lines[4:] == ["symlink step-4000 -> step-1000 (prune keeps it)",
                         "ignored step-4000: a symlink: never followed, never deleted"]


def test_json_shape(run_cli, tmp_path):
    add_checkpoint(tmp_path, "global_step10")
    payload = json.loads(run_cli("ls", tmp_path, "--json").output)
    assert set(payload) == {"run_dir", "checkpoints", "ignored", "tracked_step", "runs_below",
                            "named_otherwise"}
    (entry,) = payload["checkpoints"]
    assert set(entry) == {"name", "path", "step", "complete", "state", "size_bytes",
                          "modified_at", "age_seconds", "sha256sums", "compression", "problem",
                          "in_use", "parts", "linked_by", "doubt", "trainers_best"}
    assert (entry["step"], entry["complete"], entry["state"], entry["problem"],
            entry["in_use"]) == (10, True, "complete", None, None)
    assert (entry["parts"], payload["tracked_step"]) == ([], None)
    assert 3500 < entry["age_seconds"] < 3700 and entry["size_bytes"] > 0


@pytest.mark.parametrize("command", [["ls"], ["prune", "--keep-last", "1"]])
def test_a_run_directory_given_one_level_too_high_is_said_so(run_cli, tmp_path, command):
    """torchtitan's dump folder holds checkpoint/, the run directory: given the dump folder,
    ls said "no checkpoint directories", and a prune from cron did nothing, for ever, unsaid."""
    add_checkpoint(tmp_path / "dump" / "checkpoint", "step-10")
    (tmp_path / "dump" / "tb").mkdir()
    result = run_cli(command[0], tmp_path / "dump", *command[1:])
    assert result.exit_code == 0
    assert result.output.splitlines()[0] == (
        f"{tmp_path / 'dump'}: no checkpoint directories; checkpoint/ below it holds some: "
        "give it as the run directory")
    payload = json.loads(run_cli(command[0], tmp_path / "dump", *command[1:], "--json").stdout)
    assert payload["runs_below"] == ["checkpoint"]


@pytest.mark.parametrize("command", [["ls"], ["prune", "--keep-last", "1"]])
def test_dcp_checkpoints_not_named_by_a_step_are_named_where_none_is(run_cli, tmp_path,
                                                                     command):
    """A directory of checkpoints named `llama3`, `final`: "no checkpoint directories", and
    nothing said of the checkpoints there, which a new user took for ls missing them."""
    for name in ("llama3", "final"):
        add_checkpoint(tmp_path, name)
    (tmp_path / "per-rank").mkdir()  # saved with use_collectives=False
    for name in ("__0.metadata", "__0_0.distcp"):
        (tmp_path / "per-rank" / name).write_bytes(b"x")
    (tmp_path / "logs").mkdir()
    result = run_cli(command[0], tmp_path, *command[1:])
    assert result.exit_code == 0
    assert result.output.splitlines()[0] == (
        f"{tmp_path}: no checkpoint directories; final/, llama3/, per-rank/ in it are DCP "
        "checkpoints not named by a step (step-N, checkpoint-N, iter_N, ...), which ls and "
        "prune never take for the run's")
    payload = json.loads(run_cli(command[0], tmp_path, *command[1:], "--json").stdout)
    assert payload["named_otherwise"] == ["final", "llama3", "per-rank"]
    add_checkpoint(tmp_path, "step-1")
    payload = json.loads(run_cli(command[0], tmp_path, *command[1:], "--json").stdout)
    assert payload["named_otherwise"] == [] and len(payload["checkpoints"]) == 1
    assert sorted(path.name for path in tmp_path.iterdir()) == [
        "final", "llama3", "logs", "per-rank", "step-1"]


def test_empty_run_directory_and_errors(run_cli, tmp_path):
    result = run_cli("ls", tmp_path)
    assert result.exit_code == 0 and "no checkpoint directories" in result.output
    missing = run_cli("ls", tmp_path / "absent")
    assert missing.exit_code == 1
    assert missing.output.startswith(f"Error: {tmp_path / 'absent'}: no such directory")
    (tmp_path / "file").write_text("x")  # said `no such directory` too
    assert run_cli("ls", tmp_path / "file").output == (
        f"Error: {tmp_path / 'file'}: not a directory; give the run directory that holds the "
        "checkpoint directories\n")
    assert run_cli("ls").exit_code == 2


def test_a_damaged_checkpoint_is_damaged_in_ls_as_in_prune(run_cli, tmp_path):
    """ls called a checkpoint missing a data file `complete` (its problem on a line below),
    where prune's row for it says `damaged` and treats it as incomplete."""
    add_checkpoint(tmp_path, "step-10")
    add_checkpoint(tmp_path, "step-20")
    next((tmp_path / "step-20").glob("__1_*.distcp")).unlink()
    listing = run_cli("ls", tmp_path).output.splitlines()
    pruning = run_cli("prune", tmp_path, "--keep-last", "1", "--dry-run").output.splitlines()
    assert listing[2].split()[:3] == pruning[2].split()[:3] == ["20", "step-20", "damaged"]
    assert listing[1].split()[2] == pruning[1].split()[2] == "complete"
    assert listing[3].startswith("problem: ")


def test_a_checkpoint_another_dcpctl_is_changing_is_in_use_not_damaged(run_cli, tmp_path):
    """ls called a checkpoint that another dcpctl held to change it (an in-place compress)
    `damaged`, from the lock refusing its read, where prune called it complete."""
    add_checkpoint(tmp_path, "step-10")
    add_checkpoint(tmp_path, "step-20")
    with locked_checkpoint(tmp_path / "step-20", exclusive=True):
        listing = run_cli("ls", tmp_path).output.splitlines()
        payload = json.loads(run_cli("ls", tmp_path, "--json").output)["checkpoints"][1]
        pruning = run_cli("prune", tmp_path, "--keep-last", "1", "--dry-run").output
    assert listing[2].split()[2:4] == ["in", "use"]
    assert listing[3] == (f"in use: {tmp_path / 'step-20'}: another dcpctl is changing this "
                          "checkpoint; nothing was changed, try again later")
    assert not any(line.startswith("problem") for line in listing)
    assert (payload["problem"], payload["compression"]) == (None, None)
    assert payload["in_use"].startswith(f"{tmp_path / 'step-20'}: another dcpctl")
    assert "damaged" not in pruning and "newest complete" in pruning
    after = run_cli("ls", tmp_path).output.splitlines()
    assert after[2].split()[2] == "complete" and len(after) == 3

"""`dcpctl prune` as a cron job runs it: table, JSON shape, exit codes 0, 1 and 2."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from conftest import add_accelerate_checkpoint, add_checkpoint, fail_deletion_part_way, tree_listing

from dcpctl.cli.prune import parse_duration

DAY = 86400


@pytest.fixture
def run_dir(tmp_path):
    """Four complete checkpoints 30 days old and an incomplete one 3 days old."""
    for step in (100, 200, 300, 400):
        add_checkpoint(tmp_path, f"step-{step}", age_seconds=30 * DAY)
    add_checkpoint(tmp_path, "step-450", complete=False, age_seconds=3 * DAY)
    return tmp_path


def test_table_says_what_was_kept_deleted_and_why(run_cli, run_dir):
    result = run_cli("prune", run_dir, "--keep-last", "2", "--incomplete-older-than", "1d")
    assert result.exit_code == 0, result.output
    rows = [line.split(None, 7) for line in result.output.splitlines()]  # SIZE is 2 words
    assert [(row[1], row[6]) for row in rows[1:6]] == [
        ("step-100", "deleted"), ("step-200", "deleted"), ("step-300", "kept"),
        ("step-400", "kept"), ("step-450", "deleted")]
    assert rows[1][7] == "no rule keeps it"
    assert rows[4][7] == "newest complete; one of the last 2 complete"
    assert result.output.splitlines()[-1].startswith("deleted 3 of 3 checkpoints, freed ")


def test_json_shape(run_cli, run_dir):
    result = run_cli("prune", run_dir, "--keep-last", "3", "--keep", "step-1*", "--json")
    assert result.exit_code == 0
    payload = json.loads(result.stdout)
    assert set(payload) == {"run_dir", "dry_run", "rules", "checkpoints", "ignored",
                            "tracked_step", "runs_below", "named_otherwise", "delete_bytes",
                            "freed_bytes", "failed"}
    assert payload["rules"] == {"keep_last": 3, "keep_every_steps": None,
                                "keep_globs": ["step-1*"], "older_than_seconds": None,
                                "incomplete_older_than_seconds": None}
    assert {"state", "delete", "reasons", "status", "error", "damage", "step",
            "size_bytes"} <= set(payload["checkpoints"][0])
    assert payload["freed_bytes"] == 0 and payload["failed"] == 0  # every one kept


def test_dry_run_prints_the_same_plan_and_changes_nothing(run_cli, run_dir):
    arguments = ["prune", run_dir, "--keep-last", "1", "--keep-every", "200",
                 "--incomplete-older-than", "2d"]
    before = tree_listing(run_dir)
    dry = run_cli(*arguments, "--dry-run")
    assert dry.exit_code == 0 and tree_listing(run_dir) == before
    assert dry.output.splitlines()[-1].startswith("dry run: would delete 3 checkpoints")
    real = run_cli(*arguments)
    assert real.exit_code == 0 and (run_dir / "step-200").exists()

    def plan(output):
        return [" ".join(line.split()) for line in output.splitlines()[:-1]]

    assert [line.replace("would delete", "deleted") for line in plan(dry.output)] == plan(
        real.output)


def test_partial_failure_reports_both_and_exits_1(run_cli, run_dir, monkeypatch):
    fail_deletion_part_way(monkeypatch, "step-200")
    result = run_cli("prune", run_dir, "--keep-last", "1", "--json")
    assert result.exit_code == 1
    statuses = {c["name"]: c["status"] for c in json.loads(result.stdout)["checkpoints"]}
    assert statuses == {"step-100": "deleted", "step-200": "failed", "step-300": "deleted",
                        "step-400": "kept", "step-450": "kept"}
    assert result.stderr == (f"Error: {run_dir}: 1 of 3 checkpoint deletions failed; first, "
                             f"step-200: {run_dir}/step-200/__1_0.distcp: Permission denied\n")


def test_second_prune_exits_75_try_again_later_with_a_clear_message(run_dir, another_prune):
    with another_prune(run_dir):
        result = subprocess.run([sys.executable, "-m", "dcpctl", "prune", str(run_dir),
                                 "--keep-last", "1"], capture_output=True, text=True)
    assert result.returncode == 75 and not result.stdout
    assert result.stderr == (f"Error: {run_dir}: another dcpctl prune is pruning this run "
                             "directory; nothing was changed, try again later\n")
    assert (run_dir / "step-100").exists()


@pytest.mark.parametrize("arguments", [
    [], ["--keep-last", "0"], ["--keep-last", "2", "--keep-every", "0"],
    ["--keep-last", "2", "--older-than", "7"], ["--keep-last", "2", "--older-than", "0d"],
    ["--keep-last", "2", "--incomplete-older-than", "1 day"],
])
def test_usage_errors_exit_2_and_delete_nothing(run_cli, run_dir, arguments):
    before = tree_listing(run_dir)
    assert run_cli("prune", run_dir, *arguments).exit_code == 2
    assert tree_listing(run_dir) == before


def test_missing_run_directory_exits_1(run_cli, tmp_path):
    result = run_cli("prune", tmp_path / "absent", "--keep-last", "1")
    assert result.exit_code == 1 and "no such directory" in result.stderr


@pytest.mark.parametrize("text, seconds", [("45s", 45), ("30m", 1800), ("12h", 43200),
                                           ("7d", 604800), ("2w", 1209600)])
def test_durations(text, seconds):
    assert parse_duration(text) == seconds


def test_accelerate_checkpoints_are_listed_and_pruned_whole(run_cli, tmp_path):
    for step in range(3):
        add_accelerate_checkpoint(tmp_path, f"checkpoint_{step}")
    listing = run_cli("ls", tmp_path)
    assert listing.exit_code == 0
    assert [line.split()[1:4] for line in listing.output.splitlines()[1:]] == [
        [f"checkpoint_{step}", "(2", "parts)"] for step in range(3)]
    result = run_cli("prune", tmp_path, "--keep-last", "2")
    assert result.exit_code == 0
    assert sorted(os.listdir(tmp_path)) == ["checkpoint_1", "checkpoint_2"]
    before = tree_listing(tmp_path)
    refused = run_cli("prune", tmp_path / "checkpoint_1", "--keep-last", "1")
    assert refused.exit_code == 1 and tree_listing(tmp_path) == before
    assert refused.stderr == (f"Error: {tmp_path / 'checkpoint_1'}: is an accelerate checkpoint "
                              "itself (holds pytorch_model_fsdp_0); give the run directory "
                              "above it (accelerate's `checkpoints/`)\n")


def test_ls_shows_the_step_megatron_resumes_from(run_cli, tmp_path):
    for iteration in (1, 2):
        add_checkpoint(tmp_path, f"iter_{iteration:07d}")
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("1")
    listing = run_cli("ls", tmp_path)
    assert listing.output.splitlines()[-1] == ("tracked step: 1 (named by "
                                               "latest_checkpointed_iteration.txt; prune keeps it)")
    assert json.loads(run_cli("ls", tmp_path, "--json").stdout)["tracked_step"] == 1
    # prune's JSON gives it too, as the README says of both
    pruned = run_cli("prune", tmp_path, "--keep-last", "1", "--dry-run", "--json").stdout
    assert json.loads(pruned)["tracked_step"] == 1

"""Finding the checkpoints of a run directory: names, steps, states, sizes, ages, look-alikes."""

from __future__ import annotations

import os

import pytest
from conftest import add_checkpoint, back_date, fixture_path

from dcpctl.errors import CheckpointNotFoundError
from dcpctl.ops.runs.listing import list_run_directory
from dcpctl.ops.runs.scan import parse_step, scan_run_directory

HOUR = 3600


@pytest.mark.parametrize("name, step", [
    ("step-1000", 1000), ("step_2000", 2000), ("checkpoint-3000", 3000),
    ("global_step4000", 4000), ("5000", 5000), ("step-0100", 100), ("Step-7", 7),
    ("iter_0000123456", 123456), ("dist_epoch_3", 3), ("epoch_2", 2), ("ckpt-5", 5),
    ("iteration_7", 7), ("steps_9", 9), ("checkpoint_0", 0), ("CHECKPOINT-11", 11),
])
def test_every_name_style_gives_the_whole_trailing_number(name, step):
    assert parse_step(name) == step


@pytest.mark.parametrize("name", [
    "old-step-3-bak", "old-step-3", "step-3-bak", "step-3.tmp", "step-3.bak", ".step-3",
    "step--3", "step-", "step", "3a", "step 3", "", "ckpt-v2-100", "step-\u0663", "_3",
    "llama3", "gpt2", "ckpt_v2", "seed_1", "model_100", "run-5", "trial_3", "stepx3",
])
def test_names_that_only_look_like_steps_are_not_checkpoints(name):
    assert parse_step(name) is None


def test_scan_finds_each_style_sorted_by_step_and_skips_look_alikes(tmp_path):
    for name in ("5000", "global_step4000", "checkpoint-3000", "step_2000", "step-1000",
                 "old-step-3-bak", "step-3.bak"):
        add_checkpoint(tmp_path, name)
    (tmp_path / "logs").mkdir()
    (tmp_path / "config.yaml").write_text("lr: 1\n")
    scan = scan_run_directory(tmp_path)
    assert [(entry.name, entry.step) for entry in scan.checkpoints] == [
        ("step-1000", 1000), ("step_2000", 2000), ("checkpoint-3000", 3000),
        ("global_step4000", 4000), ("5000", 5000)]
    assert scan.ignored == []  # look-alikes are not named like checkpoints: not even mentioned


def test_complete_incomplete_and_not_a_checkpoint(tmp_path):
    add_checkpoint(tmp_path, "step-1")
    add_checkpoint(tmp_path, "step-2", complete=False)  # data files only
    (tmp_path / "step-3").mkdir()  # a save that has only made its directory
    metadata_tmp = tmp_path / "step-4"
    metadata_tmp.mkdir()
    (metadata_tmp / ".metadata.tmp").write_bytes(b"partial")
    hugging_face = tmp_path / "checkpoint-5"  # a Trainer checkpoint: not DCP, not ours
    hugging_face.mkdir()
    (hugging_face / "trainer_state.json").write_text("{}")
    scan = scan_run_directory(tmp_path)
    assert [(entry.name, entry.complete) for entry in scan.checkpoints] == [
        ("step-1", True), ("step-2", False), ("step-3", False), ("step-4", False)]
    assert [(entry.name, entry.reason) for entry in scan.ignored] == [
        ("checkpoint-5", "no .metadata and no .distcp files, in it or in a directory in it: "
                         "not a DCP checkpoint")]


def test_symlinks_and_files_named_like_checkpoints_are_ignored(tmp_path):
    run_dir, outside = tmp_path / "run", tmp_path / "outside"
    run_dir.mkdir()
    add_checkpoint(outside.parent, "outside")
    (run_dir / "step-9").symlink_to(outside, target_is_directory=True)
    (run_dir / "step-8").write_text("a file where a directory is expected")
    scan = scan_run_directory(run_dir)
    assert scan.checkpoints == []
    assert [(entry.name, entry.reason) for entry in scan.ignored] == [
        ("step-8", "not a directory"), ("step-9", "a symlink: never followed, never deleted")]


def test_size_sha256sums_and_age_from_the_newest_change_inside(tmp_path):
    old = add_checkpoint(tmp_path, "step-1", age_seconds=10 * HOUR)
    (old / "SHA256SUMS").write_text("")
    back_date(old, 10 * HOUR)
    touched = add_checkpoint(tmp_path, "step-2", age_seconds=10 * HOUR)
    os.utime(touched / "__0_0.distcp")  # one file written just now: the whole save is young
    first, second = scan_run_directory(tmp_path).checkpoints
    assert first.size_bytes == sum(path.stat().st_size for path in old.iterdir())
    assert first.has_sha256sums and not second.has_sha256sums
    assert 10 * HOUR - 60 < first.age_seconds < 10 * HOUR + 60
    assert second.age_seconds < 60


def test_ls_reads_compression_and_reports_damage(tmp_path):
    add_checkpoint(tmp_path, "step-1")
    add_checkpoint(tmp_path, "step-2", fixture="zstd_fsdp2_2ranks")
    damaged = add_checkpoint(tmp_path, "step-3")
    (damaged / ".metadata").write_bytes(b"not a pickle")
    add_checkpoint(tmp_path, "step-4", complete=False)
    listed = list_run_directory(tmp_path).checkpoints
    assert list(listed[0].compression) == ["none"] and list(listed[1].compression) == ["zstd"]
    assert listed[2].compression is None and "step-3/.metadata" in listed[2].problem
    assert listed[3].compression is None and listed[3].problem is None


def test_run_directory_must_exist_and_not_be_a_checkpoint(tmp_path):
    with pytest.raises(CheckpointNotFoundError, match="no such directory"):
        scan_run_directory(tmp_path / "absent")
    with pytest.raises(CheckpointNotFoundError, match="is a checkpoint itself"):
        scan_run_directory(fixture_path("mesh2d_4ranks"))
    # saved with use_collectives=False: each rank's own metadata, no .metadata (it listed none)
    (tmp_path / "__0_0.distcp").write_bytes(b"rank 0's data")
    (tmp_path / "__0.metadata").write_bytes(b"rank 0's metadata")
    with pytest.raises(CheckpointNotFoundError, match=r"is a checkpoint itself \(holds "
                       r"__0.metadata: saved with use_collectives=False\)"):
        scan_run_directory(tmp_path)


def test_a_checkpoint_directory_that_cannot_be_read_is_ignored_not_fatal(tmp_path, monkeypatch):
    """One step directory of another user's (mode 700) made ls and prune fail as a whole, so a
    cron prune stopped pruning everything else. (Tests run as root, who reads anything: the
    listing is made to fail as it does for another user.)"""
    from dcpctl.ops.runs import scan as scan_module

    run_dir = tmp_path / "run"
    for step in (1, 2):
        add_checkpoint(run_dir, f"step-{step}")
    (run_dir / "step-3").mkdir()
    listing = scan_module.file_names_in

    def denied_for_step_3(path):
        if path.name == "step-3":
            raise PermissionError(13, "Permission denied", str(path))
        return listing(path)

    monkeypatch.setattr(scan_module, "file_names_in", denied_for_step_3)
    scan = scan_run_directory(run_dir)
    assert [entry.name for entry in scan.checkpoints] == ["step-1", "step-2"]
    assert [(entry.name, entry.reason) for entry in scan.ignored] == [
        ("step-3", "cannot be read (Permission denied)")]

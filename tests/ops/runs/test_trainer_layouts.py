"""ls and prune on the run directories trainers write (dcpctl/ops/runs/layouts.py): accelerate's
`checkpoint_N/` of several DCP directories, Megatron's `iter_N/` with its tracker file."""

from __future__ import annotations

import errno
import json
import os

import pytest
from conftest import (ACCELERATE_PARTS, add_accelerate_checkpoint, add_checkpoint, fixture_path,
                      tree_listing)

from dcpctl.errors import CheckpointNotFoundError
from dcpctl.format.checkpoint.problems import ProblemsError
from dcpctl.ops.convert.targets import convert_checkpoint
from dcpctl.ops.inspection.report import inspect_checkpoint
from dcpctl.ops.runs import prune
from dcpctl.ops.runs.listing import list_run_directory
from dcpctl.ops.runs.prune import RetentionRules, prune_run_directory
from dcpctl.ops.runs.scan import scan_run_directory
from dcpctl.ops.transcode import compress_checkpoint

DAY = 86400
MEGATRON_CONFIG = ('{"sharded_backend": "torch_dist", "sharded_backend_version": 1, '
                   '"common_backend": "torch", "common_backend_version": 1}')


@pytest.fixture
def accelerate_run(tmp_path):
    run_dir = tmp_path / "checkpoints"
    for step in range(3):
        add_accelerate_checkpoint(run_dir, f"checkpoint_{step}")
    return run_dir


def test_each_accelerate_checkpoint_is_one_entry_with_its_parts(accelerate_run):
    add_accelerate_checkpoint(accelerate_run, "checkpoint_3", parts_complete=(True, False))
    add_accelerate_checkpoint(accelerate_run, "checkpoint_4", rng_states=False)
    scan = scan_run_directory(accelerate_run)
    assert [(entry.name, entry.step, entry.complete, entry.parts) for entry in scan.checkpoints] \
        == [(f"checkpoint_{step}", step, step < 3, ACCELERATE_PARTS) for step in range(5)]
    whole = sum(path.stat().st_size for path in (accelerate_run / "checkpoint_0").rglob("*")
                if path.is_file())
    assert scan.checkpoints[0].size_bytes == whole
    assert scan.ignored == []


def test_an_accelerate_checkpoint_short_of_its_registered_objects_is_kept_unsure(tmp_path):
    """accelerate writes the objects registered for checkpointing (custom_checkpoint_<i>.pkl)
    after the RNG states, and load_state refuses a checkpoint holding another number of them:
    checkpoint_1, cut short before them, was called complete, and prune deleted checkpoint_0,
    the one the run could resume from."""
    run_dir = tmp_path / "checkpoints"
    add_accelerate_checkpoint(run_dir, "checkpoint_0", custom_objects=2)
    add_accelerate_checkpoint(run_dir, "checkpoint_1", custom_objects=1)
    scan = scan_run_directory(run_dir)
    assert [(entry.name, entry.complete) for entry in scan.checkpoints] == [
        ("checkpoint_0", True), ("checkpoint_1", False)]
    assert scan.checkpoints[1].doubt.startswith(
        "holds 1 of the 2 objects registered for checkpointing (custom_checkpoint_<i>.pkl) that "
        "checkpoint_0 holds: a save cut short, or the first since fewer were registered")
    rules = RetentionRules(keep_last=1, incomplete_older_than_seconds=DAY)
    report = prune_run_directory(run_dir, rules)
    assert [decision.delete for decision in report.decisions] == [False, False]
    assert sorted(path.name for path in run_dir.iterdir()) == ["checkpoint_0", "checkpoint_1"]


def test_a_run_that_registers_fewer_objects_since_loses_none_of_its_new_checkpoints(tmp_path):
    """A run that stopped registering an object after resuming: every checkpoint since holds
    fewer than the ones before. Compared with the run's largest count, all of them were
    incomplete, and prune --incomplete-older-than deleted the only ones load_state reads now."""
    run_dir = tmp_path / "checkpoints"
    for step in range(6):
        add_accelerate_checkpoint(run_dir, f"checkpoint_{step}", custom_objects=int(step < 3))
    scan = scan_run_directory(run_dir)
    assert [(entry.complete, entry.doubt is not None) for entry in scan.checkpoints] == [
        (True, False)] * 3 + [(False, True)] + [(True, False)] * 2
    rules = RetentionRules(keep_last=2, incomplete_older_than_seconds=DAY)
    report = prune_run_directory(run_dir, rules)
    assert [decision.checkpoint.name for decision in report.decisions if decision.delete] == [
        "checkpoint_0", "checkpoint_1", "checkpoint_2"]
    assert sorted(path.name for path in run_dir.iterdir()) == [
        "checkpoint_3", "checkpoint_4", "checkpoint_5"]


def add_trainer_checkpoint(run_dir, name, finished=True, optimizer=True, best=None):
    """A checkpoint as the transformers Trainer writes it under FSDP with SHARDED_STATE_DICT:
    accelerate's DCP parts, then scheduler.pt, each rank's RNG state and trainer_state.json
    (naming best as its best_model_checkpoint, a path as the Trainer writes it)."""
    checkpoint = run_dir / name
    for part in ACCELERATE_PARTS if optimizer else ("pytorch_model_fsdp_0",):
        add_checkpoint(checkpoint, part, complete=True)
    (checkpoint / "scheduler.pt").write_bytes(b"scheduler state")
    for rank in range(2):
        (checkpoint / f"rng_state_{rank}.pth").write_bytes(b"rng state")
    if finished:
        (checkpoint / "trainer_state.json").write_text(json.dumps(
            {"global_step": 1, "best_model_checkpoint": best and f"output/{best}",
             "log_history": [{"loss": 1.0}]}))
    return checkpoint


def test_prune_keeps_the_trainers_best_checkpoint(tmp_path):
    """load_best_model_at_end: the Trainer's rotation keeps the checkpoint its state names
    best_model_checkpoint, and loads it at the end; prune --keep-last 1 deleted it."""
    run_dir = tmp_path / "output"
    for step in (500, 1000, 1500):
        add_trainer_checkpoint(run_dir, f"checkpoint-{step}", best="checkpoint-500")
    add_trainer_checkpoint(run_dir, "checkpoint-2000", finished=False)
    scan = scan_run_directory(run_dir)
    assert [entry.trainers_best for entry in scan.checkpoints] == [True, False, False, False]
    report = prune_run_directory(run_dir, RetentionRules(keep_last=1))
    assert [decision.checkpoint.name for decision in report.decisions if decision.delete] == [
        "checkpoint-1000"]
    assert report.decisions[0].reasons == ["the Trainer's best_model_checkpoint "
                                           "(trainer_state.json)"]
    for state in ("not JSON", "[" * 100_000, '{"best_model_checkpoint": 3}'):
        (run_dir / "checkpoint-1500" / "trainer_state.json").write_text(state)
        assert not any(entry.trainers_best for entry in scan_run_directory(run_dir).checkpoints)


def test_transformers_trainer_checkpoints_are_complete_once_its_state_is_written(tmp_path):
    """Trainer writes accelerate's parts but not accelerate's RNG states: every one of its
    checkpoints read as incomplete, and --incomplete-older-than deleted them all."""
    run_dir = tmp_path / "output"
    for step in (500, 1000, 1500):
        add_trainer_checkpoint(run_dir, f"checkpoint-{step}", optimizer=step != 1000)
    add_trainer_checkpoint(run_dir, "checkpoint-2000", finished=False)
    for path in run_dir.rglob("*"):
        os.utime(path, (0, 0))  # long unchanged
    scan = scan_run_directory(run_dir)
    assert [(entry.name, entry.complete) for entry in scan.checkpoints] == [
        ("checkpoint-500", True), ("checkpoint-1000", True), ("checkpoint-1500", True),
        ("checkpoint-2000", False)]
    report = prune_run_directory(run_dir, RetentionRules(keep_last=2,
                                                         incomplete_older_than_seconds=DAY))
    assert [decision.checkpoint.name for decision in report.with_status(prune.DELETED)] == [
        "checkpoint-500", "checkpoint-2000"]
    assert sorted(os.listdir(run_dir)) == ["checkpoint-1000", "checkpoint-1500"]


def test_an_accelerate_checkpoint_is_checksummed_when_every_part_is(accelerate_run):
    from dcpctl.ops.checksum import checksum_checkpoint

    for name, parts in (("checkpoint_1", ACCELERATE_PARTS),
                        ("checkpoint_2", ACCELERATE_PARTS[:1])):
        for part in parts:
            checksum_checkpoint(accelerate_run / name / part)
    scan = scan_run_directory(accelerate_run)
    assert [entry.has_sha256sums for entry in scan.checkpoints] == [False, True, False]


def test_ls_sums_the_compression_of_the_parts(accelerate_run):
    items = inspect_checkpoint(fixture_path("mesh2d_4ranks")).compression["none"]
    compress_checkpoint(accelerate_run / "checkpoint_1" / "optimizer_0")
    listed = {item.entry.name: item for item in list_run_directory(accelerate_run).checkpoints}
    assert listed["checkpoint_0"].compression == {"none": 2 * items}
    assert listed["checkpoint_1"].compression == {"none": items, "zstd": items}
    assert all(item.problem is None for item in listed.values())


def test_a_damaged_part_is_named_in_ls(accelerate_run):
    (accelerate_run / "checkpoint_2" / "optimizer_0" / ".metadata").write_bytes(b"garbage")
    listed = {item.entry.name: item for item in list_run_directory(accelerate_run).checkpoints}
    assert "optimizer_0/.metadata" in listed["checkpoint_2"].problem


def test_ls_names_the_damage_prune_finds(tmp_path):
    """ls read only what inspect reads and showed a checkpoint whose items overlap as sound,
    the newest one to resume from, while prune called it damaged."""
    import dataclasses

    from dcpctl.format.metadata.reading import read_metadata
    from dcpctl.format.metadata.writing import serialize_metadata

    run_dir = tmp_path / "run"
    for step in (1, 2):
        add_checkpoint(run_dir, f"step-{step}", fixture="fsdp2_adamw_3ranks")
    metadata_path = run_dir / "step-2" / ".metadata"
    metadata = read_metadata(metadata_path.parent)
    first = min(metadata.storage_data.values(), key=lambda info: info.offset)
    second_key, second = next((key, info) for key, info in metadata.storage_data.items()
                              if info.relative_path == first.relative_path and info != first)
    metadata.storage_data[second_key] = dataclasses.replace(second, offset=first.offset)
    metadata_path.write_bytes(serialize_metadata(metadata))
    listed = {item.entry.name: item for item in list_run_directory(run_dir).checkpoints}
    assert listed["step-1"].problem is None
    assert listed["step-2"].problem.startswith(f"{metadata_path.parent}/")
    assert "item-overlap" in listed["step-2"].problem
    decisions = prune_run_directory(run_dir, RetentionRules(keep_last=1), dry_run=True)
    assert {decision.checkpoint.name: decision.damage for decision in decisions.decisions}[
        "step-2"] is not None


def test_a_checkpoint_that_lost_a_file_its_sha256sums_lists_is_damaged_to_ls_and_prune(
        tmp_path):
    """Megatron's common.pt gone from the newest: verify --quick said damaged, ls said sound
    and prune kept it as the newest complete checkpoint, deleting the sound one before."""
    import torch

    from dcpctl.ops.checksum import checksum_checkpoint

    run_dir = tmp_path / "run"
    for step in (1, 2):
        checkpoint = add_checkpoint(run_dir, f"iter_{step:07d}", fixture="fsdp2_adamw_3ranks")
        torch.save({"iteration": step}, checkpoint / "common.pt")
        (checkpoint / "metadata.json").write_text(MEGATRON_CONFIG)
        checksum_checkpoint(checkpoint)
    (run_dir / "iter_0000002" / "common.pt").unlink()
    listed = {item.entry.name: item for item in list_run_directory(run_dir).checkpoints}
    assert "common.pt: missing-file: listed in SHA256SUMS but absent" in listed[
        "iter_0000002"].problem
    assert listed["iter_0000001"].problem is None
    report = prune_run_directory(run_dir, RetentionRules(keep_last=1))
    assert report.with_status(prune.DELETED) == []
    assert sorted(os.listdir(run_dir)) == ["iter_0000001", "iter_0000002"]


def test_a_megatron_iteration_without_its_metadata_json_is_incomplete(tmp_path):
    """Megatron writes common.pt first and metadata.json after `.metadata`, and its loader
    refuses a directory without metadata.json: iter_0000002, cut short before it, was called
    complete, and prune deleted iter_0000001, the one the run could resume from."""
    import torch

    run_dir = tmp_path / "run"
    for step in (1, 2):
        checkpoint = add_checkpoint(run_dir, f"iter_{step:07d}", age_seconds=30 * DAY)
        torch.save({"iteration": step}, checkpoint / "common.pt")
    (run_dir / "iter_0000001" / "metadata.json").write_text(MEGATRON_CONFIG)
    scan = scan_run_directory(run_dir)
    assert [(entry.name, entry.complete) for entry in scan.checkpoints] == [
        ("iter_0000001", True), ("iter_0000002", False)]
    report = prune_run_directory(run_dir, RetentionRules(keep_last=1))
    assert report.with_status(prune.DELETED) == []
    assert sorted(os.listdir(run_dir)) == ["iter_0000001", "iter_0000002"]


def test_lightning_s_checkpoints_are_listed_by_step_and_complete_once_meta_pt_is_written(
        tmp_path):
    """Lightning's ModelCheckpoint names a sharded checkpoint as it names a file
    (`epoch=0-step=10.ckpt`): ls listed none, and prune kept nothing by step. Lightning writes
    meta.pt after `.metadata`, and loads no directory without it: step 30, cut short before
    it, is incomplete, so prune keeps step 20, the one the run can resume from."""
    import torch

    run_dir = tmp_path / "checkpoints"
    for name in ("epoch=0-step=9.ckpt", "epoch=0-step=10.ckpt", "epoch=1-step=20.ckpt",
                 "step=30.ckpt", "last.ckpt", "epoch=1-step=20-v1.ckpt",
                 "epoch=1-step=20-val_loss=0.25.ckpt"):
        checkpoint = add_checkpoint(run_dir, name, age_seconds=30 * DAY)
        if name != "step=30.ckpt":
            torch.save({"global_step": 1}, checkpoint / "meta.pt")
    scan = scan_run_directory(run_dir)
    assert [(entry.name, entry.step, entry.complete) for entry in scan.checkpoints] == [
        ("epoch=0-step=9.ckpt", 9, True), ("epoch=0-step=10.ckpt", 10, True),
        ("epoch=1-step=20.ckpt", 20, True), ("step=30.ckpt", 30, False)]
    report = prune_run_directory(run_dir, RetentionRules(keep_last=1))
    assert [decision.checkpoint.name for decision in report.with_status(prune.DELETED)] == [
        "epoch=0-step=9.ckpt", "epoch=0-step=10.ckpt"]
    assert sorted(os.listdir(run_dir)) == [
        "epoch=1-step=20-v1.ckpt", "epoch=1-step=20-val_loss=0.25.ckpt", "epoch=1-step=20.ckpt",
        "last.ckpt", "step=30.ckpt"]


def test_prune_deletes_whole_accelerate_checkpoints_only(accelerate_run):
    add_accelerate_checkpoint(accelerate_run, "checkpoint_3", parts_complete=(True, False))
    report = prune_run_directory(accelerate_run, RetentionRules(keep_last=1))
    assert [decision.checkpoint.name for decision in report.with_status(prune.DELETED)] == [
        "checkpoint_0", "checkpoint_1"]
    assert sorted(os.listdir(accelerate_run)) == ["checkpoint_2", "checkpoint_3"]
    assert sorted(os.listdir(accelerate_run / "checkpoint_3")) == [
        *ACCELERATE_PARTS, "random_states_0.pkl", "random_states_1.pkl", "scheduler.bin"]


@pytest.mark.parametrize("command", [scan_run_directory, list_run_directory,
                                     lambda path: prune_run_directory(path, RetentionRules(1))])
def test_an_accelerate_checkpoint_given_as_the_run_directory_is_refused(accelerate_run,
                                                                        command):
    before = tree_listing(accelerate_run)
    with pytest.raises(CheckpointNotFoundError, match="checkpoint_1: is an accelerate "
                                                      "checkpoint itself"):
        command(accelerate_run / "checkpoint_1")
    assert tree_listing(accelerate_run) == before


def test_a_deletion_cut_short_leaves_every_part_incomplete(accelerate_run, monkeypatch):
    def cut_short(descriptor):
        raise PermissionError(errno.EACCES, "Permission denied")

    monkeypatch.setattr(prune, "empty_directory", cut_short)
    report = prune_run_directory(accelerate_run, RetentionRules(keep_last=2))
    assert [decision.status for decision in report.decisions] == ["failed", "kept", "kept"]
    for part in ACCELERATE_PARTS:
        assert not (accelerate_run / "checkpoint_0" / part / ".metadata").exists()
        assert (accelerate_run / "checkpoint_1" / part / ".metadata").exists()
    entry = scan_run_directory(accelerate_run).checkpoints[0]
    assert (entry.name, entry.complete) == ("checkpoint_0", False)


def test_a_part_swapped_for_a_symlink_is_never_followed(accelerate_run, tmp_path):
    outside = add_checkpoint(tmp_path / "elsewhere", "precious")
    before = tree_listing(outside)
    scan = scan_run_directory(accelerate_run)
    part = accelerate_run / "checkpoint_0" / "optimizer_0"
    os.rename(part, tmp_path / "moved-away")
    os.symlink(outside, part)
    decision = prune.PruneDecision(scan.checkpoints[0], delete=True, reasons=[])
    prune._carry_out(decision, lambda: _delete(accelerate_run, scan.checkpoints[0]))
    assert decision.status == "failed" and "no longer a real directory" in decision.error
    assert tree_listing(outside) == before


def _delete(run_dir, entry):
    descriptor = os.open(run_dir, os.O_RDONLY | os.O_DIRECTORY)
    try:
        prune.delete_checkpoint_directory(descriptor, entry)
    finally:
        os.close(descriptor)


@pytest.mark.parametrize("tracker,kept", [
    ("2\n", ["iter_0000002", "iter_0000004"]),
    ("release", ["iter_0000004"]),
    ("not a number", ["iter_0000004"]),
])
def test_prune_keeps_the_iteration_megatron_resumes_from(tmp_path, tracker, kept):
    for iteration in range(1, 5):
        add_checkpoint(tmp_path, f"iter_{iteration:07d}", age_seconds=30 * DAY)
    (tmp_path / "latest_checkpointed_iteration.txt").write_text(tracker)
    report = prune_run_directory(tmp_path, RetentionRules(keep_last=1))
    assert sorted(name for name in os.listdir(tmp_path) if name.startswith("iter_")) == kept
    assert (tmp_path / "latest_checkpointed_iteration.txt").read_text() == tracker
    if len(kept) == 2:
        decision = next(decision for decision in report.decisions
                        if decision.checkpoint.name == "iter_0000002")
        assert decision.reasons == ["named by latest_checkpointed_iteration.txt: the trainer "
                                    "resumes from it"]


def test_a_tracker_that_is_a_symlink_or_huge_is_not_read(tmp_path):
    add_checkpoint(tmp_path, "iter_0000001")
    secret = tmp_path / "secret"
    secret.write_text("1")
    (tmp_path / "latest_checkpointed_iteration.txt").symlink_to(secret)
    assert scan_run_directory(tmp_path).tracked_step is None
    (tmp_path / "latest_checkpointed_iteration.txt").unlink()
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("1" + " " * (1 << 20))
    assert scan_run_directory(tmp_path).tracked_step is None


def test_a_tracker_of_more_digits_than_python_reads_names_no_iteration(tmp_path):
    """Read whole, 5,000 digits reached int(), which refuses past 4,300: ls and prune of the
    run failed with an internal error."""
    add_checkpoint(tmp_path, "iter_0000001")
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("9" * 5000)
    assert scan_run_directory(tmp_path).tracked_step is None


def test_a_tracker_padded_with_white_space_names_its_iteration(tmp_path):
    """Megatron reads the tracker whole and strips it: `200` and a hundred spaces was not
    read (over 64 bytes), and prune --keep-last 1 deleted the iteration Megatron resumes from."""
    for iteration in (100, 200, 300):
        add_checkpoint(tmp_path, f"iter_{iteration:07d}", age_seconds=30 * DAY)
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("200" + " " * 100 + "\n")
    assert scan_run_directory(tmp_path).tracked_step == 200
    prune_run_directory(tmp_path, RetentionRules(keep_last=1))
    assert sorted(name for name in os.listdir(tmp_path) if name.startswith("iter_")) == [
        "iter_0000200", "iter_0000300"]


def test_a_tracker_that_is_a_directory_is_not_read(tmp_path):
    """`ls` and `prune` of the whole run failed on it: `Error: 3: Is a directory`."""
    add_checkpoint(tmp_path, "iter_0000001")
    (tmp_path / "latest_checkpointed_iteration.txt").mkdir()
    assert scan_run_directory(tmp_path).tracked_step is None


@pytest.mark.parametrize("layout", ["Lightning", "Megatron-Core torch_dist"])
@pytest.mark.parametrize("impostor", ["fifo", "symlink", "directory"])
def test_a_side_file_that_is_no_regular_file_makes_the_checkpoint_damaged(tmp_path, layout,
                                                                          impostor):
    """Lightning's meta.pt (or Megatron's metadata.json) a FIFO or a symlink in the newest
    checkpoint: ls called it complete, the newest, and prune --keep-last 1 deleted the two sound
    ones before it, though the trainer cannot load it as saved; compress -o left it out of its
    output, exit 0."""
    import torch

    run_dir = tmp_path / "run"
    side_file = "meta.pt" if layout == "Lightning" else "metadata.json"
    names = ([f"epoch=0-step={step}.ckpt" for step in (1, 2, 3)] if layout == "Lightning"
             else [f"iter_{step:07d}" for step in (1, 2, 3)])
    for name in names:
        checkpoint = add_checkpoint(run_dir, name, age_seconds=30 * DAY)
        if layout == "Megatron-Core torch_dist":
            torch.save({"iteration": 1}, checkpoint / "common.pt")
        if name != names[-1]:
            if layout == "Lightning":
                torch.save({"global_step": 1}, checkpoint / side_file)
            else:
                (checkpoint / side_file).write_text(MEGATRON_CONFIG)
    newest = run_dir / names[-1]
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    if impostor == "fifo":
        os.mkfifo(newest / side_file)
    elif impostor == "symlink":
        (elsewhere / side_file).write_bytes((run_dir / names[0] / side_file).read_bytes())
        (newest / side_file).symlink_to(elsewhere / side_file)
    else:
        (newest / side_file).mkdir()
        (newest / side_file / "x").write_text("x")
    report = prune_run_directory(run_dir, RetentionRules(keep_last=1))
    # a directory in its place lists no file of that name: the trainer's last file is missing
    state = "incomplete" if impostor == "directory" else "damaged"
    assert [(decision.checkpoint.name, decision.state, decision.status)
            for decision in report.decisions] == [
        (names[0], "complete", "deleted"), (names[1], "complete", "kept"),
        (names[2], state, "kept")]
    expected = (f"{newest / side_file}: not-regular-file: {layout}'s {side_file} is not a "
                "regular file here (a FIFO, a directory, or a symlink out of the checkpoint)")
    if state == "damaged":
        assert report.decisions[2].damage == expected
    with pytest.raises(ProblemsError) as refused:
        compress_checkpoint(newest, "zstd", output_path=str(tmp_path / "out"))
    assert str(refused.value) == expected
    assert not (tmp_path / "out").exists()
    # convert carries no side file, and refuses what verify --quick calls damaged all the same
    for target in ("safetensors", "torch"):
        with pytest.raises(ProblemsError) as refused:
            convert_checkpoint(newest, target, tmp_path / f"out.{target}")
        assert str(refused.value) == expected
        assert not (tmp_path / f"out.{target}").exists()


def test_a_part_in_use_stops_the_whole_deletion_before_any_metadata_goes(accelerate_run):
    """One part held by another dcpctl: prune said "nothing was changed", but the parts
    before it had already lost their `.metadata`, so the checkpoint was left incomplete."""
    from dcpctl.storage.locks import locked_checkpoint

    held = accelerate_run / "checkpoint_0" / ACCELERATE_PARTS[-1]
    with locked_checkpoint(held, exclusive=False):
        report = prune_run_directory(accelerate_run, RetentionRules(keep_last=2))
    failed = {d.checkpoint.name: d.error for d in report.decisions if d.status == "failed"}
    assert list(failed) == ["checkpoint_0"] and "another dcpctl is using this part" in \
        failed["checkpoint_0"]
    assert all((accelerate_run / "checkpoint_0" / part / ".metadata").exists()
               for part in ACCELERATE_PARTS)


def _zip_without(data: bytes, leave_out: str, replace: dict | None = None) -> bytes:
    """The zip archive data, rewritten with sound CRC-32s, less the records whose name ends
    with leave_out, its records named in replace holding other bytes."""
    import io
    import zipfile

    with zipfile.ZipFile(io.BytesIO(data)) as source:
        out = io.BytesIO()
        with zipfile.ZipFile(out, "w") as rewritten:
            for name in source.namelist():
                if not name.endswith(leave_out):
                    rewritten.writestr(name, (replace or {}).get(name.partition("/")[2],
                                                                 source.read(name)))
    return out.getvalue()


@pytest.mark.parametrize("damage", ["meta.pt cut short", "meta.pt empty",
                                    "common.pt cut short", "metadata.json not JSON",
                                    "meta.pt a zip of no pickle", "meta.pt without its storage",
                                    "meta.pt bit flipped", "common.pt gone"])
def test_a_side_file_cut_short_keeps_the_checkpoint_from_being_the_newest(tmp_path, damage):
    """Lightning writes meta.pt last, with torch.save, not atomically: a save killed while
    writing it left a meta.pt cut short that ls called complete and sound, and prune
    --keep-last 1 deleted the two checkpoints before it, leaving one torch.load cannot read.
    So did a sound zip whose data.pkl is no pickle, or names a storage it lacks, a bit
    flipped inside meta.pt (the quick check read its zip directory alone), and a Megatron
    checkpoint whose common.pt is gone."""
    import torch

    from dcpctl.ops.verify.verifier import verify_checkpoint

    run_dir = tmp_path / "run"
    lightning = damage.startswith("meta.pt")
    names = ([f"epoch=0-step={step}.ckpt" for step in (1, 2, 3)] if lightning
             else [f"iter_{step:07d}" for step in (1, 2, 3)])
    for name in names:
        checkpoint = add_checkpoint(run_dir, name, age_seconds=30 * DAY)
        if lightning:
            torch.save({"global_step": 1, "loops": list(range(100)), "seed": torch.arange(3)},
                       checkpoint / "meta.pt")
        else:
            torch.save({"iteration": 1}, checkpoint / "common.pt")
            (checkpoint / "metadata.json").write_text(MEGATRON_CONFIG)
    newest = run_dir / names[-1]
    side_file = damage.split()[0]
    data = (newest / side_file).read_bytes()
    if "cut short" in damage or "empty" in damage or "JSON" in damage:
        (newest / side_file).write_bytes(data[:len(data) // 2] if "cut short" in damage
                                         else b"" if "empty" in damage else b"{not json")
    elif "no pickle" in damage:
        (newest / side_file).write_bytes(_zip_without(data, "/data/0",
                                                      {"data.pkl": b"not a pickle"}))
    elif "storage" in damage:
        (newest / side_file).write_bytes(_zip_without(data, "/data/0"))
    elif "flipped" in damage:
        flipped = bytearray(data)
        flipped[data.index(b"loops") + 1] ^= 0x01  # inside data.pkl: its CRC-32 fails
        (newest / side_file).write_bytes(bytes(flipped))
    else:
        (newest / side_file).unlink()
    for weights_only in (False, True):  # a flipped bit torch loads, changed, unsaid
        if "gone" not in damage and "JSON" not in damage and "flipped" not in damage:
            with pytest.raises(Exception):
                torch.load(newest / side_file, weights_only=weights_only)
    states = [row.state for row in list_run_directory(run_dir).checkpoints]
    assert states == ["complete", "complete", "damaged"]
    report = prune_run_directory(run_dir, RetentionRules(keep_last=1))
    assert [(decision.checkpoint.name, decision.status) for decision in report.decisions] == [
        (names[0], "deleted"), (names[1], "kept"), (names[2], "kept")]
    assert report.decisions[1].reasons[0] == "newest complete"
    quick = verify_checkpoint(newest, deep=False)
    assert quick.status == "damaged"
    assert [problem.file for problem in quick.problems] == [side_file]


def test_a_checkpoint_a_side_file_of_another_links_into_is_kept(tmp_path):
    """iter_0000003's metadata.json linked to iter_0000001's: prune --keep-last 1 kept
    iter_0000003 (the tracker names it) and deleted iter_0000001, leaving the checkpoint the
    trainer resumes from, which Megatron loaded through the link, with a dangling file."""
    import torch

    run_dir = tmp_path / "run"
    names = [f"iter_{step:07d}" for step in (1, 2, 3)]
    for name in names:
        checkpoint = add_checkpoint(run_dir, name, age_seconds=30 * DAY)
        torch.save({"iteration": 1}, checkpoint / "common.pt")
        (checkpoint / "metadata.json").write_text(MEGATRON_CONFIG)
    (run_dir / names[2] / "metadata.json").unlink()
    (run_dir / names[2] / "metadata.json").symlink_to(f"../{names[0]}/metadata.json")
    (run_dir / "latest_checkpointed_iteration.txt").write_text("3")
    scan = scan_run_directory(run_dir)
    assert [entry.linked_by for entry in scan.checkpoints] == [
        (f"{names[2]}/metadata.json",), (), ()]
    report = prune_run_directory(run_dir, RetentionRules(keep_last=1))
    assert [decision.status for decision in report.decisions] == ["kept"] * 3
    assert report.decisions[0].reasons == [
        f"symlink {names[2]}/metadata.json points to it"]
    assert json.loads((run_dir / names[2] / "metadata.json").read_text())

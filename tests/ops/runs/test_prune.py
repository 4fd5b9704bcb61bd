"""Pruning real run directories: each rule, their combination, and the safety rules."""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import subprocess
from typing import Iterator

import pytest
from conftest import (add_checkpoint, back_date, fail_deletion_part_way, fixture_path,
                      tree_listing)

from dcpctl.errors import (InvalidOptionError, LockHeldError, UnsafePathError,
                           UnsupportedLayoutError)
from dcpctl.ops.runs import prune
from dcpctl.ops.runs.prune import RetentionRules, delete_checkpoint_directory, prune_run_directory
from dcpctl.ops.runs.scan import scan_run_directory

HOUR, DAY = 3600, 86400
# prune ran on the truth value of NotImplemented (deprecated; a TypeError in newer Pythons)
pytestmark = pytest.mark.filterwarnings("error::DeprecationWarning:dcpctl")


def _run_dir(tmp_path, steps, age_seconds=30 * DAY):
    """A run directory of complete checkpoints step-<n>, all aged age_seconds."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    for step in steps:
        add_checkpoint(run_dir, f"step-{step}", age_seconds=age_seconds)
    return run_dir


def _prune(run_dir, dry_run=False, **rules):
    return prune_run_directory(run_dir, RetentionRules(**rules), dry_run=dry_run)


def _deleted(report):
    return [d.checkpoint.name for d in report.decisions if d.delete]


def _remaining(run_dir):
    return sorted(path.name for path in run_dir.iterdir())


def test_keep_last_deletes_the_older_ones_and_frees_their_bytes(tmp_path):
    run_dir = _run_dir(tmp_path, [100, 200, 300, 400])
    report = _prune(run_dir, keep_last=2)
    assert _deleted(report) == ["step-100", "step-200"]
    assert _remaining(run_dir) == ["step-300", "step-400"]
    assert [d.status for d in report.decisions] == ["deleted", "deleted", "kept", "kept"]
    assert report.freed_bytes == report.delete_bytes == sum(
        d.checkpoint.size_bytes for d in report.decisions[:2]) > 0
    assert report.decisions[3].reasons == ["newest complete", "one of the last 2 complete"]


def test_a_tree_planted_deep_in_a_checkpoint_is_measured_and_deleted(tmp_path, deep_tree):
    """Deeper than Python's recursion limit: ls and prune walk and delete without recursing."""
    run_dir = _run_dir(tmp_path, [100, 200])
    deep_tree(run_dir / "step-100")
    (first, _) = scan_run_directory(run_dir).checkpoints
    assert first.size_bytes == sum(path.stat().st_size for path in (run_dir / "step-100").iterdir()
                                   if path.is_file())
    assert _deleted(_prune(run_dir, keep_last=1)) == ["step-100"]
    assert _remaining(run_dir) == ["step-200"]


def test_keep_every_keeps_multiples_of_the_step(tmp_path):
    run_dir = _run_dir(tmp_path, [1000, 1500, 2000, 2500, 3000])
    assert _deleted(_prune(run_dir, keep_last=1, keep_every_steps=1000)) == [
        "step-1500", "step-2500"]
    assert _remaining(run_dir) == ["step-1000", "step-2000", "step-3000"]


def test_keep_glob_keeps_matching_names(tmp_path):
    run_dir = _run_dir(tmp_path, [100, 200, 300])
    report = _prune(run_dir, keep_last=1, keep_globs=("step-1*", "nothing-*"))
    assert _deleted(report) == ["step-200"]
    assert report.decisions[0].reasons == ["matches --keep 'step-1*'"]


def test_older_than_deletes_only_old_checkpoints(tmp_path):
    run_dir = _run_dir(tmp_path, [100, 200], age_seconds=10 * DAY)
    add_checkpoint(run_dir, "step-300", age_seconds=HOUR)
    add_checkpoint(run_dir, "step-400", age_seconds=HOUR)
    report = _prune(run_dir, keep_last=1, older_than_seconds=7 * DAY)
    assert _deleted(report) == ["step-100", "step-200"]
    assert report.decisions[2].reasons == ["changed within --older-than"]


def test_rules_combine_a_checkpoint_is_kept_if_any_rule_keeps_it(tmp_path):
    run_dir = _run_dir(tmp_path, [1000, 1500, 2000, 2500, 3000, 3500, 4000], age_seconds=10 * DAY)
    add_checkpoint(run_dir, "step-4500", age_seconds=HOUR)
    add_checkpoint(run_dir, "step-5000", age_seconds=HOUR)
    report = _prune(run_dir, keep_last=2, keep_every_steps=2000, keep_globs=("*-1500",),
                    older_than_seconds=DAY)
    assert _deleted(report) == ["step-1000", "step-2500", "step-3000", "step-3500"]
    reasons = {d.checkpoint.name: d.reasons for d in report.decisions}
    assert reasons["step-1500"] == ["matches --keep '*-1500'"]
    assert reasons["step-2000"] == reasons["step-4000"] == ["step is a multiple of 2000"]
    assert reasons["step-4500"] == ["one of the last 2 complete", "changed within --older-than"]
    assert reasons["step-5000"][0] == "newest complete"
    assert reasons["step-1000"] == ["no rule keeps it"]


def test_every_name_style_is_pruned_by_step_and_look_alikes_are_never_touched(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    for name in ("5000", "global_step4000", "checkpoint-3000", "step_2000", "step-1000",
                 "old-step-3-bak", "step-9000.bak", "step-9999-copy"):
        add_checkpoint(run_dir, name)
    _prune(run_dir, keep_last=2)
    assert _remaining(run_dir) == ["5000", "global_step4000", "old-step-3-bak", "step-9000.bak",
                                   "step-9999-copy"]


def test_checkpoints_of_one_step_are_kept_together(tmp_path):
    """Two checkpoints of the newest step have no order between them: one of them was deleted
    as kept by no rule, as the list happened to sort."""
    run_dir = _run_dir(tmp_path, [300])
    add_checkpoint(run_dir, "step-0400")
    add_checkpoint(run_dir, "checkpoint-400")
    report = _prune(run_dir, keep_last=1)
    assert _deleted(report) == ["step-300"]
    assert _remaining(run_dir) == ["checkpoint-400", "step-0400"]


def test_incomplete_saves_young_and_old(tmp_path):
    run_dir = _run_dir(tmp_path, [100, 200])
    add_checkpoint(run_dir, "step-150", complete=False, age_seconds=3 * DAY)
    add_checkpoint(run_dir, "step-250", complete=False, age_seconds=3 * DAY)
    add_checkpoint(run_dir, "step-300", complete=False, age_seconds=60)  # a save in progress
    without_option = _prune(run_dir, keep_last=1, dry_run=True)
    assert _deleted(without_option) == ["step-100"]
    report = _prune(run_dir, keep_last=1, incomplete_older_than_seconds=DAY,
                    keep_globs=("step-250",))
    assert _deleted(report) == ["step-100", "step-150"]
    assert _remaining(run_dir) == ["step-200", "step-250", "step-300"]
    # Incomplete checkpoints do not count toward --keep-last: step-200 is the newest complete.
    assert report.decisions[2].reasons == ["newest complete", "one of the last 1 complete"]
    assert "may be a save or copy in progress" in report.decisions[-1].reasons[0]


def test_symlinked_checkpoint_pointing_outside_is_left_alone(tmp_path):
    run_dir = _run_dir(tmp_path, [200, 300])
    outside = add_checkpoint(tmp_path, "elsewhere-100")
    (run_dir / "step-100").symlink_to(outside, target_is_directory=True)
    # A symlink inside a checkpoint that is deleted: the link goes, its target stays.
    outside_file = tmp_path / "shared.bin"
    outside_file.write_bytes(b"keep me")
    (run_dir / "step-200" / "extra.bin").symlink_to(outside_file)
    before = tree_listing(outside)
    report = _prune(run_dir, keep_last=1)
    assert _deleted(report) == ["step-200"]
    assert (run_dir / "step-100").is_symlink() and tree_listing(outside) == before
    assert outside_file.read_bytes() == b"keep me"
    assert [(e.name, e.reason) for e in report.ignored] == [
        ("step-100", "a symlink: never followed, never deleted")]


def test_a_checkpoint_a_symlink_of_the_run_points_to_is_kept(tmp_path):
    """`latest -> step-200`: prune deleted step-200 (not the newest) and left the link
    dangling, the checkpoint a user or a script resumes from gone."""
    run_dir = _run_dir(tmp_path, [100, 200, 300, 400])
    (run_dir / "latest").symlink_to("step-200")
    (run_dir / "chain").symlink_to("latest")
    (run_dir / "best").symlink_to(run_dir / "step-100", target_is_directory=True)
    (run_dir / "into").symlink_to("step-300/.metadata")
    (run_dir / "outside").symlink_to(tmp_path)
    report = _prune(run_dir, keep_last=1)
    assert _deleted(report) == []
    reasons = {decision.checkpoint.name: decision.reasons for decision in report.decisions}
    assert reasons["step-100"] == ["symlink best points to it"]
    assert reasons["step-200"] == ["symlink chain, latest points to it"]
    assert reasons["step-300"] == ["symlink into points to it"]
    (run_dir / "latest").unlink()
    (run_dir / "into").unlink()
    report = _prune(run_dir, keep_last=1)
    assert _deleted(report) == ["step-200", "step-300"]
    assert _remaining(run_dir) == ["best", "chain", "outside", "step-100", "step-400"]


def test_a_file_where_a_directory_is_expected_is_left_alone(tmp_path):
    run_dir = _run_dir(tmp_path, [200, 300])
    (run_dir / "step-100").write_text("not a checkpoint")
    report = _prune(run_dir, keep_last=1, incomplete_older_than_seconds=1)
    assert _deleted(report) == ["step-200"]
    assert (run_dir / "step-100").read_text() == "not a checkpoint"
    assert [(e.name, e.reason) for e in report.ignored] == [("step-100", "not a directory")]


@pytest.mark.parametrize("swap", ["symlink", "another directory"])
def test_deleting_refuses_an_entry_swapped_after_the_scan(tmp_path, swap):
    """Between prune's scan and its deletion, step-1 is renamed away and replaced by a symlink
    to a checkpoint outside the run directory, or by another directory: nothing of either is
    deleted."""
    run_dir = tmp_path / "run"
    add_checkpoint(run_dir, "step-1")
    outside = add_checkpoint(tmp_path, "outside")
    (entry,) = scan_run_directory(run_dir).checkpoints
    (run_dir / "step-1").rename(tmp_path / "moved")
    if swap == "symlink":
        (run_dir / "step-1").symlink_to(outside, target_is_directory=True)
    else:
        add_checkpoint(run_dir, "step-1")
    before = tree_listing(tmp_path)
    run_descriptor = os.open(run_dir, os.O_RDONLY | os.O_DIRECTORY)
    try:
        with pytest.raises(UnsafePathError, match="no longer|scanned"):
            delete_checkpoint_directory(run_descriptor, entry)
    finally:
        os.close(run_descriptor)
    assert tree_listing(tmp_path) == before


def test_permission_denied_on_one_directory_the_rest_is_still_done(tmp_path, monkeypatch):
    run_dir = _run_dir(tmp_path, [100, 200, 300, 400])
    fail_deletion_part_way(monkeypatch, "step-200")
    report = _prune(run_dir, keep_last=1)
    assert [d.status for d in report.decisions] == ["deleted", "failed", "deleted", "kept"]
    assert report.decisions[1].error == f"{run_dir}/step-200/__1_0.distcp: Permission denied"
    assert _remaining(run_dir) == ["step-200", "step-400"]
    # `.metadata` went first: what is left of step-200 is an incomplete checkpoint.
    assert not (run_dir / "step-200" / ".metadata").exists()
    assert report.freed_bytes == report.decisions[0].checkpoint.size_bytes * 2


def test_a_second_prune_fails_while_the_first_holds_the_lock(tmp_path, another_prune):
    run_dir = _run_dir(tmp_path, [100, 200])
    with another_prune(run_dir):
        before = tree_listing(run_dir)
        with pytest.raises(LockHeldError, match="another dcpctl prune is pruning"):
            _prune(run_dir, keep_last=1)
        assert tree_listing(run_dir) == before
        assert _deleted(_prune(run_dir, keep_last=1, dry_run=True)) == ["step-100"]
    assert _deleted(_prune(run_dir, keep_last=1)) == ["step-100"]
    assert _remaining(run_dir) == ["step-200"]


def test_dry_run_changes_nothing_and_plans_what_a_real_run_does(tmp_path):
    run_dir = _run_dir(tmp_path, [100, 200, 300, 400])
    add_checkpoint(run_dir, "step-250", complete=False, age_seconds=3 * DAY)
    rules = dict(keep_last=1, keep_every_steps=200, incomplete_older_than_seconds=DAY)
    before = tree_listing(run_dir)
    dry = _prune(run_dir, dry_run=True, **rules)
    assert tree_listing(run_dir) == before  # not even a lock file
    assert [d.status for d in dry.decisions if d.delete] == ["would delete"] * 3
    assert dry.freed_bytes == 0 and dry.delete_bytes > 0
    real = _prune(run_dir, **rules)
    assert [(d.checkpoint.name, d.delete, d.reasons) for d in dry.decisions] == [
        (d.checkpoint.name, d.delete, d.reasons) for d in real.decisions]
    assert real.freed_bytes == dry.delete_bytes


def test_keep_last_must_be_at_least_one():
    with pytest.raises(InvalidOptionError, match="at least 1"):
        RetentionRules(keep_last=0)


def test_a_damaged_newest_checkpoint_never_costs_the_last_sound_one_its_place(tmp_path):
    """A checkpoint being copied in (`.metadata` first, as cp -r and rsync copy it) holds
    `.metadata` but not all its data files: `verify --quick` calls it damaged. It is no
    checkpoint to resume from, so the newest sound one stays, and the damaged one is kept as
    an incomplete one would be."""
    run_dir = _run_dir(tmp_path, [100, 200])
    copying = add_checkpoint(run_dir, "step-300")
    (copying / "__3_0.distcp").unlink()
    back_date(copying, 60)
    report = _prune(run_dir, keep_last=1)
    assert _deleted(report) == ["step-100"]
    assert _remaining(run_dir) == ["step-200", "step-300"]
    reasons = {decision.checkpoint.name: decision.reasons for decision in report.decisions}
    assert reasons["step-200"] == ["newest complete", "one of the last 1 complete"]
    assert reasons["step-300"][0].startswith(f"damaged ({copying / '__3_0.distcp'}: missing-file")
    assert report.decisions[-1].to_json()["damage"].startswith(
        f"{copying / '__3_0.distcp'}: missing-file: missing data file")
    # Like an incomplete one, it goes with --incomplete-older-than once it stops changing.
    report = _prune(run_dir, keep_last=1, incomplete_older_than_seconds=30)
    assert _deleted(report) == ["step-300"]
    assert report.decisions[-1].reasons == [
        "damaged, unchanged for longer than --incomplete-older-than"]


def _with_a_fraction_in_planner_data(checkpoint) -> None:
    """A custom planner's data in `.metadata`: a class dcpctl's allowlist refuses, which
    torch's own loader unpickles."""
    import fractions
    import pickle

    metadata = pickle.loads((checkpoint / ".metadata").read_bytes())
    metadata.planner_data = {**(metadata.planner_data or {}), "ratio": fractions.Fraction(1, 3)}
    (checkpoint / ".metadata").write_bytes(pickle.dumps(metadata))


@pytest.mark.parametrize("unreadable", ["a class dcpctl does not know", "failing to be read"])
def test_a_checkpoint_dcpctl_cannot_read_is_never_deleted(tmp_path, monkeypatch, unreadable):
    """Taken for damaged, it went with --incomplete-older-than, newest and all: with a custom
    planner's class in every `.metadata`, a prune deleted a whole run that torch loads."""
    run_dir = _run_dir(tmp_path, [100, 200, 300])
    for step in (200, 300):
        checkpoint = run_dir / f"step-{step}"
        if unreadable == "failing to be read":
            _failing_to_read(monkeypatch, checkpoint / ".metadata")
        else:
            _with_a_fraction_in_planner_data(checkpoint)
        back_date(checkpoint, 30 * DAY)
    report = _prune(run_dir, keep_last=1, incomplete_older_than_seconds=HOUR)
    assert _deleted(report) == [] and _remaining(run_dir) == ["step-100", "step-200", "step-300"]
    decisions = {decision.checkpoint.name: decision for decision in report.decisions}
    assert decisions["step-100"].reasons[0] == "newest complete"
    assert decisions["step-300"].state == "unreadable"
    assert decisions["step-300"].reasons[0].startswith("cannot be read (")
    assert decisions["step-300"].reasons[0].endswith("): never deleted")


def _failing_to_read(monkeypatch, path) -> None:
    """Make path fail to be opened with EIO, as a failing disk does."""
    from dcpctl.format.metadata import reading

    opened = reading.open_for_reading

    def failing(target, *args, **kwargs):
        if os.fspath(target) == os.fspath(path):
            raise OSError(errno.EIO, os.strerror(errno.EIO), os.fspath(path))
        return opened(target, *args, **kwargs)

    monkeypatch.setattr(reading, "open_for_reading", failing)


def test_a_metadata_that_is_no_pickle_is_damage_to_ls_prune_and_verify(tmp_path):
    """ls and prune called a checkpoint whose `.metadata` is no pickle unreadable, where verify
    called it damaged; a class outside DCP's is what neither can judge."""
    from dcpctl.ops.runs.listing import list_run_directory
    from dcpctl.ops.verify.verifier import verify_checkpoint

    run_dir = _run_dir(tmp_path, [100, 200])
    (run_dir / "step-200" / ".metadata").write_bytes(b"not a pickle")
    assert verify_checkpoint(run_dir / "step-200").status == "damaged"
    listed = {row.entry.name: row for row in list_run_directory(run_dir).checkpoints}
    assert listed["step-200"].state == "damaged"
    report = _prune(run_dir, keep_last=1)
    assert _deleted(report) == [] and _remaining(run_dir) == ["step-100", "step-200"]
    decisions = {decision.checkpoint.name: decision for decision in report.decisions}
    assert decisions["step-100"].reasons[0] == "newest complete"
    assert decisions["step-200"].state == "damaged"
    assert decisions["step-200"].reasons == [
        f"damaged ({run_dir / 'step-200' / '.metadata'}: not a readable DCP metadata pickle "
        "(UnpicklingError: invalid load key, 'n'.)): deleted only where data files are missing "
        "or short"]


def test_a_checkpoint_damaged_but_not_lacking_bytes_is_never_deleted(tmp_path):
    """Only data files missing or short (a save or copy cut short) make a checkpoint with
    `.metadata` one to delete: a chunk the metadata lost is damage, not a sign of garbage."""
    import pickle

    run_dir = _run_dir(tmp_path, [100, 200])
    checkpoint = run_dir / "step-200"
    metadata = pickle.loads((checkpoint / ".metadata").read_bytes())
    tensor = next(entry for entry in metadata.state_dict_metadata.values()
                  if hasattr(entry, "chunks") and len(entry.chunks) > 1)
    tensor.chunks.pop()
    (checkpoint / ".metadata").write_bytes(pickle.dumps(metadata))
    back_date(checkpoint, 30 * DAY)
    report = _prune(run_dir, keep_last=1, incomplete_older_than_seconds=HOUR)
    assert _deleted(report) == []
    decision = report.decisions[-1]
    assert decision.state == "damaged" and not decision.check.lacks_bytes
    assert decision.reasons == [f"damaged ({decision.damage}): deleted only where data files "
                                "are missing or short"]


@contextlib.contextmanager
def _mounted(arguments: list, target) -> Iterator[None]:
    """`mount ARGUMENTS TARGET` for the block (skipped where this process may not mount)."""
    done = subprocess.run(["mount", *map(str, arguments), str(target)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount here: {done.stderr.decode(errors='replace').strip()}")
    try:
        yield
    finally:
        subprocess.run(["umount", str(target)], check=True)


@pytest.mark.parametrize("mount", ["bind", "tmpfs"])
def test_a_checkpoint_with_a_mount_point_inside_is_never_deleted(tmp_path, mount):
    """prune went down into a file system mounted inside a checkpoint and deleted what it
    held (a bind mount of the same file system shares its device number)."""
    run_dir = _run_dir(tmp_path, [1, 2])
    (run_dir / "step-1" / "mnt").mkdir()
    outside = tmp_path / "outside"
    outside.mkdir()
    arguments = ["--bind", outside] if mount == "bind" else ["-t", "tmpfs", "tmpfs"]
    with _mounted(arguments, run_dir / "step-1" / "mnt"):
        (run_dir / "step-1" / "mnt" / "precious").write_text("keep")
        report = _prune(run_dir, keep_last=1)
        assert _deleted(report) == [] and _remaining(run_dir) == ["step-1", "step-2"]
        assert [(entry.name, entry.reason) for entry in report.ignored] == [
            ("step-1", "mnt in it is a mount point (another file system): never deleted")]
        assert (run_dir / "step-1" / "mnt" / "precious").read_text() == "keep"


@pytest.mark.parametrize("mount", ["bind", "tmpfs"])
def test_a_checkpoint_that_is_a_mount_point_itself_is_never_deleted(tmp_path, mount):
    """A checkpoint directory that is a bind mount of a checkpoint elsewhere (or a file system
    of its own) was taken for a plain one: prune emptied it, deleting what the mount shows
    from outside the run directory, then failed to remove the mount point (EBUSY)."""
    run_dir = _run_dir(tmp_path, [2])
    (run_dir / "step-1").mkdir()
    elsewhere = tmp_path / "elsewhere"
    add_checkpoint(elsewhere, "precious")
    arguments = (["--bind", elsewhere / "precious"] if mount == "bind"
                 else ["-t", "tmpfs", "tmpfs"])
    with _mounted(arguments, run_dir / "step-1"):
        if mount == "tmpfs":
            shutil.copytree(fixture_path("mesh2d_4ranks"), run_dir / "step-1",
                            dirs_exist_ok=True)
        before = tree_listing(run_dir / "step-1")
        report = _prune(run_dir, keep_last=1)
        assert _deleted(report) == [] and tree_listing(run_dir / "step-1") == before
        assert [(entry.name, entry.reason) for entry in report.ignored] == [
            ("step-1", "it is a mount point (another file system): never deleted")]


def test_a_mount_made_after_the_scan_stops_the_deletion(tmp_path, monkeypatch):
    """A checkpoint mounted over between prune's scan and its deletion is not deleted."""
    run_dir = _run_dir(tmp_path, [1, 2])
    elsewhere = tmp_path / "elsewhere"
    add_checkpoint(elsewhere, "precious")
    before = tree_listing(elsewhere)
    real_scan = prune.scan_run_directory

    def scan_then_mount(path):
        scan = real_scan(path)
        mount = subprocess.run(["mount", "--bind", str(elsewhere / "precious"),
                                str(run_dir / "step-1")], capture_output=True)
        if mount.returncode != 0:
            pytest.skip(f"cannot mount here: {mount.stderr.decode(errors='replace').strip()}")
        # the same directory as scanned, as far as its identity and contents tell
        entry = next(entry for entry in scan.checkpoints if entry.name == "step-1")
        status = os.stat(run_dir / "step-1")
        entry.identity = (status.st_dev, status.st_ino)
        return scan

    monkeypatch.setattr(prune, "scan_run_directory", scan_then_mount)
    monkeypatch.setattr(prune, "changed_since_scanned", lambda entry: False)
    try:
        report = _prune(run_dir, keep_last=1)
    finally:
        subprocess.run(["umount", str(run_dir / "step-1")])
    assert tree_listing(elsewhere) == before
    assert [(decision.checkpoint.name, decision.status) for decision in report.decisions] == [
        ("step-1", "failed"), ("step-2", "kept")]
    assert "it is a mount point (another file system): never deleted" in (
        report.decisions[0].error)


def test_emptying_a_directory_never_enters_another_file_system(tmp_path):
    """What a mount made after prune looked (or any removal of dcpctl's) stops at it."""
    from dcpctl.storage.local import remove_directory

    (tmp_path / "doomed" / "mnt").mkdir(parents=True)
    with _mounted(["-t", "tmpfs", "tmpfs"], tmp_path / "doomed" / "mnt"):
        (tmp_path / "doomed" / "mnt" / "precious").write_text("keep")
        with pytest.raises(OSError) as raised:
            remove_directory(tmp_path / "doomed")
        assert raised.value.errno == errno.EXDEV
        assert (tmp_path / "doomed" / "mnt" / "precious").read_text() == "keep"


def test_a_nested_run_named_like_a_step_is_never_deleted(tmp_path):
    """checkpoint_1/ holds checkpoints of its own (step-100/, step-200/) and the user's files:
    it is named like step 1, but it is not an accelerate checkpoint, whose parts are
    pytorch_model_fsdp_<i>/ and optimizer_<i>/, so it is no checkpoint of this run."""
    run_dir = _run_dir(tmp_path, [300])
    nested = run_dir / "checkpoint_1"
    for step in (100, 200):
        add_checkpoint(nested, f"step-{step}")
    (nested / "config.yaml").write_text("lr: 3e-4")
    before = tree_listing(nested)
    report = _prune(run_dir, keep_last=1)
    assert _deleted(report) == [] and tree_listing(nested) == before
    assert [entry.name for entry in report.ignored] == ["checkpoint_1"]
    assert "not the parts of an accelerate checkpoint" in report.ignored[0].reason


@pytest.mark.parametrize("name", ["llama3", "gpt2", "ckpt_v2", "seed_1",
                                  "\u017ftep-3", "\u0130ter_5"])  # long s, dotted capital I
def test_a_users_checkpoint_whose_name_ends_in_a_number_is_never_deleted(tmp_path, name):
    """llama3/, a DCP checkpoint of the base weights beside the run's step-100/ and step-200/,
    was taken for step 3 and deleted by --keep-last 1, as were gpt2/, ckpt_v2/ and seed_1/."""
    run_dir = _run_dir(tmp_path, [100, 200])
    add_checkpoint(run_dir, name, age_seconds=30 * DAY)
    report = _prune(run_dir, keep_last=1)
    assert _deleted(report) == ["step-100"]
    assert _remaining(run_dir) == sorted([name, "step-200"])


def test_checkpoints_numbered_by_epoch_and_by_step_are_refused_together(tmp_path):
    """dist_epoch_2/ (torchtune's newest) was deleted as older than step-100/: epochs and
    steps have no common order."""
    run_dir = _run_dir(tmp_path, [100])
    for epoch in (1, 2):
        add_checkpoint(run_dir, f"dist_epoch_{epoch}")
    before = tree_listing(run_dir)
    for dry_run in (True, False):
        with pytest.raises(UnsupportedLayoutError) as raised:
            _prune(run_dir, dry_run=dry_run, keep_last=1)
        assert str(raised.value) == (
            f"{run_dir}: numbers some complete checkpoints by epoch (dist_epoch_1, "
            "dist_epoch_2) and others by step (step-100): prune cannot tell which are the "
            "newest, so it deletes nothing; keep each numbering in a run directory of its own")
    assert tree_listing(run_dir) == before
    assert [entry.name for entry in scan_run_directory(run_dir).checkpoints] == [
        "dist_epoch_1", "dist_epoch_2", "step-100"]  # ls lists them all


def test_an_incomplete_checkpoint_of_other_numbering_does_not_stop_the_prune(tmp_path):
    """An empty `0/` beside dist_epoch_1/ and dist_epoch_2/ made prune refuse the run:
    incomplete checkpoints go by age alone, not by their order."""
    run_dir = tmp_path / "run"
    for epoch in (1, 2):
        add_checkpoint(run_dir, f"dist_epoch_{epoch}", age_seconds=30 * DAY)
    (run_dir / "0").mkdir()
    report = _prune(run_dir, keep_last=1)
    assert _deleted(report) == ["dist_epoch_1"]
    assert _remaining(run_dir) == ["0", "dist_epoch_2"]


def test_a_checkpoint_that_holds_checkpoints_below_its_own_metadata_is_never_deleted(tmp_path):
    """step-1 is a checkpoint and holds a run of the user's (seed_1/step-100/) and another
    checkpoint beside its data: prune deleted them with it, as only a step directory without
    `.metadata` of its own was looked into."""
    run_dir = _run_dir(tmp_path, [1, 2])
    for nested in ("seed_1/step-100", "nested_checkpoint"):
        add_checkpoint(run_dir / "step-1", nested)
    before = tree_listing(run_dir / "step-1")
    report = _prune(run_dir, keep_last=1)
    assert _deleted(report) == [] and tree_listing(run_dir / "step-1") == before
    assert [entry.name for entry in report.ignored] == ["step-1"]
    assert report.ignored[0].reason == ("holds DCP checkpoints (nested_checkpoint, "
                                        "seed_1/step-100) below its own .metadata: a run of "
                                        "its own, or the user's")


@pytest.mark.parametrize("metadata_holds", [[], ["x"]], ids=["empty", "a file"])
def test_a_step_whose_metadata_is_a_directory_is_no_checkpoint(tmp_path, metadata_holds):
    """Its data files made it an incomplete checkpoint, which --dry-run said it would delete,
    and every real prune failed on it (`.metadata: Is a directory`), exit 1."""
    run_dir = _run_dir(tmp_path, [1, 2])
    (run_dir / "step-1" / ".metadata").unlink()
    (run_dir / "step-1" / ".metadata").mkdir()
    for name in metadata_holds:
        (run_dir / "step-1" / ".metadata" / name).write_text("x")
    for dry_run in (True, False):
        report = _prune(run_dir, dry_run=dry_run, keep_last=1,
                        incomplete_older_than_seconds=1)
        assert _deleted(report) == [], dry_run
        assert [(entry.name, entry.reason) for entry in report.ignored] == [
            ("step-1", "its .metadata is a directory: not a DCP checkpoint")]
    assert (run_dir / "step-1" / ".metadata").is_dir()


@pytest.mark.parametrize("times_known", [True, False])
def test_a_store_that_gives_no_write_times_keeps_what_an_age_would_decide(
        monkeypatch, times_known):
    """A store whose listing gives no write time (or one in a form not read: webdav's
    `modified`, ftp's `modify`) dated every object 1970: prune took a save in progress for an
    incomplete checkpoint days old, and deleted it."""
    import fsspec
    import torch
    import torch.distributed.checkpoint as dcp

    from dcpctl.storage import objects

    run = f"memory://run-{times_known}"
    for step in (100, 200):
        dcp.save({"w": torch.ones(4)}, checkpoint_id=f"{run}/step-{step}", no_dist=True)
    fsspec.filesystem("memory").pipe_file(f"/run-{times_known}/step-300/__0_0.distcp", b"a")
    if not times_known:
        monkeypatch.setattr(objects, "_MODIFIED_FIELDS", ())
    listed = {entry.name: entry for entry in scan_run_directory(run).checkpoints}
    assert (listed["step-300"].age_seconds is None) is not times_known
    report = _prune(run, keep_last=1, older_than_seconds=DAY,
                    incomplete_older_than_seconds=0)
    assert _deleted(report) == (["step-300"] if times_known else [])
    kept = {d.checkpoint.name: d.reasons for d in report.decisions if not d.delete}
    if not times_known:
        assert "age unknown (the store does not say when its objects were written)" in \
            kept["step-100"]


def test_object_write_times_are_read_as_each_store_writes_them():
    import datetime

    from dcpctl.storage.objects import _modified_of

    moment = datetime.datetime(2026, 1, 2, 3, 4, 5, tzinfo=datetime.timezone.utc)
    for details in ({"LastModified": moment}, {"modified": moment},  # s3fs, webdav4
                    {"modify": "20260102030405"}, {"mtime": moment.timestamp()},  # ftp, sftp
                    {"last_modified": moment.isoformat()}):
        assert _modified_of(details) == moment.timestamp(), details
    assert _modified_of({"mtime": 2e13}) == 0  # not seconds: a time past tomorrow
    assert _modified_of({}) == 0


def test_a_checkpoint_written_since_the_scan_is_not_deleted(tmp_path):
    """A trainer saved again into a stale incomplete step while prune deleted the one before
    it: prune then deleted the new, complete checkpoint, as the incomplete one it had seen."""
    import shutil
    import signal

    from conftest import dcpctl_stopped_at, fixture_path

    run_dir = _run_dir(tmp_path, [1, 2, 3], age_seconds=2 * DAY)
    add_checkpoint(run_dir, "step-4", complete=False, age_seconds=2 * DAY)
    prune = dcpctl_stopped_at("after-metadata-removed", "prune", run_dir, "--keep-last", "2",
                              "--incomplete-older-than", "1h")
    try:
        shutil.copy(fixture_path("mesh2d_4ranks") / ".metadata", run_dir / "step-4")  # saved
        prune.send_signal(signal.SIGCONT)
        output, _ = prune.communicate(timeout=60)
    finally:
        if prune.poll() is None:
            prune.kill()
    assert prune.returncode == 1
    assert "step-4: was written since prune looked at it" in output, output
    assert _remaining(run_dir) == ["step-2", "step-3", "step-4"]
    assert (run_dir / "step-4" / ".metadata").exists()


def test_a_checkpoint_the_trainer_deletes_meanwhile_is_gone_not_failed(tmp_path, monkeypatch):
    """A trainer rotating out its own old checkpoints (torchtitan's keep_latest_k) deleted one
    while prune did: prune said it failed, and exited 1, every few runs from cron."""
    import shutil

    from dcpctl.ops.runs import prune

    run_dir = _run_dir(tmp_path, [1, 2, 3])
    looked = prune.changed_since_scanned

    def trainer_deletes_it_first(entry):
        shutil.rmtree(entry.path)
        return looked(entry)

    monkeypatch.setattr(prune, "changed_since_scanned", trainer_deletes_it_first)
    report = _prune(run_dir, keep_last=1)
    assert [(decision.checkpoint.name, decision.status) for decision in report.decisions] == [
        ("step-1", prune.GONE), ("step-2", prune.GONE), ("step-3", prune.KEPT)]
    assert report.with_status(prune.FAILED) == [] and _remaining(run_dir) == ["step-3"]
    assert report.decisions[0].reasons[-1] == "deleted meanwhile by another process"

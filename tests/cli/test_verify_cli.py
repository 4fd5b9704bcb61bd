"""`dcpctl checksum` and `dcpctl verify` as a user runs them: output, JSON, exit codes."""

from __future__ import annotations

import json
import shutil
import subprocess

import pytest
from conftest import FIXTURE_NAMES, fixture_path


@pytest.mark.skipif(shutil.which("sha256sum") is None, reason="needs coreutils sha256sum")
@pytest.mark.parametrize("name", FIXTURE_NAMES)
def test_sha256sum_checks_what_checksum_writes(run_cli, name, copy_fixture):
    checkpoint = copy_fixture(name)
    result = run_cli("checksum", checkpoint, "--threads", 2)
    assert result.exit_code == 0, result.output
    assert f"wrote {checkpoint / 'SHA256SUMS'}" in result.output
    check = subprocess.run(["sha256sum", "-c", "SHA256SUMS"], cwd=checkpoint,
                           capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr
    listed = sorted(line.split("  ")[1] for line in (checkpoint / "SHA256SUMS").read_text()
                    .splitlines())
    assert listed == sorted(path.name for path in checkpoint.iterdir()
                            if path.name != "SHA256SUMS")


def test_checksum_json_and_refusal(run_cli, copy_fixture):
    checkpoint = copy_fixture("mesh2d_4ranks")
    report = json.loads(run_cli("checksum", checkpoint, "--json").output)
    assert set(report) == {"path", "sums_path", "hashed_bytes", "files"}
    assert sorted(report["files"]) == [".metadata", "__0_0.distcp", "__1_0.distcp",
                                       "__2_0.distcp", "__3_0.distcp"]
    (checkpoint / "__2_0.distcp").write_bytes(b"")
    result = run_cli("checksum", checkpoint)
    assert result.exit_code == 1 and result.output.startswith("Error: ")
    assert "__2_0.distcp" in result.output and "truncated" in result.output


@pytest.mark.parametrize("stray", ["notes.txt", "__9_0.distcp"])
def test_checksum_refuses_a_file_the_checkpoint_does_not_name(run_cli, copy_fixture, stray):
    """verify calls such a checkpoint damaged (unknown-file): checksum certifies none it would
    fail."""
    checkpoint = copy_fixture("mesh2d_4ranks")
    (checkpoint / stray).write_bytes(b"x")
    result = run_cli("checksum", checkpoint)
    assert result.exit_code == 1, result.output
    assert result.output.startswith(f"Error: {checkpoint}/{stray}: unknown-file: file is not "
                                    "named by the metadata")
    assert not (checkpoint / "SHA256SUMS").exists()
    (checkpoint / stray).unlink()
    assert run_cli("checksum", checkpoint).exit_code == 0


@pytest.mark.parametrize("name", FIXTURE_NAMES)
def test_clean_checkpoint_exits_0(run_cli, name):
    for extra in ([], ["--quick"]):
        result = run_cli("verify", fixture_path(name), *extra)
        assert result.exit_code == 0, result.output
        assert "status      ok" in result.output


def test_damage_exits_1_and_names_file_and_fqns(run_cli, copy_fixture):
    checkpoint = copy_fixture("objects_2ranks")
    (checkpoint / "__1_2.distcp").write_bytes(b"PK")
    result = run_cli("verify", checkpoint)
    assert result.exit_code == 1
    assert "status      damaged: 1 problem" in result.output
    assert "truncated  __1_2.distcp  bytes 2..1641  weights.dense" in result.output


def test_json_shape(run_cli, copy_fixture):
    checkpoint = copy_fixture("mesh2d_4ranks")
    run_cli("checksum", checkpoint)
    (checkpoint / "stray.bin").write_bytes(b"x")
    result = run_cli("verify", checkpoint, "--json", "--threads", 1)
    assert result.exit_code == 1
    report = json.loads(result.output)
    assert set(report) == {"path", "status", "deep", "checksummed_files", "items_checked",
                           "bytes_read", "problems", "leftover_temporaries", "divergent_copies"}
    assert (report["status"], report["deep"], report["checksummed_files"]) == ("damaged", True, 5)
    assert report["items_checked"] == 8
    assert report["problems"] == [{"rule": "unknown-file", "file": "stray.bin", "start": None,
                                   "end": None, "fqns": [],
                                   "message": "file is not named by the metadata"}]


def test_incomplete_checkpoint_exits_1(run_cli, copy_fixture):
    checkpoint = copy_fixture("mesh2d_4ranks")
    (checkpoint / ".metadata").unlink()
    result = run_cli("verify", checkpoint, "--json")
    assert result.exit_code == 1
    assert json.loads(result.output)["status"] == "incomplete"
    assert "status      incomplete" in run_cli("verify", checkpoint).output


def test_the_run_directory_above_checkpoints_is_no_incomplete_checkpoint(run_cli, copy_fixture,
                                                                         tmp_path):
    """`verify RUN_DIR` said `status incomplete` (a save that died) of the directory above the
    checkpoints, and of an empty one; it is not a checkpoint, and says which it holds."""
    copy_fixture("mesh2d_4ranks").rename(tmp_path / "step-100")
    (tmp_path / "empty").mkdir()
    message = (f"{tmp_path}: not a DCP checkpoint: no .metadata; it holds checkpoints "
               "(step-100): give one of them, or list them with `dcpctl ls`")
    for flags in ([], ["--json"]):
        result = run_cli("verify", tmp_path, *flags)
        assert result.exit_code == 1
        assert result.stderr == f"Error: {message}\n"
        assert result.stdout == ('{"error": ' + json.dumps(message) + ', "exit_code": 1}\n'
                                 if flags else "")
    result = run_cli("verify", tmp_path / "empty")
    assert (result.exit_code, result.output) == (
        1, f"Error: {tmp_path / 'empty'}: not a DCP checkpoint: no .metadata\n")


def test_bad_paths_are_one_line_errors(run_cli, tmp_path):
    (tmp_path / "file").write_text("x")
    for command in ("verify", "checksum"):
        for path, fragment in [(tmp_path / "absent", "no such file"),
                               (tmp_path / "file", "not a directory")]:
            result = run_cli(command, path)
            lines = result.output.strip().splitlines()
            assert result.exit_code == 1 and len(lines) == 1, result.output
            assert lines[0].startswith(f"Error: {path}") and fragment in lines[0]


def test_usage_errors_exit_2(run_cli):
    assert run_cli("verify").exit_code == 2
    assert run_cli("verify", fixture_path("mesh2d_4ranks"), "--threads", 0).exit_code == 2
    assert run_cli("checksum", fixture_path("mesh2d_4ranks"), "--bogus").exit_code == 2


def test_a_data_file_left_by_an_earlier_save_is_named_as_one(run_cli, tmp_path):
    """torch's writer, saving again into one directory with fewer writer threads, overwrites
    `.metadata` and the files it names and leaves the others: the checkpoint loads, and verify
    says where the files it does not know most likely come from; a file of any other name is
    only said to be unknown."""
    import torch
    import torch.distributed.checkpoint as dcp

    checkpoint = tmp_path / "latest"
    state = {f"w{index}": torch.arange(8.0) + index for index in range(4)}
    for threads in (4, 1):
        dcp.save(state, storage_writer=dcp.FileSystemWriter(checkpoint, thread_count=threads))
    (checkpoint / "notes.txt").write_text("mine")
    loaded = {name: torch.zeros(8) for name in state}
    dcp.load(loaded, checkpoint_id=checkpoint)
    assert all(torch.equal(loaded[name], state[name]) for name in state)
    report = json.loads(run_cli("verify", checkpoint, "--json").output)
    messages = {problem["file"]: problem["message"] for problem in report["problems"]}
    assert sorted(messages) == ["__0_1.distcp", "__0_2.distcp", "__0_3.distcp", "notes.txt"]
    assert messages["notes.txt"] == "file is not named by the metadata"
    assert all(messages[name].endswith("most likely left by an earlier save into this "
                                       "directory with more ranks or writer threads; the "
                                       "checkpoint loads without it")
               for name in messages if name != "notes.txt")


def test_a_store_that_fails_while_verify_reads_is_an_error_not_damage(run_cli, monkeypatch):
    """A store that stopped answering made each item's read fail after the client's retries,
    and verify called the item damaged (`decode: item does not decode: ... kept failing`) and
    went on to the next, paying the retries again for each: a failure of the store is said as
    one, once, and the checkpoint is not called damaged."""
    import fsspec

    from dcpctl.storage import objects

    fsspec.filesystem("memory").put(str(fixture_path("fsdp2_adamw_3ranks")), "/flaky-store",
                                    recursive=True)
    assert run_cli("verify", "memory://flaky-store").exit_code == 0
    reads = []
    read_range = objects.ObjectStore.read_range

    def failing_read(self, key, start, end):  # the store goes once .metadata is read
        if not key.endswith(".distcp"):
            return read_range(self, key, start, end)
        reads.append(key)
        raise objects.StorageError("the connection kept failing after retries",
                                   path=self.url(key))

    monkeypatch.setattr(objects.ObjectStore, "read_range", failing_read)
    result = run_cli("verify", "memory://flaky-store", "--threads", 1)
    assert result.exit_code == 1
    assert "the connection kept failing after retries" in result.output
    assert "damaged" not in result.output and "decode" not in result.output
    assert len(reads) <= 3

"""Checkpoints whose data files lie in subdirectories (S3 writers spread ranks over key prefixes
to avoid throttling: s3torchconnector names them `0000000000/__0_0.distcp`), written by torch's
own FileSystemWriter with such prefixes: every command reads them, local and in a bucket, and
what it writes keeps the layout and loads in stock torch."""

from __future__ import annotations

import dataclasses
import json
import subprocess

import pytest
import torch
from conftest import (fixture_path, load_with_dcpctl_reader, load_with_torch, run_dcpctl,
                      upload_directory)
from make_fixtures import tensor_sha256

SOURCE = "fsdp2_adamw_3ranks"
PREFIX = "0000000000"


def ok(*args) -> str:
    result = run_dcpctl(*args)
    assert result.returncode == 0, (args, result.stderr)
    return result.stdout


def digests(state: dict) -> dict[str, str]:
    return {fqn: tensor_sha256(value) if isinstance(value, torch.Tensor) else repr(value)
            for fqn, value in state.items()}


def save_with_prefixed_files(state: dict, directory) -> None:
    """torch's FileSystemWriter, naming its files as s3torchconnector's prefix strategies do."""
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint.filesystem import _StoragePrefix
    from torch.distributed.checkpoint.state_dict_saver import _save_state_dict

    class PrefixedWriter(FileSystemWriter):
        def prepare_global_plan(self, plans):
            return [dataclasses.replace(plan, storage_data=_StoragePrefix(f"{PREFIX}/__{i}_"))
                    for i, plan in enumerate(plans)]

    (directory / PREFIX).mkdir(parents=True)  # torch opens the files; it makes no directories
    _save_state_dict(state, storage_writer=PrefixedWriter(directory, thread_count=2),
                     no_dist=True)


@pytest.fixture
def prefixed(tmp_path):
    state = load_with_torch(fixture_path(SOURCE))
    checkpoint = tmp_path / "prefixed"
    save_with_prefixed_files(state, checkpoint)
    names = sorted(path.relative_to(checkpoint).as_posix()
                   for path in checkpoint.rglob("*.distcp"))
    assert names == [f"{PREFIX}/__0_0.distcp", f"{PREFIX}/__0_1.distcp"]
    return checkpoint, digests(state)


def test_inspect_verify_and_checksum_read_files_in_subdirectories(prefixed):
    checkpoint, _ = prefixed
    files = json.loads(ok("inspect", checkpoint, "--by-file", "--json"))["files"]
    assert sorted(entry["name"] for entry in files) == [f"{PREFIX}/__0_0.distcp",
                                                        f"{PREFIX}/__0_1.distcp"]
    assert json.loads(ok("verify", checkpoint, "--json"))["status"] == "ok"
    ok("checksum", checkpoint)
    check = subprocess.run(["sha256sum", "-c", "SHA256SUMS"], cwd=checkpoint,
                           capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr
    report = json.loads(ok("verify", checkpoint, "--json"))
    assert report["status"] == "ok" and report["checksummed_files"] == 3


def test_a_stray_file_in_a_subdirectory_is_reported(prefixed):
    checkpoint, _ = prefixed
    (checkpoint / PREFIX / "notes.txt").write_text("not the checkpoint's")
    result = run_dcpctl("verify", checkpoint, "--json")
    assert result.returncode == 1
    problems = json.loads(result.stdout)["problems"]
    assert [(p["rule"], p["file"]) for p in problems] == [("unknown-file",
                                                           f"{PREFIX}/notes.txt")]


def test_compress_in_place_keeps_the_layout_and_cleans_what_a_killed_run_left(prefixed):
    checkpoint, expected = prefixed
    stale = checkpoint / PREFIX / "__0_0.distcp.dcpctl-0123456789ab.tmp"
    stale.write_bytes(b"left by a killed run")
    report = json.loads(ok("compress", checkpoint, "--json"))
    assert report["removed_stale_files"] == [f"{PREFIX}/{stale.name}"]
    assert sorted(path.relative_to(checkpoint).as_posix() for path in checkpoint.rglob("*")
                  if path.is_file()) == [".metadata", f"{PREFIX}/__0_0.distcp",
                                         f"{PREFIX}/__0_1.distcp", "SHA256SUMS"]
    assert digests(load_with_torch(checkpoint)) == expected
    ok("decompress", checkpoint)
    assert digests(load_with_torch(checkpoint)) == expected


def test_rewrites_into_a_new_directory_keep_the_layout(prefixed, tmp_path):
    checkpoint, expected = prefixed
    ok("compress", checkpoint, "-o", tmp_path / "z", "--codec", "floatsplit")
    assert (tmp_path / "z" / PREFIX / "__0_1.distcp").is_file()
    assert digests(load_with_dcpctl_reader(str(tmp_path / "z"))) == expected
    ok("decompress", tmp_path / "z", "-o", tmp_path / "plain")
    assert digests(load_with_torch(tmp_path / "plain")) == expected
    ok("reshard", checkpoint, "--ranks", "2", "-o", tmp_path / "two")
    assert digests(load_with_torch(tmp_path / "two")) == expected
    ok("convert", checkpoint, "--to", "safetensors", "-o", tmp_path / "hf")
    assert (tmp_path / "hf").is_dir()


def test_a_prefixed_checkpoint_in_a_bucket(prefixed, s3_server):
    checkpoint, expected = prefixed
    bucket = s3_server.new_bucket()
    url = upload_directory(s3_server, checkpoint, bucket, "run/step-1")
    assert json.loads(ok("verify", url, "--json"))["status"] == "ok"
    assert digests(load_with_dcpctl_reader(url)) == expected
    ok("compress", url, "-o", f"s3://{bucket}/run/step-1-z")
    keys = sorted(entry["Key"] for entry in s3_server.client().list_objects_v2(
        Bucket=bucket, Prefix="run/step-1-z/")["Contents"])
    assert keys == [f"run/step-1-z/{name}" for name in
                    (".metadata", f"{PREFIX}/__0_0.distcp", f"{PREFIX}/__0_1.distcp",
                     "SHA256SUMS")]
    ok("compress", url)  # in place
    assert digests(load_with_dcpctl_reader(url)) == expected
    assert json.loads(ok("verify", url, "--json"))["status"] == "ok"

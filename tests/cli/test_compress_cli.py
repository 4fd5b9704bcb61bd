"""`dcpctl compress` / `decompress` as a user runs them, including being killed mid-run."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
from click.testing import CliRunner
from conftest import MANIFEST, fixture_path, load_with_torch
from make_fixtures import tensor_sha256

from dcpctl.cli.main import cli
from dcpctl.format.checkpoint.checksums import read_sha256sums, sha256_of_file

IN_PLACE_FAILPOINTS = ["after-first-data-file", "after-first-metadata-switch",
                       "after-first-final-name", "after-second-metadata-switch"]
NEW_DIRECTORY_FAILPOINTS = ["after-first-data-file", "before-rename-new-directory"]


def run_dcpctl(*args, failpoint=None, **kwargs):
    env = {**os.environ, "DCPCTL_FAILPOINT": failpoint or ""}
    return subprocess.run([sys.executable, "-m", "dcpctl", *map(str, args)], env=env,
                          capture_output=True, text=True, **kwargs)


def tensor_hashes(checkpoint) -> dict[str, str]:
    return {fqn: tensor_sha256(value) for fqn, value in load_with_torch(checkpoint).items()
            if hasattr(value, "shape")}


def assert_whole_and_checksummed(checkpoint, name):
    assert tensor_hashes(checkpoint) == {
        fqn: d["sha256"] for fqn, d in MANIFEST[name]["tensors"].items()}
    digests = read_sha256sums(checkpoint)
    if digests is not None:
        for file_name, digest in digests.items():
            assert sha256_of_file(checkpoint / file_name) == digest, file_name


def test_compress_and_decompress_report(copy_fixture, tmp_path):
    checkpoint = copy_fixture("fsdp2_adamw_3ranks")
    result = CliRunner().invoke(cli, ["compress", str(checkpoint), "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    assert report["in_place"] and report["codec"] == "zstd" and report["level"] == 3
    assert report["stored_bytes_after"] < report["stored_bytes_before"]
    result = CliRunner().invoke(cli, ["decompress", str(checkpoint), "-o", str(tmp_path / "p")])
    assert result.exit_code == 0, result.output
    assert "as none" in result.output and "ratio" in result.output
    assert_whole_and_checksummed(tmp_path / "p", "fsdp2_adamw_3ranks")


def test_dry_run_and_errors_are_one_line(tmp_path):
    result = CliRunner().invoke(cli, ["compress", str(fixture_path("mesh2d_4ranks")),
                                      "--dry-run"])
    assert result.exit_code == 0 and "would rewrite" in result.output
    for args in (["compress", str(tmp_path / "absent")],
                 ["compress", str(fixture_path("safetensors_fsdp2_2ranks")), "-o",
                  str(tmp_path / "o")]):
        result = CliRunner().invoke(cli, args)
        assert result.exit_code == 1
        assert result.output.startswith("Error: ") and len(result.output.splitlines()) == 1
    assert CliRunner().invoke(cli, ["compress", "x", "--level", "30"]).exit_code == 2


@pytest.mark.parametrize("failpoint", IN_PLACE_FAILPOINTS)
def test_killed_in_place_rewrite_leaves_a_loadable_checkpoint(copy_fixture, failpoint):
    name = "fsdp2_adamw_3ranks"
    checkpoint = copy_fixture(name)
    killed = run_dcpctl("compress", checkpoint, failpoint=failpoint)
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    assert_whole_and_checksummed(checkpoint, name)
    rerun = run_dcpctl("compress", checkpoint, "--level", "3")
    assert rerun.returncode == 0, rerun.stderr
    assert sorted(p.name for p in checkpoint.iterdir()) == [
        ".metadata", "SHA256SUMS", "__0_0.distcp", "__1_0.distcp", "__2_0.distcp"]
    assert_whole_and_checksummed(checkpoint, name)


@pytest.mark.parametrize("failpoint", NEW_DIRECTORY_FAILPOINTS)
def test_killed_run_into_a_new_directory_leaves_no_checkpoint_there(tmp_path, failpoint):
    out = tmp_path / "out"
    killed = run_dcpctl("compress", fixture_path("mesh2d_4ranks"), "-o", out,
                        failpoint=failpoint)
    assert killed.returncode == -signal.SIGKILL
    assert not out.exists()
    assert run_dcpctl("compress", fixture_path("mesh2d_4ranks"), "-o", out).returncode == 0
    assert_whole_and_checksummed(out, "mesh2d_4ranks")


def _save_larger_checkpoint(path):
    import torch
    import torch.distributed.checkpoint as dcp

    torch.manual_seed(3)
    state = {f"layer{i}.weight": torch.randn(512, 1024).to(torch.bfloat16) for i in range(48)}
    dcp.save(state, storage_writer=dcp.FileSystemWriter(path, thread_count=2), no_dist=True)
    return {fqn: tensor_sha256(value) for fqn, value in state.items()}


def test_killed_at_random_moments_the_checkpoint_always_loads(tmp_path):
    checkpoint = tmp_path / "ckpt"
    expected = _save_larger_checkpoint(checkpoint)
    for delay in (0.6, 0.9, 1.2, 1.5, 2.0):
        process = subprocess.Popen([sys.executable, "-m", "dcpctl", "compress", str(checkpoint),
                                    "--level", "3", "--threads", "1"],
                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(delay)
        process.send_signal(signal.SIGKILL)
        process.wait()
        assert tensor_hashes(checkpoint) == expected, f"killed after {delay} s"
    assert run_dcpctl("decompress", checkpoint).returncode == 0
    assert tensor_hashes(checkpoint) == expected
    assert not [p.name for p in checkpoint.iterdir() if ".dcpctl-" in p.name]

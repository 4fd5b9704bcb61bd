"""Commands on a bucket killed at every failpoint they pass (first, middle and last pass of
each), on moto's server, which honours conditional writes: what a reader finds there always
loads, old or new, and never looks whole when it is not; run again, the command finishes."""

from __future__ import annotations

import json
import signal

import pytest
import torch
from conftest import (MANIFEST, failpoint_moments, failpoint_passes, fixture_path,
                      load_with_dcpctl_reader, run_dcpctl, upload_directory)
from make_fixtures import tensor_sha256

from dcpctl.format.checkpoint.view import open_checkpoint
from dcpctl.storage import paths

pytestmark = pytest.mark.slow
SOURCE = "fsdp2_adamw_3ranks"


def expected_tensors() -> dict[str, str]:
    return {fqn: entry["sha256"] for fqn, entry in MANIFEST[SOURCE]["tensors"].items()}


def loaded_tensors(url: str) -> dict[str, str]:
    return {fqn: tensor_sha256(value) for fqn, value in load_with_dcpctl_reader(url).items()
            if isinstance(value, torch.Tensor)}


def keys_under(server, bucket: str, prefix: str) -> list[str]:
    return [entry["Key"][len(prefix) + 1:] for page in server.client().get_paginator(
        "list_objects_v2").paginate(Bucket=bucket, Prefix=prefix + "/")
        for entry in page.get("Contents", [])]


@pytest.fixture
def moto_env(moto_s3, monkeypatch):
    for name, value in moto_s3.environment().items():
        monkeypatch.setenv(name, value)
    return moto_s3


def test_compress_in_place_in_a_bucket_killed_anywhere_leaves_a_checkpoint_that_loads(
        moto_env, tmp_path, monkeypatch):
    monkeypatch.setattr(paths, "STALE_OBJECT_SECONDS", -60)  # this process's cleanups: all
    probe = moto_env.new_bucket()
    upload_directory(moto_env, fixture_path(SOURCE), probe, "ck")
    passes = failpoint_passes(["compress", f"s3://{probe}/ck"], tmp_path / "trace")
    assert "after-first-metadata-switch" in passes
    for moment in failpoint_moments(passes):
        bucket = moto_env.new_bucket()
        url = upload_directory(moto_env, fixture_path(SOURCE), bucket, "ck")
        killed = run_dcpctl("compress", url, failpoint=moment)
        assert killed.returncode == -signal.SIGKILL, (moment, killed.stderr)
        assert loaded_tensors(url) == expected_tensors(), moment
        rerun = run_dcpctl("compress", url)
        assert rerun.returncode == 0, (moment, rerun.stderr)
        assert loaded_tensors(url) == expected_tensors(), moment
        verified = run_dcpctl("verify", url, "--json")
        assert verified.returncode == 0, (moment, verified.stdout)
        # What the killed run left stays for a day (a running one's looks the same in a
        # bucket, with no locks to tell them apart), named as leftovers, not damage; then goes.
        leftovers = set(json.loads(verified.stdout)["leftover_temporaries"])
        names = keys_under(moto_env, bucket, "ck")
        named = {name for name in names if name not in (".metadata", "SHA256SUMS")}
        assert len(named - leftovers) == 3, (moment, names)
        checkpoint = open_checkpoint(url)
        assert set(paths.remove_stale_temporaries(checkpoint.path, set(checkpoint.files))) == \
            leftovers
        assert len(set(keys_under(moto_env, bucket, "ck")) - {".metadata", "SHA256SUMS"}) == 3


def test_compress_into_a_bucket_killed_anywhere_never_looks_whole(moto_env, tmp_path):
    source_bucket = moto_env.new_bucket()
    source = upload_directory(moto_env, fixture_path(SOURCE), source_bucket, "ck")
    passes = failpoint_passes(["compress", source, "-o", f"s3://{source_bucket}/probe"],
                              tmp_path / "trace")
    for index, moment in enumerate(failpoint_moments(passes)):
        output = f"s3://{source_bucket}/out-{index}"
        killed = run_dcpctl("compress", source, "-o", output, failpoint=moment)
        assert killed.returncode == -signal.SIGKILL, (moment, killed.stderr)
        left = keys_under(moto_env, source_bucket, f"out-{index}")
        if ".metadata" in left:
            assert loaded_tensors(output) == expected_tensors(), moment
        rerun = run_dcpctl("compress", source, "-o", output, "--overwrite")
        assert rerun.returncode == 0, (moment, rerun.stderr)
        assert loaded_tensors(output) == expected_tensors(), moment


def test_prune_of_a_bucket_killed_anywhere_leaves_whole_or_incomplete_checkpoints(
        moto_env, tmp_path):
    def new_run() -> tuple[str, str]:
        bucket = moto_env.new_bucket()
        for step in (100, 200, 300):
            upload_directory(moto_env, fixture_path(SOURCE), bucket, f"run/step-{step}")
        return bucket, f"s3://{bucket}/run"

    _, probe = new_run()
    args = ["--keep-last", "1"]
    passes = failpoint_passes(["prune", probe, *args], tmp_path / "trace")
    assert passes == {"after-metadata-removed": 2}
    for moment in failpoint_moments(passes):
        bucket, run = new_run()
        killed = run_dcpctl("prune", run, *args, failpoint=moment)
        assert killed.returncode == -signal.SIGKILL, (moment, killed.stderr)
        for step in (100, 200, 300):
            if ".metadata" in keys_under(moto_env, bucket, f"run/step-{step}"):
                assert loaded_tensors(f"{run}/step-{step}") == expected_tensors(), moment
        rerun = run_dcpctl("prune", run, *args)
        assert rerun.returncode == 0, (moment, rerun.stderr)
        left = keys_under(moto_env, bucket, "run")
        # the last loads; one a killed run began to delete is incomplete (kept until
        # --incomplete-older-than says) or gone
        assert {key.partition("/")[0] for key in left if key.endswith("/.metadata")} == \
            {"step-300"}, moment
        assert loaded_tensors(f"{run}/step-300") == expected_tensors(), moment

"""`dcpctl compress` / `decompress` as a user runs them (killed mid-run: test_killed_runs.py)."""

from __future__ import annotations

import json

from conftest import MANIFEST, fixture_path, load_with_torch
from make_fixtures import tensor_sha256

from dcpctl.format.checkpoint.checksums import read_sha256sums
from dcpctl.storage.file_digests import sha256_of_file


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


def test_compress_and_decompress_report(run_cli, copy_fixture, tmp_path):
    checkpoint = copy_fixture("fsdp2_adamw_3ranks")
    result = run_cli("compress", str(checkpoint), "--json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    assert report["in_place"] and report["codec"] == "zstd" and report["level"] == 3
    assert report["stored_bytes_after"] < report["stored_bytes_before"]
    result = run_cli("decompress", str(checkpoint), "-o", str(tmp_path / "p"))
    assert result.exit_code == 0, result.output
    assert "uncompressed (" in result.output and "ratio" in result.output
    assert "none" not in result.output
    assert_whole_and_checksummed(tmp_path / "p", "fsdp2_adamw_3ranks")


def test_dry_run_and_errors_are_one_line(run_cli, tmp_path):
    result = run_cli("compress", fixture_path("mesh2d_4ranks"), "--dry-run")
    assert result.exit_code == 0 and "would rewrite" in result.output
    for args in (["compress", str(tmp_path / "absent")],
                 ["compress", str(fixture_path("safetensors_fsdp2_2ranks")), "-o",
                  str(tmp_path / "o")]):
        result = run_cli(*args)
        assert result.exit_code == 1
        assert result.output.startswith("Error: ") and len(result.output.splitlines()) == 1
    assert run_cli("compress", "x", "--level", "30").exit_code == 2


def test_a_failed_run_gives_up_cleaning_a_store_that_stopped_answering(
        run_cli, copy_fixture, monkeypatch):
    """Removing what a failed run wrote into an object store waited on each request's
    retries, one object after another: against a dead store, the failing command did not
    end for minutes. It gives up after ABORT_SECONDS, and the error it reports is the run's."""
    import time

    import fsspec
    from conftest import damage_one_item

    from dcpctl.format.checkpoint import publishing
    from dcpctl.storage import objects

    source = copy_fixture("fsdp2_adamw_3ranks")
    damage_one_item(source, "__2_0.distcp")
    monkeypatch.setattr(publishing, "ABORT_SECONDS", 0.5, raising=False)
    monkeypatch.setattr(objects.ObjectStore, "delete", lambda *args, **kwargs: time.sleep(5))
    started = time.monotonic()
    result = run_cli("compress", source, "-o", "memory://silent-store/out")
    assert result.exit_code == 1 and "__2_0.distcp" in result.output
    assert time.monotonic() - started < 4
    assert not fsspec.filesystem("memory").exists("/silent-store/out/.metadata")

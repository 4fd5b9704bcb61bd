"""Every command on checkpoints in an S3 bucket, against real servers on 127.0.0.1 (moto's
server mode and `rclone serve s3`), checked as the local tests are: what comes out loads equal
through `dcp.load` (stock torch after a download, or dcpctl.storage_reader from the bucket), and
every failure is one line naming the URL."""

from __future__ import annotations

import json
import logging
import re
import threading

import pytest
import torch
from conftest import (ACCELERATE_PARTS, MANIFEST, add_accelerate_checkpoint,
                      dcpctl_stopped_at, download_prefix, fixture_path, flip_bit,
                      load_with_dcpctl_reader, load_with_torch, run_dcpctl, torch_metadata,
                      upload_directory)
from make_fixtures import tensor_sha256
from s3_servers import Faults, faulty_proxy
from safetensors.torch import load_file

SOURCE = "fsdp2_adamw_3ranks"


def expected_tensors() -> dict[str, str]:
    return {fqn: entry["sha256"] for fqn, entry in MANIFEST[SOURCE]["tensors"].items()}


def tensor_digests(state: dict) -> dict[str, str]:
    return {fqn: tensor_sha256(value) for fqn, value in state.items()
            if isinstance(value, torch.Tensor)}


def ok(*args) -> str:
    result = run_dcpctl(*args)
    assert result.returncode == 0, (args, result.stderr)
    return result.stdout


def failure(*args) -> str:
    result = run_dcpctl(*args)
    assert result.returncode == 1, (args, result.stdout, result.stderr)
    assert result.stderr.count("\n") == 1 and result.stderr.startswith("Error: "), result.stderr
    return result.stderr


@pytest.fixture
def bucket_checkpoint(s3_server):
    bucket = s3_server.new_bucket()
    return bucket, upload_directory(s3_server, fixture_path(SOURCE), bucket, "run/step-100")


def test_inspect_of_a_bucket_says_what_a_local_inspect_says(bucket_checkpoint):
    _, url = bucket_checkpoint
    remote = json.loads(ok("inspect", url, "--json"))
    local = json.loads(ok("inspect", fixture_path(SOURCE), "--json"))
    assert remote.pop("path") == url
    local.pop("path")
    assert remote == local


def requests_sent(server, *args) -> list[str]:
    """The requests (`GET /bucket/key HTTP/1.1`) moto's server received while dcpctl ran."""
    requests: list[str] = []

    class Requests(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            line = re.sub(r"\x1b\[[0-9;]*m", "", record.getMessage())  # colours
            requests.append(line.split('"')[1])

    werkzeug = logging.getLogger("werkzeug")  # moto's server logs each request there
    handler, level = Requests(), werkzeug.level
    werkzeug.setLevel(logging.INFO)
    werkzeug.addHandler(handler)
    try:
        ok(*args)
    finally:
        werkzeug.removeHandler(handler)
        werkzeug.setLevel(level)
    return requests


@pytest.fixture
def moto_checkpoint(moto_s3, monkeypatch):
    for name, value in moto_s3.environment().items():
        monkeypatch.setenv(name, value)
    bucket = moto_s3.new_bucket()
    return bucket, upload_directory(moto_s3, fixture_path(SOURCE), bucket, "run/step-100")


def test_inspect_of_a_bucket_costs_one_listing_and_one_get(moto_s3, moto_checkpoint):
    bucket, url = moto_checkpoint
    requests = requests_sent(moto_s3, "inspect", url, "--by-file")
    assert requests == [
        f"GET /{bucket}?list-type=2&prefix=run/step-100/&delimiter=&encoding-type=url HTTP/1.1",
        f"GET /{bucket}/run/step-100/.metadata HTTP/1.1"]


def test_verify_of_a_bucket_reads_each_object_in_one_stream(moto_s3, moto_checkpoint):
    bucket, url = moto_checkpoint  # data files of 33 to 48 KB, items of a few KB each
    requests = requests_sent(moto_s3, "verify", url)
    data_gets = sorted(request for request in requests if ".distcp" in request)
    assert data_gets == [f"GET /{bucket}/run/step-100/__{rank}_0.distcp HTTP/1.1"
                         for rank in range(3)]
    assert len(requests) == 2 + len(data_gets), requests  # one listing, .metadata


def test_verify_and_checksum_in_a_bucket(bucket_checkpoint, s3_server, tmp_path):
    bucket, url = bucket_checkpoint
    assert json.loads(ok("verify", url, "--json"))["status"] == "ok"
    sums = json.loads(ok("checksum", url, "--json"))
    assert sums["sums_path"] == f"{url}/SHA256SUMS"
    downloaded = download_prefix(s3_server, bucket, "run/step-100", tmp_path / "copy")
    local = json.loads(ok("checksum", downloaded, "--json"))
    assert sums["files"] == local["files"]
    report = json.loads(ok("verify", url, "--json"))
    assert report["status"] == "ok" and report["checksummed_files"] == 4


def test_verify_finds_a_flipped_byte_in_a_bucket(bucket_checkpoint, s3_server):
    bucket, url = bucket_checkpoint
    client = s3_server.client()
    key = "run/step-100/__1_0.distcp"
    data = bytearray(client.get_object(Bucket=bucket, Key=key)["Body"].read())
    data[len(data) // 2] ^= 0x10
    client.put_object(Bucket=bucket, Key=key, Body=bytes(data))
    result = run_dcpctl("verify", url, "--json")
    assert result.returncode == 1
    report = json.loads(result.stdout)
    assert report["status"] == "damaged"
    assert {problem["file"] for problem in report["problems"]} == {"__1_0.distcp"}


def test_compress_bucket_to_bucket_and_in_place_then_load_from_the_bucket(bucket_checkpoint):
    bucket, url = bucket_checkpoint
    compressed = f"s3://{bucket}/run-z/step-100"
    ok("compress", url, "-o", compressed)
    assert json.loads(ok("verify", compressed, "--json"))["status"] == "ok"
    assert tensor_digests(load_with_dcpctl_reader(compressed)) == expected_tensors()
    ok("compress", "--codec", "floatsplit", compressed)  # in place
    report = json.loads(ok("inspect", compressed, "--json"))
    assert set(report["compression"]) == {"floatsplit"}
    assert json.loads(ok("verify", compressed, "--json"))["status"] == "ok"
    assert tensor_digests(load_with_dcpctl_reader(compressed)) == expected_tensors()
    # the source is as it was
    assert json.loads(ok("inspect", url, "--json"))["compression"] == {"none": 82}


def test_a_checkpoint_compressed_in_place_in_a_bucket_still_tells_its_ranks(s3_server, tmp_path):
    """An in-place rewrite in a bucket keeps its data files' temporary names (no rename
    there): `reshard --mesh` then refused the checkpoint as one whose files are not named by
    rank, and inspect lost its `FSDP2/DTensor chunks` tell."""
    bucket = s3_server.new_bucket()
    url = upload_directory(s3_server, fixture_path("mesh2d_4ranks"), bucket, "mesh/step-1")
    before = json.loads(ok("inspect", url, "--json"))["layout"]
    ok("reshard", url, "--mesh", "4x2", "-o", tmp_path / "before")
    ok("compress", url)
    data_files = [key for key in keys_under(s3_server, bucket, "mesh/step-1/") if ".distcp" in key]
    assert data_files and all(key.endswith(".tmp") for key in data_files)
    assert json.loads(ok("inspect", url, "--json"))["layout"] == before
    ok("reshard", url, "--mesh", "4x2", "-o", tmp_path / "after")
    assert load_with_torch(tmp_path / "after").keys() == load_with_torch(tmp_path / "before").keys()
    assert tensor_digests(load_with_torch(tmp_path / "after")) == tensor_digests(
        load_with_torch(tmp_path / "before"))


def test_a_bucket_that_does_not_exist_is_named_as_such(bucket_checkpoint, s3_server):
    """It read `No such file or directory`, as a missing prefix in a bucket that is there."""
    bucket, url = bucket_checkpoint
    missing = f"s3://no-such-bucket-{bucket}"
    assert failure("inspect", f"{missing}/step-1") == f"Error: {missing}/step-1: no such bucket\n"
    assert failure("compress", url, "-o", f"{missing}/out").endswith(": no such bucket\n")
    assert "no such bucket" not in failure("inspect", f"s3://{bucket}/nothing-here")
    # a run directory (ls, prune) in a missing bucket said: no such directory
    for command in (["ls"], ["prune", "--keep-last", "1"]):
        assert failure(command[0], f"{missing}/run", *command[1:]) == (
            f"Error: {missing}/run: no such bucket\n")
    no_run = failure("ls", f"s3://{bucket}/no-run")
    assert no_run.endswith(": no such directory; give the run directory that holds the "
                           "checkpoint directories\n")


def test_decompress_and_reshard_between_bucket_and_local(bucket_checkpoint, tmp_path):
    bucket, url = bucket_checkpoint
    compressed = f"s3://{bucket}/z"
    ok("compress", url, "-o", compressed)
    ok("decompress", compressed, "-o", tmp_path / "plain")
    assert tensor_digests(load_with_torch(tmp_path / "plain")) == expected_tensors()
    resharded = f"s3://{bucket}/run-2/step-100"
    ok("reshard", compressed, "--ranks", "2", "-o", resharded)
    assert json.loads(ok("inspect", resharded, "--json"))["files"][-1]["name"] == "__1_0.distcp"
    assert tensor_digests(load_with_dcpctl_reader(resharded)) == expected_tensors()


def test_convert_from_a_bucket_and_into_one(bucket_checkpoint, tmp_path):
    bucket, url = bucket_checkpoint
    ok("convert", url, "--to", "safetensors", "-o", tmp_path / "hf")
    tensors = {}
    for path in (tmp_path / "hf").glob("*.safetensors"):
        tensors.update(load_file(path))
    model = {fqn: digest for fqn, digest in expected_tensors().items()
             if fqn.startswith("model.")}
    assert {f"model.{name}": tensor_sha256(value) for name, value in tensors.items()} == model
    back = f"s3://{bucket}/from-hf"
    ok("convert", tmp_path / "hf", "--to", "dcp", "-o", back, "--ranks", "2")
    assert {f"model.{fqn}": digest
            for fqn, digest in tensor_digests(load_with_dcpctl_reader(back)).items()} == model


def test_ls_and_prune_a_run_in_a_bucket(bucket_checkpoint, s3_server):
    bucket, _ = bucket_checkpoint
    for step in (200, 300):
        upload_directory(s3_server, fixture_path(SOURCE), bucket, f"run/step-{step}")
    run = f"s3://{bucket}/run"
    listing = json.loads(ok("ls", run, "--json"))
    assert [entry["step"] for entry in listing["checkpoints"]] == [100, 200, 300]
    assert all(entry["complete"] for entry in listing["checkpoints"])
    client = s3_server.client()
    markers = s3_server.name == "moto"  # rclone keeps folders as directories, no objects
    if markers:  # as S3 consoles make them: prune left them, and the steps' prefixes showed
        for marker in ("run/step-100/", "run/step-100/sub/", "run/step-200/meta.pt/",
                       "run/step-300/kept/"):
            client.put_object(Bucket=bucket, Key=marker, Body=b"")
    ok("prune", run, "--keep-last", "1")
    listing = json.loads(ok("ls", run, "--json"))
    assert [entry["step"] for entry in listing["checkpoints"]] == [300]
    assert not client.list_objects_v2(Bucket=bucket, Prefix="run/step-100/").get("Contents")
    assert not client.list_objects_v2(Bucket=bucket, Prefix="run/step-200/").get("Contents")
    if markers:
        assert "run/step-300/kept/" in keys_under(s3_server, bucket, "run/step-300/")


def keys_under(server, bucket: str, prefix: str = "") -> set[str]:
    paginator = server.client().get_paginator("list_objects_v2")
    pages = paginator.paginate(Bucket=bucket, Prefix=prefix)
    return {item["Key"] for page in pages for item in page.get("Contents", [])}


def test_prune_in_a_store_that_takes_no_etags_in_deletions_still_prunes(
        s3_server, monkeypatch):
    bucket = s3_server.new_bucket()
    for step in (1, 2):
        upload_directory(s3_server, fixture_path(SOURCE), bucket, f"run/step-{step}")
    with faulty_proxy(s3_server, Faults(no_delete_conditions=True)) as proxy:
        monkeypatch.setenv("AWS_ENDPOINT_URL_S3", proxy.endpoint)
        ok("prune", f"s3://{bucket}/run", "--keep-last", "1")
    assert {key.split("/")[1] for key in keys_under(s3_server, bucket)} == {"step-2"}


def test_prune_in_a_bucket_deletes_its_own_keys_never_what_they_match_as_patterns(s3_server):
    """fsspec's rm takes a key holding `[`, `*` or `?` for a glob: `run[1]/step-1/...` matched
    another run's `run1/step-1/...`, which went instead, while the run's own stayed."""
    bucket = s3_server.new_bucket()
    for run, steps in (("run[1]", (1, 2, 3)), ("run1", (1, 2))):
        for step in steps:
            upload_directory(s3_server, fixture_path(SOURCE), bucket, f"{run}/step-{step}")
    s3_server.client().put_object(Bucket=bucket, Key="run[1]/step-1/notes[1]*?.txt", Body=b"x")
    other_run = keys_under(s3_server, bucket, "run1/")
    output = ok("prune", f"s3://{bucket}/run[1]", "--keep-last", "1")
    assert "deleted 2 of 2" in output, output
    assert keys_under(s3_server, bucket, "run1/") == other_run
    assert {key.split("/")[1] for key in keys_under(s3_server, bucket, "run[1]/")} == {"step-3"}


def test_prune_deletes_a_key_holding_a_double_slash_itself_never_what_it_reads_as(
        moto_s3, monkeypatch):
    """A key under a checkpoint holding `//` (`run/step-1//B/run/step-2/__0_0.distcp`) is listed
    as `/B/run/step-2/__0_0.distcp` below step-1, and joining that to the prefix as a path gave
    the key at the root: prune deleted a file of step-2 (the checkpoint it kept) and objects of
    other buckets, exit 0. (rclone refuses such keys.)"""
    for name, value in moto_s3.environment().items():
        monkeypatch.setenv(name, value)
    bucket, other_bucket = moto_s3.new_bucket(), moto_s3.new_bucket()
    for step in (1, 2):
        upload_directory(moto_s3, fixture_path(SOURCE), bucket, f"run/step-{step}")
    client = moto_s3.client()
    client.put_object(Bucket=other_bucket, Key="precious.txt", Body=b"precious")
    for stray in (f"{bucket}/run/step-2/__0_0.distcp", f"{other_bucket}/precious.txt"):
        client.put_object(Bucket=bucket, Key=f"run/step-1//{stray}", Body=b"stray")
    kept = keys_under(moto_s3, bucket, "run/step-2/")
    ok("prune", f"s3://{bucket}/run", "--keep-last", "1")
    assert keys_under(moto_s3, bucket) == kept
    assert keys_under(moto_s3, other_bucket) == {"precious.txt"}
    assert json.loads(ok("verify", f"s3://{bucket}/run/step-2", "--json"))["status"] == "ok"


def _run_of_two_steps(moto_s3, monkeypatch) -> tuple:
    """A bucket holding run/step-1 and run/step-2, complete; its moto client and name, with
    dcpctl's processes pointed at moto."""
    for name, value in moto_s3.environment().items():
        monkeypatch.setenv(name, value)
    bucket = moto_s3.new_bucket()
    for step in (1, 2):
        upload_directory(moto_s3, fixture_path(SOURCE), bucket, f"run/step-{step}")
    return moto_s3.client(), bucket


def test_a_run_prefix_given_one_level_too_high_is_said_so(moto_s3, monkeypatch):
    for name, value in moto_s3.environment().items():
        monkeypatch.setenv(name, value)
    bucket = moto_s3.new_bucket()
    upload_directory(moto_s3, fixture_path(SOURCE), bucket, "dump/checkpoint/step-10")
    upload_directory(moto_s3, fixture_path(SOURCE), bucket, "dump/llama3")
    client = moto_s3.client()
    for name in ("__0.metadata", "__1.metadata"):  # saved with use_collectives=False
        client.put_object(Bucket=bucket, Key=f"dump/per-rank/{name}", Body=b"x")
    assert ok("ls", f"s3://{bucket}/dump").splitlines()[0] == (
        f"s3://{bucket}/dump: no checkpoint directories; checkpoint/ below it holds some: give "
        "it as the run directory; llama3/, per-rank/ in it are DCP checkpoints not named by a "
        "step (step-N, checkpoint-N, iter_N, ...), which ls and prune never take for the run's")


def test_an_object_named_like_a_step_is_listed_as_ignored_as_a_file_is_locally(moto_s3,
                                                                               monkeypatch):
    client, bucket = _run_of_two_steps(moto_s3, monkeypatch)
    client.put_object(Bucket=bucket, Key="run/step-7", Body=b"a file, not a checkpoint")
    client.put_object(Bucket=bucket, Key="run/step-2", Body=b"beside the checkpoint's prefix")
    listing = json.loads(ok("ls", f"s3://{bucket}/run", "--json"))
    assert [entry["name"] for entry in listing["checkpoints"]] == ["step-1", "step-2"]
    assert listing["ignored"] == [{"name": "step-7", "reason": "not a directory"}]
    report = json.loads(ok("prune", f"s3://{bucket}/run", "--keep-last", "1", "--json"))
    assert report["ignored"] == [{"name": "step-7", "reason": "not a directory"}]
    assert {"run/step-7", "run/step-2"} <= keys_under(moto_s3, bucket, "run/")


def test_a_save_still_uploading_into_a_checkpoint_is_not_deleted(moto_s3, monkeypatch):
    """An object being uploaded is in no listing: a rank's data file still going up left its
    step looking unchanged since its other files, and prune deleted them from under the save,
    which then wrote `.metadata` over a damaged checkpoint."""
    import time

    client, bucket = _run_of_two_steps(moto_s3, monkeypatch)
    client.put_object(Bucket=bucket, Key="run/step-3/__0_0.distcp", Body=b"rank 0, done")
    client.put_object(Bucket=bucket, Key="run/step-4/__0_0.distcp", Body=b"a save that died")
    time.sleep(2.5)
    upload = client.create_multipart_upload(Bucket=bucket, Key="run/step-3/__1_0.distcp")
    client.upload_part(Bucket=bucket, Key="run/step-3/__1_0.distcp", PartNumber=1,
                       UploadId=upload["UploadId"], Body=b"rank 1, going up")
    report = json.loads(ok("prune", f"s3://{bucket}/run", "--keep-last", "1",
                           "--incomplete-older-than", "2s", "--json"))
    statuses = {entry["name"]: entry["status"] for entry in report["checkpoints"]}
    assert statuses == {"step-1": "deleted", "step-2": "kept", "step-3": "kept",
                        "step-4": "deleted"}
    assert keys_under(moto_s3, bucket, "run/step-3/") == {"run/step-3/__0_0.distcp"}
    assert client.list_multipart_uploads(Bucket=bucket)["Uploads"][0]["Key"] == (
        "run/step-3/__1_0.distcp")


def test_an_object_written_since_prunes_scan_stays_and_the_run_says_so(moto_s3, monkeypatch,
                                                                       tmp_path):
    """A trainer back at an old step writes into the incomplete checkpoint prune is deleting:
    what it wrote since the scan stays, and prune reports that deletion failed."""
    import signal
    import time

    client, bucket = _run_of_two_steps(moto_s3, monkeypatch)
    client.put_object(Bucket=bucket, Key="run/step-3/__0_0.distcp", Body=b"old")
    time.sleep(1.5)  # a crashed save's leftovers, unchanged for over a second
    process = dcpctl_stopped_at(  # once its first deletion took a `.metadata`
        "after-metadata-removed", "prune", f"s3://{bucket}/run", "--keep-last", "1",
        "--incomplete-older-than", "1s", "--json")
    try:
        client.put_object(Bucket=bucket, Key="run/step-3/__0_0.distcp", Body=b"new save")
        client.put_object(Bucket=bucket, Key="run/step-3/__1_0.distcp", Body=b"new save")
    finally:
        process.send_signal(signal.SIGCONT)
        stdout, stderr = process.communicate(timeout=120)
    assert process.returncode == 1, stderr
    rows = {row["name"]: row for row in json.loads(stdout)["checkpoints"]}
    assert rows["step-1"]["status"] == "deleted"
    assert rows["step-3"]["status"] == "failed"
    assert "written since dcpctl listed it" in rows["step-3"]["error"]
    assert keys_under(moto_s3, bucket, "run/step-3/") == {
        "run/step-3/__0_0.distcp", "run/step-3/__1_0.distcp"}
    body = client.get_object(Bucket=bucket, Key="run/step-3/__0_0.distcp")["Body"].read()
    assert body == b"new save"


def test_a_checkpoint_whose_metadata_came_since_the_scan_is_not_deleted(moto_s3, monkeypatch):
    from dcpctl.storage.objects import StorageError
    from dcpctl.storage.paths import storage_path
    from dcpctl.storage.staging import delete_checkpoint_objects

    for name, value in moto_s3.environment().items():
        monkeypatch.setenv(name, value)
    bucket = moto_s3.new_bucket()
    url = upload_directory(moto_s3, fixture_path(SOURCE), bucket, "run/step-1")
    directory = storage_path(url)
    seen = directory.store.list_tree(directory.key)
    moto_s3.client().put_object(Bucket=bucket, Key="run/step-1/.metadata",  # a new save's
                                Body=(fixture_path("mesh2d_4ranks") / ".metadata").read_bytes())
    before = keys_under(moto_s3, bucket)
    with pytest.raises(StorageError, match="was written since dcpctl listed it"):
        delete_checkpoint_objects(directory, seen=seen)
    assert keys_under(moto_s3, bucket) == before


@pytest.mark.parametrize("lands_before_deletion", [1, 2], ids=["the first", "the second"])
def test_a_metadata_that_lands_as_prune_deletes_is_kept_with_its_data(moto_s3, monkeypatch,
                                                                      lands_before_deletion):
    """The save of an incomplete checkpoint finished between prune's last look and its first
    deletion: its `.metadata`, never listed, was deleted with no condition, then its data."""
    from dcpctl.storage.objects import StorageError
    from dcpctl.storage.paths import storage_path
    from dcpctl.storage.s3 import S3Store
    from dcpctl.storage.staging import delete_checkpoint_objects

    for name, value in moto_s3.environment().items():
        monkeypatch.setenv(name, value)
    bucket = moto_s3.new_bucket()
    client = moto_s3.client()
    source = fixture_path(SOURCE)
    for path in sorted(source.glob("*.distcp")):
        client.put_object(Bucket=bucket, Key=f"run/step-3/{path.name}", Body=path.read_bytes())
    directory = storage_path(f"s3://{bucket}/run/step-3")
    seen = directory.store.list_tree(directory.key)
    delete, landed = S3Store.delete, []

    def save_finishing_first(store, keys, if_etags=None):
        landed.append(True)
        if len(landed) == lands_before_deletion:
            client.put_object(Bucket=bucket, Key="run/step-3/.metadata",
                              Body=(source / ".metadata").read_bytes())
        return delete(store, keys, if_etags)

    monkeypatch.setattr(S3Store, "delete", save_finishing_first)
    before_save = keys_under(moto_s3, bucket)
    with pytest.raises(StorageError, match="was written since dcpctl listed it"):
        delete_checkpoint_objects(directory, seen=seen)
    kept = keys_under(moto_s3, bucket)
    assert "run/step-3/.metadata" in kept
    if lands_before_deletion == 1:  # before the data went: the data stays
        assert kept == before_save | {"run/step-3/.metadata"}


def test_an_object_the_store_refuses_to_delete_stops_the_deletion(s3_server, monkeypatch):
    """S3 answers DeleteObjects with 200 and lists the keys it did not delete: prune took that
    for done and went on to delete the data of a checkpoint whose `.metadata` stayed, which then
    looked complete and was not."""
    bucket = s3_server.new_bucket()
    for step in (1, 2):
        upload_directory(s3_server, fixture_path(SOURCE), bucket, f"run/step-{step}")
    before = keys_under(s3_server, bucket)
    with faulty_proxy(s3_server, Faults(refused_deletes_in="step-1/.metadata")) as proxy:
        monkeypatch.setenv("AWS_ENDPOINT_URL_S3", proxy.endpoint)
        result = run_dcpctl("prune", f"s3://{bucket}/run", "--keep-last", "1", "--json")
    assert result.returncode == 1, result.stderr
    row = json.loads(result.stdout)["checkpoints"][0]
    assert (row["name"], row["status"]) == ("step-1", "failed")
    assert row["error"] == (f"s3://{bucket}/run/step-1/.metadata: was not deleted (S3 error "
                            "AccessDenied: Access Denied)")
    assert keys_under(s3_server, bucket) == before


@pytest.mark.parametrize("command,lost_to", [
    (["compress"], "/.metadata"), (["decompress"], "/.metadata"),
    (["compress", "-o", "{bucket_url}/out"], "/.metadata"),
    (["compress", "-o", "{bucket_url}/out"], "/.metadata.tmp")])  # the output's claim
def test_a_reply_lost_after_the_metadata_was_written_is_no_failure(moto_s3, moto_checkpoint,
                                                                   monkeypatch, command, lost_to):
    """The store wrote `.metadata` and the connection dropped before its reply: the client
    sent the conditional write again, which failed (412), and an in-place run then deleted
    the new files the new `.metadata` names, the old `.metadata` gone: nothing loaded."""
    bucket, url = moto_checkpoint
    if command == ["decompress"]:
        ok("compress", url)
    args = [part.format(bucket_url=f"s3://{bucket}") for part in command]
    output = args[2] if len(args) > 1 else url
    faults = Faults(lost=1, lost_to=lost_to)
    with faulty_proxy(moto_s3, faults) as proxy:
        monkeypatch.setenv("AWS_ENDPOINT_URL_S3", proxy.endpoint)
        result = run_dcpctl(args[0], url, *args[1:])
    assert faults.lost_so_far == 1
    assert result.returncode == 0, result.stderr
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", moto_s3.endpoint)
    assert json.loads(ok("verify", output, "--json"))["status"] == "ok"


@pytest.mark.slow  # the client's retries of the refused reads: about 40 s
def test_a_switch_whose_outcome_the_store_will_not_tell_keeps_every_file(
        moto_s3, moto_checkpoint, monkeypatch):
    """The reply to the switch of `.metadata` lost, then its reads refused: taking that for a
    switch not made, the run deleted the new files the new `.metadata` names."""
    bucket, url = moto_checkpoint
    faults = Faults(lost=1, lost_to="/.metadata", unreadable_after_loss=True)
    with faulty_proxy(moto_s3, faults) as proxy:
        monkeypatch.setenv("AWS_ENDPOINT_URL_S3", proxy.endpoint)
        result = run_dcpctl("compress", url)
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", moto_s3.endpoint)
    assert result.returncode == 1
    assert "the store would not say whether it happened all the same; the old and the new " \
           "data files are both kept" in result.stderr, result.stderr
    assert tensor_digests(load_with_dcpctl_reader(url)) == expected_tensors()


def test_old_files_an_in_place_run_cannot_delete_are_named_and_gone_next_run(
        moto_s3, moto_checkpoint, monkeypatch):
    """Once `.metadata` names the new files the rewrite is done; a store that then refuses to
    delete the old files made the run fail as a connection error, SHA256SUMS unwritten."""
    bucket, url = moto_checkpoint
    faults = Faults(refused_deletes_in="step-100/__0_0.distcp</Key>")
    with faulty_proxy(moto_s3, faults) as proxy:
        monkeypatch.setenv("AWS_ENDPOINT_URL_S3", proxy.endpoint)
        result = run_dcpctl("compress", url)
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", moto_s3.endpoint)
    assert result.returncode == 1
    assert result.stderr.startswith(f"Error: {url}: was rewritten (its .metadata and SHA256SUMS "
                                    "name the new files), but removing the 3 old data files "
                                    "failed (")
    assert result.stderr.endswith("; run the command again to remove them\n")
    state = load_with_dcpctl_reader(url)
    assert tensor_digests(state) == expected_tensors()
    ok("compress", url)
    assert json.loads(ok("verify", url, "--json"))["status"] == "ok"


@pytest.mark.parametrize("second_stops", ["before-atomic-rename@1", "before-atomic-rename@2"],
                         ids=["before its SHA256SUMS", "before its .metadata"])
def test_an_output_taken_over_as_it_was_published_is_taken_back(
        moto_s3, moto_checkpoint, second_stops):
    """Run A gave its claim up and was about to write `.metadata` when run B, with
    --overwrite, deleted A's files and wrote its own in their place: A published its
    `.metadata` over B's data files and exited 0, the output damaged."""
    import signal

    bucket, url = moto_checkpoint
    output = f"s3://{bucket}/out"
    # the first stops with its claim given up, `.metadata` next
    first = dcpctl_stopped_at("before-atomic-rename@2", "compress", url, "-o", output)
    second = None
    try:  # the second stops with its data files written in place of the first's
        second = dcpctl_stopped_at(second_stops, "decompress", url, "-o", output,
                                   "--overwrite")
        first.send_signal(signal.SIGCONT)
        _, first_error = first.communicate(timeout=120)
        second.send_signal(signal.SIGCONT)
        _, second_error = second.communicate(timeout=120)
    finally:
        for process in (first, second):
            if process is not None and process.poll() is None:
                process.kill()
    assert first.returncode == 75 and "while this run wrote the output" in first_error, \
        first_error
    assert second.returncode == 0, second_error
    report = json.loads(ok("verify", output, "--json"))
    assert report["status"] == "ok" and json.loads(ok("inspect", output, "--json"))[
        "compression"] == {"none": report["items_checked"]}


def test_a_run_taken_over_while_it_wrote_leaves_the_other_runs_output_whole(
        moto_s3, moto_checkpoint):
    """Run A stopped after its first data file; run B, with --overwrite, deleted A's files and
    published its own output. A, resumed, wrote its remaining data files over B's (uploads
    were unconditional) before its own check failed it: B's published output was damaged."""
    import signal

    bucket, url = moto_checkpoint
    output = f"s3://{bucket}/out"
    first = dcpctl_stopped_at("after-data-file@1", "compress", url, "-o", output,
                              "--threads", "1")
    try:
        ok("decompress", url, "-o", output, "--overwrite")
        first.send_signal(signal.SIGCONT)
        _, first_error = first.communicate(timeout=120)
    finally:
        if first.poll() is None:
            first.kill()
    assert first.returncode == 75, first_error
    assert "another run" in first_error and "nothing was published" in first_error, first_error
    report = json.loads(ok("verify", output, "--json"))
    assert report["status"] == "ok", report
    assert json.loads(ok("inspect", output, "--json"))["compression"] == {
        "none": report["items_checked"]}
    assert tensor_digests(load_with_dcpctl_reader(output)) == expected_tensors()


def test_a_reply_lost_after_a_data_object_was_written_is_no_failure(
        moto_s3, moto_checkpoint, monkeypatch):
    """A data object is created only where none has its name; the client's retry of a create
    whose reply was lost is refused, and the object there is this run's own."""
    bucket, url = moto_checkpoint
    faults = Faults(lost=1, lost_to="/out/__1_0.distcp")
    with faulty_proxy(moto_s3, faults) as proxy:
        monkeypatch.setenv("AWS_ENDPOINT_URL_S3", proxy.endpoint)
        result = run_dcpctl("compress", url, "-o", f"s3://{bucket}/out")
    assert faults.lost_so_far == 1
    assert result.returncode == 0, result.stderr
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", moto_s3.endpoint)
    assert json.loads(ok("verify", f"s3://{bucket}/out", "--json"))["status"] == "ok"


def test_a_reply_lost_after_a_multipart_object_was_completed_is_no_failure(
        s3_server, monkeypatch, tmp_path):
    """An object of several parts: the reply to the request completing it lost, the client's
    retry finds the upload gone (or, with the condition, the object there). The object there
    is known for this run's own by its ETag where the store gives S3's ETag of an upload, and
    by its parts read back where it gives another (rclone's: the MD5 of the whole object)."""
    import torch.distributed.checkpoint as dcp

    weights = {"w": torch.randn(3 << 20, generator=torch.Generator().manual_seed(0))}  # 12 MiB
    dcp.save(weights, checkpoint_id=str(tmp_path / "big"), no_dist=True)
    bucket = s3_server.new_bucket()
    url = upload_directory(s3_server, tmp_path / "big", bucket, "big")
    faults = Faults(lost=1, lost_to="/out/__0_0.distcp")
    with faulty_proxy(s3_server, faults) as proxy:
        monkeypatch.setenv("AWS_ENDPOINT_URL_S3", proxy.endpoint)
        result = run_dcpctl("reshard", url, "--ranks", "1", "-o", f"s3://{bucket}/out")
    assert faults.lost_so_far == 1
    assert result.returncode == 0, result.stderr
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", s3_server.endpoint)
    assert json.loads(ok("verify", f"s3://{bucket}/out", "--json"))["status"] == "ok"
    assert torch.equal(load_with_dcpctl_reader(f"s3://{bucket}/out")["w"], weights["w"])


def test_ls_and_prune_accelerate_checkpoints_in_a_bucket(s3_server, tmp_path):
    bucket = s3_server.new_bucket()
    for step in range(3):
        local = add_accelerate_checkpoint(tmp_path, f"checkpoint_{step}")
        upload_directory(s3_server, local, bucket, f"checkpoints/checkpoint_{step}")
    run = f"s3://{bucket}/checkpoints"
    listing = json.loads(ok("ls", run, "--json"))["checkpoints"]
    assert [(entry["name"], entry["complete"], entry["parts"]) for entry in listing] == [
        (f"checkpoint_{step}", True, list(ACCELERATE_PARTS)) for step in range(3)]
    assert failure("prune", f"{run}/checkpoint_1", "--keep-last", "1") == (
        f"Error: {run}/checkpoint_1: is an accelerate checkpoint itself (holds "
        "pytorch_model_fsdp_0); give the run directory above it (accelerate's `checkpoints/`)\n")
    ok("prune", run, "--keep-last", "1")
    client = s3_server.client()
    left = {item["Key"] for item in client.list_objects_v2(Bucket=bucket)["Contents"]}
    assert {key.split("/")[1] for key in left} == {"checkpoint_2"}


def test_hf_storage_writer_shards_in_a_bucket(s3_server, tmp_path):
    """Each rank's file as torch's HuggingFaceStorageWriter writes it (DCP_SHARDING_INFO in the
    header), read from a bucket: inspect, verify and convert to whole tensors."""
    from safetensors.torch import save_file

    whole = torch.arange(30, dtype=torch.float32).reshape(6, 5)
    local = tmp_path / "shards"
    local.mkdir()
    for rank, rows in enumerate((slice(0, 3), slice(3, 6))):
        info = json.dumps({"w": {"saved_offsets": [rows.start, 0]}})
        save_file({"w": whole[rows].contiguous()},
                  local / f"shard-{rank + 1:05d}-model-00001-of-00001.safetensors",
                  metadata={"DCP_SHARDING_INFO": info, "format": "pt"})
    bucket = s3_server.new_bucket()
    url = upload_directory(s3_server, local, bucket, "hf")
    inspected = json.loads(ok("inspect", url, "--json"))
    assert [(tensor["fqn"], tensor["shape"], len(tensor["chunks"]))
            for tensor in inspected["tensors"]] == [("w", [6, 5], 2)]
    assert "status      ok" in ok("verify", url)
    ok("convert", url, "--to", "safetensors", "-o", tmp_path / "hf")
    assert torch.equal(load_file(tmp_path / "hf" / "model.safetensors")["w"], whole)


def test_an_existing_output_in_a_bucket_is_refused_without_overwrite(bucket_checkpoint):
    bucket, url = bucket_checkpoint
    ok("compress", url, "-o", f"s3://{bucket}/out")
    assert "exists and is not empty (pass --overwrite" in failure(
        "compress", url, "-o", f"s3://{bucket}/out")
    ok("compress", url, "-o", f"s3://{bucket}/out", "--overwrite", "--codec", "floatsplit")
    assert set(json.loads(ok("inspect", f"s3://{bucket}/out", "--json"))["compression"]) \
        == {"floatsplit"}
    assert "is the input" in failure("compress", url, "-o", f"{url}/inner") \
        or "inside the input" in failure("compress", url, "-o", f"{url}/inner")


def test_a_file_output_that_names_a_bucket_is_refused(moto_s3, moto_checkpoint):
    _, url = moto_checkpoint
    bucket = moto_s3.new_bucket()
    assert failure("convert", url, "--to", "torch", "-o", f"s3://{bucket}") == (
        f"Error: s3://{bucket}: names a bucket, not an object in it; give s3://BUCKET/NAME\n")


def test_an_http_url_is_refused_for_what_it_is():
    """fsspec's http file system keeps the whole URL as its key: the check of path segments
    called `http://127.0.0.1:9/ck` one with an empty segment."""
    result = run_dcpctl("inspect", "http://127.0.0.1:9/ck")
    assert result.returncode == 2 and "names a web page" in result.stderr
    assert result.stderr.count("\n") == 1


@pytest.mark.parametrize("suffix", ["x/..", "x/.", "x//y"])
def test_a_url_with_dot_or_empty_segments_is_refused_before_anything_is_written(
        bucket_checkpoint, s3_server, suffix):
    """Object stores do not resolve `..`: `-o s3://b/out/..` would write objects literally
    named `out/../.metadata`."""
    bucket, url = bucket_checkpoint
    before = s3_server.client().list_objects_v2(Bucket=bucket)["KeyCount"]
    for args in (["compress", url, "-o", f"s3://{bucket}/{suffix}"],
                 ["inspect", f"{url}/{suffix}"]):
        result = run_dcpctl(*args)
        assert result.returncode == 2, (args, result.stderr)
        assert result.stderr.count("\n") == 1 and "'..' or empty path segments" in result.stderr
    assert s3_server.client().list_objects_v2(Bucket=bucket)["KeyCount"] == before


def test_faults_are_one_line_naming_the_url(s3_server, monkeypatch):
    bucket = s3_server.new_bucket()
    assert "no objects under this prefix" in failure("inspect", f"s3://{bucket}/nothing")
    assert "s3://no-such-bucket-zz/ck" in failure("inspect", "s3://no-such-bucket-zz/ck")
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    assert "no AWS credentials found" in failure("inspect", f"s3://{bucket}/ck")


def test_wrong_credentials_are_access_denied(rclone_s3, monkeypatch):
    for name, value in rclone_s3.environment().items():
        monkeypatch.setenv(name, value)
    bucket = rclone_s3.new_bucket()
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret")
    message = failure("inspect", f"s3://{bucket}/ck")
    assert f"s3://{bucket}/ck" in message and "access denied" in message


def test_storage_options_reach_the_client_and_wrong_ones_are_named(moto_s3, moto_checkpoint,
                                                                   monkeypatch):
    bucket, url = moto_checkpoint
    monkeypatch.delenv("AWS_ENDPOINT_URL_S3")  # found through the option alone, then
    option = f"endpoint_url={moto_s3.endpoint}"
    assert json.loads(ok("--storage-option", option, "inspect", url, "--json"))["path"] == url
    monkeypatch.setenv("DCPCTL_STORAGE_OPTIONS", json.dumps({"endpoint_url": moto_s3.endpoint}))
    assert json.loads(ok("verify", url, "--json"))["status"] == "ok"
    assert "unknown option 'retries'" in failure("--storage-option", "retries=2", "inspect", url)
    monkeypatch.setenv("DCPCTL_STORAGE_OPTIONS", "{endpoint_url: 1")
    assert "DCPCTL_STORAGE_OPTIONS is not JSON" in failure("inspect", url)
    monkeypatch.setenv("DCPCTL_STORAGE_OPTIONS", json.dumps({"endpoint_url": 5}))
    assert "cannot open s3:// URLs with these storage options" in failure("inspect", url)
    result = run_dcpctl("--storage-option", "password:hunter2", "inspect", url)
    assert result.returncode == 2 and "--storage-option: takes KEY=VALUE" in result.stderr
    assert "hunter2" not in result.stderr  # a typo's value may be a secret


@pytest.mark.slow  # backoff between retries: about 13 s
def test_throttling_and_dropped_connections_are_retried(moto_s3, moto_checkpoint, monkeypatch):
    bucket, url = moto_checkpoint
    faults = Faults(throttled=2, dropped=2)
    with faulty_proxy(moto_s3, faults) as proxy:
        for name, value in proxy.environment().items():
            monkeypatch.setenv(name, value)
        assert json.loads(ok("verify", url, "--json"))["status"] == "ok"
        assert (faults.throttled_so_far, faults.dropped_so_far) == (2, 2)
        faults.throttled_so_far = faults.dropped_so_far = 0  # the same again, for compress
        ok("compress", url, "-o", f"s3://{bucket}/run/z")
        assert (faults.throttled_so_far, faults.dropped_so_far) == (2, 2)
    for name, value in moto_s3.environment().items():
        monkeypatch.setenv(name, value)
    assert tensor_digests(load_with_dcpctl_reader(f"s3://{bucket}/run/z")) == expected_tensors()


@pytest.mark.slow  # retries until they are spent: 7 to 14 s
@pytest.mark.parametrize("dropped_in", ["", ".distcp"], ids=["the-listing", "data-reads"])
def test_a_connection_that_keeps_dropping_fails_and_publishes_nothing(
        moto_s3, moto_checkpoint, monkeypatch, dropped_in):
    bucket, url = moto_checkpoint
    with faulty_proxy(moto_s3, Faults(dropped=10**6, dropped_in=dropped_in)) as proxy:
        for name, value in proxy.environment().items():
            monkeypatch.setenv(name, value)
        # fewer retries than dcpctl's default, so that giving up is quick
        monkeypatch.setenv("DCPCTL_STORAGE_OPTIONS", json.dumps(
            {"config_kwargs": {"retries": {"max_attempts": 2}}}))
        message = failure("compress", url, "-o", f"s3://{bucket}/run/z")
    assert url in message and "connection" in message, message
    assert not moto_s3.client().list_objects_v2(Bucket=bucket, Prefix="run/z").get("Contents")


def test_workers_share_a_bucket_checkpoint(moto_s3, moto_checkpoint):
    bucket, url = moto_checkpoint
    ok("compress", url, "-o", f"s3://{bucket}/run/two", "--workers", 2)
    ok("compress", url, "-o", f"s3://{bucket}/run/one")
    client = moto_s3.client()

    def objects(prefix: str) -> dict[str, bytes]:
        listed = client.list_objects_v2(Bucket=bucket, Prefix=prefix)["Contents"]
        return {item["Key"][len(prefix):]: client.get_object(
            Bucket=bucket, Key=item["Key"])["Body"].read() for item in listed}

    assert objects("run/two/") == objects("run/one/")
    assert tensor_digests(load_with_dcpctl_reader(f"s3://{bucket}/run/two")) == expected_tensors()
    assert json.loads(ok("verify", f"s3://{bucket}/run/two", "--json", "--workers", 3)
                      )["status"] == "ok"


def _two_files_of_24_mb(directory, damaged: bool = False) -> None:
    """A checkpoint of two files of six 4 MB tensors each; damaged: the last item of each has
    a bit flipped in its tensor data."""
    import torch.distributed.checkpoint as dcp

    generator = torch.Generator().manual_seed(0)
    state = {f"w{index}": torch.randn(1 << 20, generator=generator) for index in range(12)}
    dcp.save(state, storage_writer=dcp.FileSystemWriter(directory, thread_count=2),
             no_dist=True)
    if damaged:
        for key, info in torch_metadata(directory).storage_data.items():
            if key.fqn in ("w5", "w11"):
                flip_bit(directory / info.relative_path, info.offset + info.length // 2)


def _uploaded(moto_s3, monkeypatch, directory) -> tuple:
    """The moto client, a new bucket and the URL of directory uploaded into it (run/step-1),
    with dcpctl's processes pointed at moto."""
    for name, value in moto_s3.environment().items():
        monkeypatch.setenv(name, value)
    client, bucket = moto_s3.client(), moto_s3.new_bucket()
    return client, bucket, upload_directory(moto_s3, directory, bucket, "run/step-1")


def _objects_of(client, bucket: str) -> dict[str, str]:
    """Every object of the bucket, by key: its ETag."""
    return {item["Key"]: item["ETag"]
            for item in client.list_objects_v2(Bucket=bucket).get("Contents", ())}


_WORKER_ENDS = {"SIGTERM": "worker 2 of 2: stopped by SIGTERM",
                "SIGHUP": "worker 2 of 2: stopped by SIGHUP",
                "SIGKILL": "worker 2 of 2 ended without finishing its share (killed by SIGKILL)",
                "a damaged item": "CRC-32"}


@pytest.mark.parametrize("stop", list(_WORKER_ENDS))
@pytest.mark.parametrize("output", ["in place", "new prefix"])
def test_a_worker_stopped_failing_or_killed_mid_upload_leaves_no_upload(
        moto_s3, monkeypatch, tmp_path, stop, output):
    """A worker ended mid-share (its coordinator failing or stopped terminates it), or whose
    share failed, ended with its multipart upload open: S3 keeps and bills its parts, out of
    every listing, and the clean-up of an in-place run aborts only the uploads of its own
    process (under a day old, another's may be a live run's). It aborts its own; one killed
    (SIGKILL) cannot, and its coordinator aborts the uploads of this run's temporary names (or
    under the new prefix it holds). Here the worker is sent the signal itself three items into
    a file of several parts, or each file's last item is damaged. (moto dates every upload in
    2010, so under a new prefix the day-old clean-up takes a killed worker's uploads too:
    test_an_aborted_object_store_output_aborts_the_uploads_of_its_files checks that case.)"""
    signalled = stop != "a damaged item"
    _two_files_of_24_mb(tmp_path / "ck", damaged=not signalled)
    client, bucket, url = _uploaded(moto_s3, monkeypatch, tmp_path / "ck")
    source = _objects_of(client, bucket)
    output_args = ["-o", f"s3://{bucket}/run/z"] if output == "new prefix" else []
    result = run_dcpctl("compress", url, *output_args, "--workers", 2, "--threads", 1,
                        failpoint=f"after-data-write@3:{stop}" if signalled else None,
                        failpoint_scope="workers", timeout=120)
    assert result.returncode == 1, result.stderr
    assert _WORKER_ENDS[stop] in result.stderr, result.stderr
    assert not client.list_multipart_uploads(Bucket=bucket).get("Uploads")
    assert _objects_of(client, bucket) == source


@pytest.mark.slow  # torchrun's start-up: about 15 s
def test_torchrun_ranks_share_a_bucket_checkpoint(moto_s3, moto_checkpoint):
    """Each rank writes its share of the output objects and hands rank 0 their ETags, which
    rank 0's checks before and after `.metadata` compare."""
    import subprocess
    import sys

    bucket, url = moto_checkpoint
    for name, command in {"compress": ["compress"], "reshard": ["reshard", "--ranks", "2"]
                          }.items():
        ranked, alone = f"s3://{bucket}/run/{name}-ranked", f"s3://{bucket}/run/{name}-alone"
        result = subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", "--standalone",
             "--nproc-per-node=2", "-m", "dcpctl", command[0], url, *command[1:], "-o", ranked],
            capture_output=True, text=True, timeout=300)
        assert result.returncode == 0, result.stderr
        ok(command[0], url, *command[1:], "-o", alone)
        client = moto_s3.client()

        def objects(prefix: str) -> dict[str, bytes]:
            listed = client.list_objects_v2(Bucket=bucket, Prefix=prefix)["Contents"]
            return {item["Key"][len(prefix):]: client.get_object(
                Bucket=bucket, Key=item["Key"])["Body"].read() for item in listed}

        assert objects(f"run/{name}-ranked/") == objects(f"run/{name}-alone/")
        assert json.loads(ok("verify", ranked, "--json"))["status"] == "ok"
    assert tensor_digests(load_with_dcpctl_reader(f"s3://{bucket}/run/compress-ranked")
                          ) == expected_tensors()


@pytest.mark.slow  # torchrun's start-up: about 15 s
def test_a_torchrun_rank_failing_mid_upload_aborts_its_upload(moto_s3, monkeypatch, tmp_path):
    """As a local worker's: the share of rank 1 fails on a damaged item, its upload open."""
    import subprocess
    import sys

    _two_files_of_24_mb(tmp_path / "ck", damaged=True)
    client, bucket, url = _uploaded(moto_s3, monkeypatch, tmp_path / "ck")
    source = _objects_of(client, bucket)
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
         "-m", "dcpctl", "compress", url, "--threads", "1"],
        capture_output=True, text=True, timeout=300)
    assert result.returncode != 0 and "CRC-32" in result.stderr, result.stderr
    assert not client.list_multipart_uploads(Bucket=bucket).get("Uploads")
    assert _objects_of(client, bucket) == source


def test_an_object_a_worker_wrote_replaced_with_one_of_its_size_is_not_published(
        moto_s3, moto_checkpoint, monkeypatch, run_cli):
    """The coordinator checks that each object of its output is still the one written, by
    size and ETag, before and after `.metadata`; it knew the ETags of its own writes only, so
    an object a worker wrote, replaced by another run with one of the same size, passed."""
    from dcpctl.storage.s3 import S3Store
    from dcpctl.storage.staging import ObjectStoreOutput

    bucket, url = moto_checkpoint
    client, written_here, replaced = moto_s3.client(), set(), []
    open_writer, confirm = S3Store.open_writer, ObjectStoreOutput.confirm

    def recording(store, key, **options):
        written_here.add(key)
        return open_writer(store, key, **options)

    def replacing_then_confirming(output, names=(), sizes=None):
        listed = client.list_objects_v2(Bucket=bucket, Prefix="run/out/")["Contents"]
        key = next(item["Key"] for item in listed
                   if item["Key"].endswith(".distcp")
                   and f"{bucket}/{item['Key']}" not in written_here)
        old = client.get_object(Bucket=bucket, Key=key)["Body"].read()
        client.put_object(Bucket=bucket, Key=key, Body=bytes(255 - byte for byte in old))
        replaced.append(key)
        return confirm(output, names, sizes)

    monkeypatch.setattr(S3Store, "open_writer", recording)
    monkeypatch.setattr(ObjectStoreOutput, "confirm", replacing_then_confirming)
    result = run_cli("compress", url, "-o", f"s3://{bucket}/run/out", "--workers", 2)
    assert result.exit_code == 75 and len(replaced) == 1, result.output
    assert f"{replaced[0].split('/')[-1]} was replaced while this run wrote the output (its " \
           "ETag" in result.output
    keys = [item["Key"] for item in client.list_objects_v2(
        Bucket=bucket, Prefix="run/out/").get("Contents", ())]
    assert "run/out/.metadata" not in keys


def test_reshard_to_a_mesh_from_a_bucket_into_a_bucket(s3_server, tmp_path):
    """--mesh reads the rank files of a bucket's checkpoint to tell the source mesh, and writes
    the new mesh's layout into a bucket; equal to the same reshard done locally."""
    bucket = s3_server.new_bucket()
    url = upload_directory(s3_server, fixture_path("mesh2d_4ranks"), bucket, "tp/step-1")
    ok("reshard", url, "--mesh", "3x2", "-o", f"s3://{bucket}/tp6/step-1")
    ok("reshard", fixture_path("mesh2d_4ranks"), "--mesh", "3x2", "-o", tmp_path / "local")
    downloaded = download_prefix(s3_server, bucket, "tp6/step-1", tmp_path / "downloaded")
    for path in (tmp_path / "local").iterdir():
        assert (downloaded / path.name).read_bytes() == path.read_bytes(), path.name


def test_an_in_place_run_leaves_another_runs_fresh_temporaries_in_a_bucket(bucket_checkpoint):
    """No locks in a bucket: a second command's start-up took a live in-place run's new data
    objects for a killed run's and deleted them, and the live run then switched `.metadata`
    to them: the checkpoint named objects that were gone. Temporaries written within the last
    day stay; one that goes missing all the same stops the run before its switch."""
    from dcpctl.storage.paths import storage_path

    bucket, url = bucket_checkpoint
    directory = storage_path(url)
    live = "__0_0.distcp.dcpctl-0123456789ab.tmp"  # as a live in-place run writes it
    directory.store.put((directory / live).key, b"being written")
    ok("compress", url)  # in place
    assert live in directory.store.list_tree(directory.key)


def test_an_in_place_run_whose_new_objects_went_missing_stops(bucket_checkpoint, monkeypatch):
    from dcpctl.errors import DataError
    from dcpctl.format.checkpoint import publishing
    from dcpctl.ops.transcode import compress_checkpoint
    from dcpctl.storage.paths import storage_path

    bucket, url = bucket_checkpoint
    directory = storage_path(url)
    renamed = publishing._renamed

    def another_run_deletes_one(metadata, names):
        directory.store.delete([(directory / names["__1_0.distcp"]).key])
        return renamed(metadata, names)

    monkeypatch.setattr(publishing, "_renamed", another_run_deletes_one)
    with pytest.raises(DataError, match="written by this run, is gone"):
        compress_checkpoint(url)
    monkeypatch.setattr(publishing, "_renamed", renamed)
    assert json.loads(ok("verify", url, "--json"))["status"] == "ok"
    assert tensor_digests(load_with_dcpctl_reader(url)) == expected_tensors()


def test_an_in_place_run_never_replaces_a_metadata_another_job_wrote_meanwhile(
        bucket_checkpoint, s3_server, monkeypatch):
    """The listing just before the switch (are this run's objects still there?) took the
    other job's `.metadata` for the one first read, and the switch replaced it and deleted
    that job's data files as the old ones."""
    from dcpctl.errors import DcpctlError
    from dcpctl.format.checkpoint import publishing
    from dcpctl.ops.transcode import compress_checkpoint

    bucket, url = bucket_checkpoint
    client = s3_server.client()
    key = "run/step-100/.metadata"
    other_job = client.get_object(Bucket=bucket, Key=key)["Body"].read() + b"."
    renamed = publishing._renamed

    def another_job_saves(metadata, names):
        client.put_object(Bucket=bucket, Key=key, Body=other_job)
        return renamed(metadata, names)

    monkeypatch.setattr(publishing, "_renamed", another_job_saves)
    before = {entry["Key"] for entry in client.list_objects_v2(Bucket=bucket)["Contents"]}
    with pytest.raises(DcpctlError, match="changed while dcpctl read or replaced it"):
        compress_checkpoint(url)
    assert client.get_object(Bucket=bucket, Key=key)["Body"].read() == other_job
    after = {entry["Key"] for entry in client.list_objects_v2(Bucket=bucket)["Contents"]}
    assert after == before


def test_an_output_named_by_another_name_of_its_protocol_is_still_the_input(
        bucket_checkpoint, s3_server):
    """s3a:// opened a store of its own, and the guard took two stores for apart: `-o
    s3a://b/run --overwrite` deleted the whole run, the input with it."""
    bucket, url = bucket_checkpoint
    before = s3_server.client().list_objects_v2(Bucket=bucket)["KeyCount"]
    assert "holds the input" in failure("reshard", url, "--ranks", "2", "-o", f"s3a://{bucket}/run",
                                        "--overwrite")
    assert "lies inside the input" in failure("compress", url, "-o",
                                              f"s3a://{bucket}/run/step-100/z", "--overwrite")
    assert s3_server.client().list_objects_v2(Bucket=bucket)["KeyCount"] == before
    ok("compress", url, "-o", f"s3a://{bucket}/run/step-100")  # the input itself: in place
    assert tensor_digests(load_with_dcpctl_reader(url)) == expected_tensors()


def test_a_folder_marker_in_a_checkpoint_prefix_is_no_file(moto_s3, moto_checkpoint):
    """Consoles and some tools make `prefix/` objects to show folders (rclone, over a file
    system, cannot hold one): verify called the checkpoint damaged by an unknown file `sub/`."""
    bucket, url = moto_checkpoint
    prefix = url.removeprefix(f"s3://{bucket}/")
    for key in (f"{prefix}/", f"{prefix}/sub/"):
        moto_s3.client().put_object(Bucket=bucket, Key=key, Body=b"")
    assert json.loads(ok("verify", url, "--json"))["status"] == "ok"


def test_a_long_lived_process_reads_a_checkpoint_saved_again_since_anew(moto_s3,
                                                                        moto_checkpoint):
    """A service that verifies `latest/` each time it is saved again: each command reads the
    objects there when it starts, not those a command before it read."""
    from dcpctl.ops.verify.verifier import verify_checkpoint

    bucket, url = moto_checkpoint
    assert verify_checkpoint(url).status == "ok"
    prefix = url.removeprefix(f"s3://{bucket}/")
    upload_directory(moto_s3, fixture_path("zstd_fsdp2_2ranks"), bucket, prefix)
    moto_s3.client().delete_object(Bucket=bucket, Key=f"{prefix}/__2_0.distcp")
    report = verify_checkpoint(url)
    assert report.status == "ok", report.problems


def test_single_file_sources_in_a_bucket_convert_to_dcp_or_are_refused_in_a_line(
        moto_s3, moto_checkpoint, tmp_path):
    """A safetensors file in a bucket converts; a torch.save file there, which torch's loader
    reads from a local path only, is refused in a line (both were internal errors)."""
    import io

    from safetensors.torch import save

    bucket, _ = moto_checkpoint
    client = moto_s3.client()
    client.put_object(Bucket=bucket, Key="m.safetensors", Body=save({"w": torch.ones(3)}))
    stream = io.BytesIO()
    torch.save({"w": torch.ones(3)}, stream)
    client.put_object(Bucket=bucket, Key="m.pt", Body=stream.getvalue())
    ok("convert", f"s3://{bucket}/m.safetensors", "--to", "dcp", "-o", tmp_path / "dcp")
    assert torch.equal(load_with_torch(tmp_path / "dcp")["w"], torch.ones(3))
    assert "read from a local path only" in failure(
        "convert", f"s3://{bucket}/m.pt", "--to", "dcp", "-o", tmp_path / "other")


@pytest.mark.parametrize("command", [
    ["verify", "--json"], ["checksum"], ["reshard", "--ranks", "2", "-o", "{output}"],
    ["convert", "--to", "safetensors", "-o", "{output}"]])
def test_a_checkpoint_rewritten_in_place_while_read_is_said_so_not_called_damaged(
        moto_s3, moto_checkpoint, monkeypatch, run_cli, command):
    """A bucket has no locks: an in-place compress switched the checkpoint's `.metadata` and
    deleted the old data objects while another dcpctl read them. verify reported the sound
    checkpoint damaged (read-error), the others failed on a "missing" data file."""
    from dcpctl.storage import paths

    bucket, url = moto_checkpoint
    real_init, rewrites = paths.ObjectRangedFile.__init__, []
    first_open = threading.Lock()  # the command's threads open files at once: one rewrite

    def open_after_a_rewrite(self, path):
        with first_open:
            if not rewrites and path.key.endswith(".distcp"):
                rewrites.append(run_dcpctl("compress", url))
        real_init(self, path)

    monkeypatch.setattr(paths.ObjectRangedFile, "__init__", open_after_a_rewrite)
    output = f"s3://{bucket}/out"
    result = run_cli(command[0], url, *[part.format(output=output) for part in command[1:]])
    assert rewrites and rewrites[0].returncode == 0, rewrites
    assert result.exit_code == 75, result.output
    message = (f"{url}: was rewritten while dcpctl read it (its .metadata is not the one read: "
               "another dcpctl's in-place run, or a save of this step?); the checkpoint may well "
               "be sound: run the command again")
    assert result.stderr == f"Error: {message}\n"
    assert result.stdout == (json.dumps({"error": message, "exit_code": 75}) + "\n"
                             if "--json" in command else "")
    monkeypatch.setattr(paths.ObjectRangedFile, "__init__", real_init)
    assert json.loads(ok("verify", url, "--json"))["status"] == "ok"
    assert not keys_under(moto_s3, bucket, "out")


def test_a_server_that_never_answers_is_tried_as_often_as_the_retries_say(monkeypatch):
    """s3fs retries every call itself (5 times by default) around botocore's own attempts,
    and dcpctl's ranged reads retried around both again: against a server that stalled, a
    command went on for tens of minutes before it said anything."""
    import socket
    import threading

    listener = socket.create_server(("127.0.0.1", 0))
    requests = []

    def accept_and_stall():  # reads each request and never answers it
        while True:
            try:
                connection, _ = listener.accept()
            except OSError:
                return
            requests.append(connection)
            connection.recv(65536)

    threading.Thread(target=accept_and_stall, daemon=True).start()
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{listener.getsockname()[1]}")
    for name, value in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                        "AWS_DEFAULT_REGION": "us-east-1"}.items():
        monkeypatch.setenv(name, value)
    try:
        message = failure("--storage-option", 'config_kwargs={"read_timeout": 1, "retries": '
                          '{"max_attempts": 2, "mode": "standard"}}',
                          "verify", "s3://bucket/run/step-1")
    finally:
        listener.close()
        for connection in requests:
            connection.close()
    assert "the connection kept failing after retries" in message, message
    # the listing's 2 attempts, and one more that s3fs's listing makes of its own (15 before)
    assert len(requests) <= 3


def test_a_connection_refused_or_dropped_is_said_as_either(monkeypatch):
    """botocore raises one error for a connection refused and for one the server reset after
    taking the request: "cannot connect" alone misled where every other request went through."""
    import socket

    with socket.create_server(("127.0.0.1", 0)) as unused:
        port = unused.getsockname()[1]  # closed again: connections to it are refused
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{port}")
    for name, value in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                        "AWS_DEFAULT_REGION": "us-east-1"}.items():
        monkeypatch.setenv(name, value)
    message = failure("--storage-option", 'config_kwargs={"retries": {"max_attempts": 1}}',
                      "inspect", "s3://bucket/run/step-1")
    assert ("cannot connect to the S3 endpoint, or it kept dropping the connection: Could not "
            f"connect to the endpoint URL: \"http://127.0.0.1:{port}/bucket") in message, message


def test_prune_in_a_bucket_keeps_the_iteration_megatrons_tracker_names(s3_server):
    bucket = s3_server.new_bucket()
    for iteration in (1, 2, 3):
        upload_directory(s3_server, fixture_path(SOURCE), bucket, f"run/iter_{iteration:07d}")
    s3_server.client().put_object(Bucket=bucket, Key="run/latest_checkpointed_iteration.txt",
                                  Body=b"2" + b" " * 100 + b"\n")
    ok("prune", f"s3://{bucket}/run", "--keep-last", "1")
    assert {key.split("/")[1] for key in keys_under(s3_server, bucket, "run/iter_")} == {
        "iter_0000002", "iter_0000003"}


def test_a_megatron_checkpoint_in_a_bucket_without_its_common_pt_is_damaged(
        moto_s3, monkeypatch):
    for name, value in moto_s3.environment().items():
        monkeypatch.setenv(name, value)
    bucket = moto_s3.new_bucket()
    source = fixture_path("trainers/megatron_core_0.16.1_2ranks") / "iter_0000007"
    url = upload_directory(moto_s3, source, bucket, "run/iter_0000007")
    assert json.loads(ok("verify", url, "--quick", "--json"))["status"] == "ok"
    moto_s3.client().delete_object(Bucket=bucket, Key="run/iter_0000007/common.pt")
    result = run_dcpctl("verify", url, "--quick", "--json")
    assert result.returncode == 1
    assert [(problem["rule"], problem["file"]) for problem in json.loads(result.stdout)[
        "problems"]] == [("missing-file", "common.pt")]

"""The object store side of the storage interface, against real S3 servers on 127.0.0.1 (moto's
server mode and `rclone serve s3`): listings past one page, ranged reads, multipart writes,
conditional creates and replaces, reads held to the object first seen."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from dcpctl.storage.objects import ObjectChangedError, StorageError
from dcpctl.storage.paths import ObjectOutputFile, open_ranged, storage_path, write_whole
from dcpctl.storage.s3 import PART_BYTES


def test_a_listing_past_one_page_finds_every_object(s3_server):
    bucket = s3_server.new_bucket()
    client = s3_server.client()
    names = [f"many/obj-{index:05d}" for index in range(1005)]  # S3 pages hold 1,000 keys
    for name in names:
        client.put_object(Bucket=bucket, Key=name, Body=name.encode())
    directory = storage_path(f"s3://{bucket}/many")
    tree = directory.store.list_tree(directory.key)
    assert sorted(tree) == [name.partition("/")[2] for name in names]
    assert tree["obj-00007"].size == len("many/obj-00007")


def test_ranged_reads_give_the_bytes_asked_and_stop_at_the_end(s3_server):
    bucket = s3_server.new_bucket()
    data = os.urandom(3 << 20)
    s3_server.client().put_object(Bucket=bucket, Key="ranges/blob", Body=data)
    with open_ranged(storage_path(f"s3://{bucket}/ranges/blob")) as reader:
        assert reader.read(5, 100) == data[5:105]
        assert reader.read(len(data) - 10, 100) == data[-10:]
        assert reader.read(len(data) + 5, 10) == b""
        buffer = bytearray(1000)
        assert reader.readinto(buffer, 2000) == 1000 and buffer == data[2000:3000]


def test_reads_with_no_read_ahead_left_fetch_as_they_go(s3_server, monkeypatch):
    import dcpctl.storage.paths as paths
    monkeypatch.setattr(paths, "_READ_AHEAD_BUDGET", paths._Budget(0))
    bucket = s3_server.new_bucket()
    data = os.urandom((3 << 20) + 5)
    s3_server.client().put_object(Bucket=bucket, Key="ranges/blob", Body=data)
    with open_ranged(storage_path(f"s3://{bucket}/ranges/blob")) as reader:
        pieces = list(reader.iter_pieces(3, len(data) + 100, 1 << 20))
    assert [len(piece) for piece in pieces] == [1 << 20] * 3 + [2]
    assert b"".join(pieces) == data[3:]


def test_a_multipart_object_appears_whole_only_once_finished(s3_server):
    bucket = s3_server.new_bucket()
    path = storage_path(f"s3://{bucket}/out/big.distcp")
    data = os.urandom(2 * PART_BYTES + 12345)
    output = ObjectOutputFile(path)
    for start in range(0, len(data), 3 << 20):
        output.write(data[start:start + (3 << 20)])
    assert not path.parent.store.list_tree(path.parent.key)  # nothing visible before the end
    output.finish()
    assert s3_server.client().get_object(Bucket=bucket, Key="out/big.distcp")["Body"].read() \
        == data


def test_parts_grow_so_an_object_of_unknown_size_fits_s3s_part_limit(s3_server, monkeypatch):
    import dcpctl.storage.s3 as s3
    monkeypatch.setattr(s3, "PARTS_PER_SIZE_STEP", 2)
    bucket = s3_server.new_bucket()
    path = storage_path(f"s3://{bucket}/out/growing.distcp")
    data = os.urandom(6 * PART_BYTES + 7)
    output = ObjectOutputFile(path)
    for start in range(0, len(data), 1 << 20):
        output.write(data[start:start + (1 << 20)])
    output.finish()
    client = s3_server.client()
    assert client.get_object(Bucket=bucket, Key="out/growing.distcp")["Body"].read() == data
    if s3_server.name == "moto":  # rclone stores the object whole: it has no parts to tell
        part_sizes = [client.head_object(Bucket=bucket, Key="out/growing.distcp",
                                         PartNumber=number)["ContentLength"]
                      for number in range(1, 6)]
        assert part_sizes == [PART_BYTES, PART_BYTES, 2 * PART_BYTES, 2 * PART_BYTES, 7]


def test_a_discarded_multipart_object_leaves_nothing(s3_server):
    bucket = s3_server.new_bucket()
    path = storage_path(f"s3://{bucket}/out/abandoned.distcp")
    output = ObjectOutputFile(path)
    output.write(os.urandom(PART_BYTES + 1))
    output.discard()
    client = s3_server.client()
    assert client.list_objects_v2(Bucket=bucket).get("KeyCount", 0) == 0
    assert not client.list_multipart_uploads(Bucket=bucket).get("Uploads")


def test_a_conditional_create_never_replaces_an_object(s3_server):
    bucket = s3_server.new_bucket()
    s3_server.client().put_object(Bucket=bucket, Key="ck/.metadata", Body=b"first")
    path = storage_path(f"s3://{bucket}/ck/.metadata")
    with pytest.raises(FileExistsError):
        write_whole(path, b"second", only_if_absent=True)
    assert path.read_bytes() == b"first"


def test_a_replace_is_refused_when_someone_else_replaced_the_object_first(s3_server):
    bucket = s3_server.new_bucket()
    client = s3_server.client()
    client.put_object(Bucket=bucket, Key="ck/.metadata", Body=b"seen by dcpctl")
    path = storage_path(f"s3://{bucket}/ck/.metadata")
    path.store.list_tree(path.parent.key)  # what dcpctl saw
    client.put_object(Bucket=bucket, Key="ck/.metadata", Body=b"written by another job")
    with pytest.raises(ObjectChangedError):
        write_whole(path, b"dcpctl's", only_if_unchanged=True)
    assert client.get_object(Bucket=bucket, Key="ck/.metadata")["Body"].read() == \
        b"written by another job"


def test_a_replace_that_fails_puts_back_the_file_it_made_stale(s3_server, monkeypatch):
    """In-place switches write `.metadata` with made_stale=SHA256SUMS: the sums go just before
    the PUT (no reader sees new metadata with old sums), and come back when the PUT fails with
    `.metadata` still the one first seen; where someone else replaced it, they stay gone."""
    bucket = s3_server.new_bucket()
    client = s3_server.client()
    client.put_object(Bucket=bucket, Key="ck/.metadata", Body=b"seen by dcpctl")
    client.put_object(Bucket=bucket, Key="ck/SHA256SUMS", Body=b"sums of the old files")
    path = storage_path(f"s3://{bucket}/ck/.metadata")
    path.store.list_tree(path.parent.key)
    real_put = type(path.store).put

    def dropped_put(store, key, *args, **kwargs):
        if key == path.key:
            raise StorageError("connection dropped", path=store.url(key))
        return real_put(store, key, *args, **kwargs)

    with monkeypatch.context() as patch:
        patch.setattr(type(path.store), "put", dropped_put)
        with pytest.raises(StorageError, match="connection dropped"):
            write_whole(path, b"dcpctl's", made_stale=path.parent / "SHA256SUMS",
                        only_if_unchanged=True)
    assert client.get_object(Bucket=bucket, Key="ck/SHA256SUMS")["Body"].read() == \
        b"sums of the old files"
    client.put_object(Bucket=bucket, Key="ck/.metadata", Body=b"written by another job")
    with pytest.raises(ObjectChangedError):
        write_whole(path, b"dcpctl's", made_stale=path.parent / "SHA256SUMS",
                    only_if_unchanged=True)
    assert "Contents" not in client.list_objects_v2(Bucket=bucket, Prefix="ck/SHA256SUMS")


def test_reading_an_object_replaced_since_it_was_listed_fails(s3_server):
    bucket = s3_server.new_bucket()
    client = s3_server.client()
    client.put_object(Bucket=bucket, Key="ck/__0_0.distcp", Body=b"a" * 1000)
    directory = storage_path(f"s3://{bucket}/ck")
    directory.store.list_tree(directory.key)
    client.put_object(Bucket=bucket, Key="ck/__0_0.distcp", Body=b"b" * 1000)
    with open_ranged(directory / "__0_0.distcp") as reader:
        with pytest.raises(ObjectChangedError, match="changed while dcpctl read"):
            reader.read(0, 10)


@pytest.mark.parametrize("size", [100, PART_BYTES + 100], ids=["one PUT", "multipart"])
def test_a_new_output_object_never_replaces_one_that_came_meanwhile(s3_server, size):
    """An output's objects are created, never written over (as local output files are
    created exclusively): a run whose output another run took over wrote its remaining data
    objects over the other run's published ones."""
    from dcpctl.errors import OutputError

    bucket = s3_server.new_bucket()
    path = storage_path(f"s3://{bucket}/out/__1_0.distcp")
    output = ObjectOutputFile(path)
    output.write(os.urandom(size))
    s3_server.client().put_object(Bucket=bucket, Key="out/__1_0.distcp", Body=b"the other's")
    with pytest.raises(OutputError, match="another run wrote an object of this name"):
        output.finish()
    output.discard()
    assert path.read_bytes() == b"the other's"
    replacing = ObjectOutputFile(path, replacing=True)
    replacing.write(b"a file output, replaced whole")
    replacing.finish()
    assert path.read_bytes() == b"a file output, replaced whole"


def test_a_multipart_object_is_known_for_ones_own_by_its_etag_or_its_parts(s3_server):
    """After a completion whose reply was lost, the object there is this writer's where S3's
    ETag of an upload (the MD5 of the parts' MD5s, and their count) is that of its parts, or,
    where the store lists another ETag (rclone), where each part read back has its MD5."""
    bucket = s3_server.new_bucket()
    path = storage_path(f"s3://{bucket}/out/__0_0.distcp")
    data = os.urandom(PART_BYTES + 100)
    writer = path.store.open_writer(path.key, if_absent=True)
    writer.write(data)
    writer.finish()
    assert writer._made_as_written()
    other = bytearray(data)
    other[PART_BYTES + 50] ^= 1  # the same size, one bit of the last part another
    s3_server.client().put_object(Bucket=bucket, Key="out/__0_0.distcp", Body=bytes(other))
    assert not writer._made_as_written()


def test_an_upload_aborted_before_its_completion_is_said_so(rclone_s3, monkeypatch):
    """A multipart upload aborted meanwhile (a lifecycle rule, a run sweeping day-old
    uploads): finishing the object says that, naming it, and nothing has the name. (On
    rclone, which answers NoSuchUpload as S3 does; moto answers 500 InternalError.)"""
    for name, value in rclone_s3.environment().items():
        monkeypatch.setenv(name, value)
    bucket = rclone_s3.new_bucket()
    path = storage_path(f"s3://{bucket}/out/__0_0.distcp")
    writer = path.store.open_writer(path.key, if_absent=True)
    writer.write(os.urandom(PART_BYTES + 100))
    client = rclone_s3.client()
    complete = writer._complete

    def aborted_first() -> None:  # once every part is uploaded
        client.abort_multipart_upload(Bucket=bucket, Key="out/__0_0.distcp",
                                      UploadId=writer._upload_id)
        complete()

    writer._complete = aborted_first
    with pytest.raises(StorageError, match="no longer holds the upload of its parts") as raised:
        writer.finish()
    assert raised.value.path == f"s3://{bucket}/out/__0_0.distcp"
    assert "Contents" not in client.list_objects_v2(Bucket=bucket)


def _start_upload(client, bucket: str, key: str) -> str:
    upload = client.create_multipart_upload(Bucket=bucket, Key=key)["UploadId"]
    client.upload_part(Bucket=bucket, Key=key, UploadId=upload, PartNumber=1, Body=b"part")
    return upload


def _uploads(client, bucket: str) -> list[str]:
    return sorted(upload["Key"] for upload in
                  client.list_multipart_uploads(Bucket=bucket).get("Uploads") or ())


def test_uploads_a_killed_run_left_are_aborted_once_stale(moto_s3, monkeypatch, tmp_path):
    """A run killed mid-upload leaves its multipart uploads, whose parts S3 keeps and bills,
    out of every listing, until they are aborted: prune, --overwrite and the cleanup of an
    in-place run left them forever."""
    from conftest import fixture_path, upload_directory

    from dcpctl.ops.runs.prune import RetentionRules, prune_run_directory
    from dcpctl.storage import paths

    for name, value in moto_s3.environment().items():
        monkeypatch.setenv(name, value)
    client, bucket = moto_s3.client(), moto_s3.new_bucket()
    for step in (1, 2, 10):
        upload_directory(moto_s3, fixture_path("fsdp2_adamw_3ranks"), bucket, f"run/step-{step}")
    for key in ("run/step-1/__0_0.distcp", "run/step-10/__0_0.distcp.dcpctl-0123456789ab.tmp",
                "run/step-10/hf/model.safetensors", "run/step-100/__0_0.distcp"):
        _start_upload(client, bucket, key)
    # fresh: a live run's look the same, so they stay for a day
    assert paths.remove_stale_temporaries(storage_path(f"s3://{bucket}/run/step-10"), set()) \
        == []
    assert len(_uploads(client, bucket)) == 4
    monkeypatch.setattr(paths, "STALE_OBJECT_SECONDS", -60)
    # an in-place run's clean-up takes only uploads of dcpctl's temporary names
    assert paths.remove_stale_temporaries(storage_path(f"s3://{bucket}/run/step-10"), set()) \
        == ["__0_0.distcp.dcpctl-0123456789ab.tmp (an unfinished upload)"]
    prune_run_directory(f"s3://{bucket}/run", RetentionRules(keep_last=2))  # step-1 goes
    assert _uploads(client, bucket) == ["run/step-10/hf/model.safetensors",
                                        "run/step-100/__0_0.distcp"]  # under no pruned prefix


@pytest.mark.parametrize("is_directory", [True, False], ids=["checkpoint", "file"])
def test_an_upload_a_stopped_run_s_thread_still_holds_goes_with_the_output(
        moto_s3, monkeypatch, tmp_path, is_directory):
    """A stop waits at most pipeline.STOP_SECONDS for a thread stuck on a store that stopped
    answering: the upload that thread held was left, billed and out of every listing, and no
    rerun aborted it (under a day old, it may be a live run's)."""
    from dcpctl.storage.staging import staged_output

    for name, value in moto_s3.environment().items():
        monkeypatch.setenv(name, value)
    client, bucket = moto_s3.client(), moto_s3.new_bucket()
    other = ObjectOutputFile(storage_path(f"s3://{bucket}/elsewhere/model.pt"))
    other.write(os.urandom(PART_BYTES + 1))  # this process's too, but no part of the output
    staged = staged_output(storage_path(f"s3://{bucket}/out"), False, tmp_path, is_directory)
    held = ObjectOutputFile(staged.path / "__0_0.distcp" if is_directory else staged.path,
                            claim=staged.claim if is_directory else None)
    held.write(os.urandom(PART_BYTES + 1))  # started, then neither finished nor discarded
    assert len(_uploads(client, bucket)) == 2
    staged.abort()
    assert _uploads(client, bucket) == ["elsewhere/model.pt"]
    other.discard()


@pytest.mark.parametrize("split_path", ["as given", "trailing slash dropped"])
def test_the_clean_up_of_a_checkpoint_leaves_a_sibling_prefix_alone(moto_s3, monkeypatch,
                                                                    split_path):
    """With s3fs before 2026.2, whose split_path drops a trailing `/`, the clean-up of
    run/step-10 listed uploads under `run/step-10` and aborted run/step-100's, a sibling
    whose name starts the same: a live run's upload lost."""
    import s3fs

    from dcpctl.storage import paths

    if split_path == "trailing slash dropped":
        current = s3fs.S3FileSystem.split_path

        def dropping(self, path):
            bucket, key, version = current(self, path)
            return bucket, key.rstrip("/"), version
        monkeypatch.setattr(s3fs.S3FileSystem, "split_path", dropping)
    for name, value in moto_s3.environment().items():
        monkeypatch.setenv(name, value)
    client, bucket = moto_s3.client(), moto_s3.new_bucket()
    for key in ("run/step-10/__0_0.distcp.dcpctl-0123456789ab.tmp",
                "run/step-100/__0_0.distcp.dcpctl-0123456789ab.tmp"):
        _start_upload(client, bucket, key)
    monkeypatch.setattr(paths, "STALE_OBJECT_SECONDS", -60)
    assert paths.remove_stale_temporaries(storage_path(f"s3://{bucket}/run/step-10"), set()) \
        == ["__0_0.distcp.dcpctl-0123456789ab.tmp (an unfinished upload)"]
    assert _uploads(client, bucket) == ["run/step-100/__0_0.distcp.dcpctl-0123456789ab.tmp"]


def test_a_generic_store_output_object_never_replaces_one():
    import fsspec

    from dcpctl.errors import OutputError

    filesystem = fsspec.filesystem("memory")
    filesystem.pipe_file("/generic-out/__0_0.distcp", b"the other's")
    with pytest.raises(OutputError, match="another run wrote an object of this name"):
        ObjectOutputFile(storage_path("memory://generic-out/__0_0.distcp"))
    assert filesystem.cat_file("/generic-out/__0_0.distcp") == b"the other's"
    output = ObjectOutputFile(storage_path("memory://generic-out/__1_0.distcp"))
    output.write(b"new")
    output.finish()
    assert filesystem.cat_file("/generic-out/__1_0.distcp") == b"new"


def test_a_missing_bucket_is_one_clear_error(s3_server):
    with pytest.raises((FileNotFoundError, StorageError)) as raised:
        storage_path("s3://no-such-bucket-here/ck/.metadata").read_bytes()
    assert "s3://no-such-bucket-here/ck/.metadata" in str(raised.value)


def test_a_generic_fsspec_store_refuses_to_create_over_an_object():
    """memory://, through fsspec's generic calls, which have no conditional PUT: dcpctl looks
    just before it writes, and never replaces what it was to create."""
    import fsspec
    filesystem = fsspec.filesystem("memory")
    filesystem.pipe_file("/generic-ck/.metadata", b"first")
    with pytest.raises(FileExistsError):
        write_whole(storage_path("memory://generic-ck/.metadata"), b"new", only_if_absent=True)
    assert filesystem.cat_file("/generic-ck/.metadata") == b"first"


def test_local_urls_are_local_paths(tmp_path):
    """local://, fsspec's other name for file://, went to the generic store, whose URLs drop
    the leading `/`: an in-place compress of local://CK read CK and rewrote the checkpoint at
    the same path below the working directory, exit 0."""
    import shutil

    from conftest import fixture_path, run_dcpctl

    from dcpctl.format.checkpoint.view import open_checkpoint

    def contents(directory: Path) -> dict[str, bytes]:
        return {file.name: file.read_bytes() for file in directory.iterdir()}

    assert storage_path("local://ck") == storage_path("file://ck") == Path("ck")
    source = tmp_path / "ck"
    shutil.copytree(fixture_path("fsdp2_adamw_3ranks"), source)
    twin = tmp_path / str(source).lstrip("/")  # the same path, below the working directory
    shutil.copytree(fixture_path("fsdp2_adamw_3ranks"), twin)
    before = contents(twin)
    result = run_dcpctl("compress", f"local://{source}", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert contents(twin) == before
    assert {item.transform_descriptors for item in
            open_checkpoint(source).metadata.storage_data.values()} == {("stream.zstd/1",)}


def test_a_memory_store_checkpoint_is_rewritten_in_place():
    """memory:// has no buckets: a run named its checkpoint memory:///m/ck, then refused that
    name as one without a bucket, so compress and decompress in place always failed."""
    import torch
    import torch.distributed.checkpoint as dcp
    from click.testing import CliRunner

    from dcpctl.cli.main import cli

    dcp.save({"w": torch.ones(64, 64), "step": 1}, checkpoint_id="memory://m/ck", no_dist=True)
    assert storage_path("memory:///m/ck") == storage_path("memory://m/ck")
    for command in ("compress", "decompress"):
        result = CliRunner().invoke(cli, [command, "memory://m/ck"], obj={})
        assert result.exit_code == 0, result.output
    state = {"w": torch.zeros(64, 64), "step": 0}
    dcp.load(state, checkpoint_id="memory://m/ck", no_dist=True)
    assert torch.equal(state["w"], torch.ones(64, 64)) and state["step"] == 1


@pytest.mark.parametrize("url", ["s3://", "s3:///run", "s3:////run/step-1"])
def test_a_url_that_names_no_bucket_is_refused(url):
    from dcpctl.errors import InvalidOptionError
    from dcpctl.storage.paths import storage_path

    with pytest.raises(InvalidOptionError, match="names no bucket: give s3://BUCKET/PREFIX"):
        storage_path(url)


def test_errors_show_no_secret_of_the_storage_options(monkeypatch):
    """A file system's error quoting its options (webdav4: `Invalid "auth" argument: ['u',
    'TopSecret-123']`) printed the password in dcpctl's one line."""
    import json

    from dcpctl.storage.stores import STORAGE_OPTIONS_ENVIRONMENT, without_secrets

    monkeypatch.setenv(STORAGE_OPTIONS_ENVIRONMENT, json.dumps({
        "auth": ["u", "TopSecret-123"], "endpoint_url": "http://127.0.0.1:9",
        "client_kwargs": {"aws_secret_access_key": "s3-secret"}, "profile": "training"}))
    monkeypatch.setenv("AWS_SESSION_TOKEN", "session-token")
    assert without_secrets(
        "Invalid auth ['u', 'TopSecret-123'] s3-secret session-token at http://127.0.0.1:9 "
        "(profile training)") == (
        "Invalid auth ['u', '***'] *** *** at http://127.0.0.1:9 (profile training)")
    monkeypatch.setenv(STORAGE_OPTIONS_ENVIRONMENT, json.dumps({
        "auth": ["u", "Top\\Secret'\""],  # quoted back by repr(), its backslash doubled
        "token": {"project_id": "acme-ml", "private_key": "-----BEGIN KEY-----"}}))
    assert without_secrets(repr(["u", "Top\\Secret'\""]) + " gs://acme-ml/run: -----BEGIN KEY-----"
                           ) == "['u', '***'] gs://acme-ml/run: ***"
    assert without_secrets("at s3://AKIA:hunter2@bucket/run") == "at s3://***@bucket/run"
    # adlfs's connection string holds the account key, from an option or the environment
    connection = "AccountName=acct;AccountKey=azure-key=="
    monkeypatch.setenv(STORAGE_OPTIONS_ENVIRONMENT, json.dumps({"connection_string": connection}))
    monkeypatch.setenv("AZURE_STORAGE_ACCOUNT_KEY", "env-azure-key")
    monkeypatch.setenv("AZURE_CLIENT_SECRET", "client-secret")
    assert without_secrets(f"bad {connection} or env-azure-key, key azure-key==, "
                           "client-secret; account acct") == (
        "bad *** or ***, key ***, ***; account acct")
    monkeypatch.setenv(STORAGE_OPTIONS_ENVIRONMENT, "not json")
    assert without_secrets("text") == "text"
    # a one-letter dummy secret hid every letter like it: `list-t***pe=2`
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "y")
    assert without_secrets("http://127.0.0.1:1/b?list-type=2") == (
        "http://127.0.0.1:1/b?list-type=2")


@pytest.mark.parametrize("url", ["ftp://u:TopSecret@127.0.0.1:21211/run/ck",
                                 "sftp://u@127.0.0.1/run/ck", "ftp://127.0.0.1/run/ck",
                                 "s3://AKIA:TopSecret@bucket/run/ck",
                                 "ftp://u:TopSecret@127.0.0.1/a/../ck",
                                 "ftp://127.0.0.1:99999/ck"])
def test_a_url_naming_a_host_is_refused_with_no_password_shown(url):
    """dcpctl's stores are one per protocol, made from the storage options: the host, user and
    password of an ftp:// URL went nowhere (an internal error, `missing 'host'`), and a URL
    naming another host went to the one in the options."""
    from conftest import run_dcpctl

    result = run_dcpctl("inspect", url)
    assert result.returncode == 2, result.stderr
    assert result.stderr.count("\n") == 1 and "TopSecret" not in result.stderr, result.stderr
    assert "Traceback" not in result.stderr
    assert ("in the URL, which dcpctl does not take from URLs" in result.stderr
            or "a URL here holds no user or password" in result.stderr), result.stderr


def test_a_writer_waiting_for_an_upload_slot_holds_no_copy_of_its_part(moto_s3, monkeypatch):
    """Each writer copied its next part out before it waited for one of the PARTS_IN_FLIGHT
    slots, so with more threads writing than slots, every waiting thread held a part of 8 MiB
    more: memory in a bucket grew with --threads (0.55 GB at 8 threads)."""
    import threading

    from dcpctl.storage import s3

    for name, value in moto_s3.environment().items():
        monkeypatch.setenv(name, value)
    slots = threading.BoundedSemaphore(1)
    monkeypatch.setattr(s3, "_PART_SLOTS", slots)
    path = storage_path(f"s3://{moto_s3.new_bucket()}/out/__0_0.distcp")
    writer = path.store.open_writer(path.key, if_absent=True)
    copies = []
    real_bytes = bytes
    monkeypatch.setattr(s3, "bytes", lambda data: copies.append(len(data)) or real_bytes(data),
                        raising=False)
    slots.acquire()  # every slot taken, by other writers
    waiting = threading.Thread(target=writer.write, args=(os.urandom(PART_BYTES + 10),),
                               daemon=True)
    waiting.start()
    try:
        waiting.join(timeout=2)
        was_waiting, copied_while_waiting = waiting.is_alive(), list(copies)
    finally:
        slots.release()
        waiting.join(timeout=30)
    assert was_waiting and copied_while_waiting == []  # waits holding no copy of its part
    assert copies == [PART_BYTES]
    writer.finish()
    assert path.store.info_now(path.key).size == PART_BYTES + 10


def test_a_worker_hands_back_only_the_etags_its_share_was_given():
    """Handing back every ETag the worker ever got would put back, in its coordinator, the
    ETag of an object the coordinator has written over since, as if its own write were
    another run's."""
    from dcpctl.storage.stores import adopt_etags_written, etags_written, store_for

    store = store_for("memory")
    store.note_written("/share-test/a", "etag-1")
    earlier = etags_written()
    store.note_written("/share-test/a", "etag-1")  # written again, the same
    store.note_written("/share-test/b", "etag-2")
    assert etags_written(since=earlier)["memory"] == {"/share-test/b": "etag-2"}
    store.note_written("/share-test/a", "etag-3")
    handed_back = etags_written(since=earlier)
    assert handed_back["memory"] == {"/share-test/a": "etag-3", "/share-test/b": "etag-2"}
    store.note_written("/share-test/a", "etag-4")  # as the coordinator, over the worker's
    adopt_etags_written({"memory": {"/share-test/b": "etag-5"}})
    assert (store.etag_written("/share-test/a"), store.etag_written("/share-test/b")) == (
        "etag-4", "etag-5")


@pytest.mark.parametrize("name, key", [("x", "b/run/x"), ("a/b", "b/run/a/b"),
                                       ("/b/precious", "b/run//b/precious"), ("", "b/run")])
def test_a_name_below_a_prefix_is_a_key_below_it_even_one_listed_with_a_slash(name, key):
    """A key holding `//` is listed by the name after the prefix, which starts with `/`:
    joined as a path, it named a key at the root of the store, or in another bucket."""
    from dcpctl.storage.objects import ObjectPath

    directory = ObjectPath(storage_path("memory://unused").store, "b/run")
    assert (directory / name).key == key


def test_a_urls_scheme_is_read_in_any_case():
    """`S3://b/x` went to the S3 store with the key `S3://b/x`, and failed on a bucket named
    `S3:`."""
    assert storage_path("S3://b/x") == storage_path("s3://b/x")
    assert storage_path("S3://b/x").key == "b/x"
    assert storage_path("FILE:///tmp/ck") == Path("/tmp/ck")


def test_a_store_client_failing_in_its_own_way_is_named_with_the_url():
    """An fsspec store whose client raises errors of its own library (httpx's ConnectError
    under hf://) failed as `internal error: ConnectError`, naming no URL."""
    import fsspec
    from fsspec.spec import AbstractFileSystem

    from dcpctl.format.checkpoint.view import open_checkpoint

    class ConnectError(Exception):  # as a client library defines its own
        pass

    ConnectError.__module__ = "httpx"

    class Unreachable(AbstractFileSystem):
        protocol = "unreachable"

        def find(self, *args, **kwargs):
            raise ConnectError("[Errno 111] Connection refused")

    fsspec.register_implementation("unreachable", Unreachable, clobber=True)
    with pytest.raises(StorageError) as raised:
        open_checkpoint("unreachable://bucket/run/step-1")
    assert str(raised.value) == ("unreachable://bucket/run/step-1: ConnectError: [Errno 111] "
                                 "Connection refused")


@pytest.mark.parametrize("deleted", [True, False])
def test_a_deletion_whose_answer_was_lost_failed_only_if_the_object_is_still_there(
        moto_s3, monkeypatch, deleted):
    """The store deleted the objects and its answer was lost (a connection reset, every retry
    too): a failed run's output giving up its claim stopped there, and left its objects under
    a prefix that a plain rerun then refused as not empty."""
    from dcpctl.storage.s3 import S3Store

    for name, value in moto_s3.environment().items():
        monkeypatch.setenv(name, value)
    bucket = moto_s3.new_bucket()
    directory = storage_path(f"s3://{bucket}/out")
    for name in ("a", "b"):
        directory.store.put((directory / name).key, b"data")
    real = S3Store._delete_objects

    def answer_lost(store, *args):
        if deleted:
            real(store, *args)
        raise StorageError("cannot connect to the S3 endpoint (connection reset)",
                           path=str(directory))

    monkeypatch.setattr(S3Store, "_delete_objects", answer_lost)
    keys = [(directory / name).key for name in ("a", "b")]
    if deleted:
        directory.store.delete(keys)
    else:
        with pytest.raises(StorageError, match="connection reset"):
            directory.store.delete(keys)
    assert sorted(directory.store.list_tree(directory.key)) == ([] if deleted else ["a", "b"])


@pytest.mark.parametrize("cut_short", [1, 3])
def test_a_read_cut_short_is_made_again_three_times_at_most(moto_s3, monkeypatch, cut_short):
    """botocore retries a request until its answer begins; an answer cut short after that is
    asked for again here (3 GETs in all), and nothing more: retries around retries made a
    store that stalled keep a command waiting for tens of minutes."""
    import aiohttp

    for name, value in moto_s3.environment().items():
        monkeypatch.setenv(name, value)
    directory = storage_path(f"s3://{moto_s3.new_bucket()}/out")
    key = (directory / "data").key
    directory.store.put(key, bytes(range(256)) * 4)
    real_call, gets = directory.store.fs._call_s3, []

    class CutShort:
        def __init__(self, body):
            self.body = body

        async def read(self):
            raise aiohttp.ClientPayloadError("Response payload is not completed")

        def close(self):
            self.body.close()

    async def call(method, *args, **kwargs):
        response = await real_call(method, *args, **kwargs)
        if method == "get_object":
            gets.append(kwargs["Range"])
            if len(gets) <= cut_short:
                response["Body"] = CutShort(response["Body"])
        return response

    monkeypatch.setattr(directory.store.fs, "_call_s3", call)
    if cut_short < 3:
        assert directory.store.read_range(key, 10, 20) == bytes(range(10, 20))
        assert gets == ["bytes=10-19"] * (cut_short + 1)
    else:
        with pytest.raises(StorageError, match="the connection kept failing after retries"):
            directory.store.read_range(key, 10, 20)
        assert gets == ["bytes=10-19"] * 3

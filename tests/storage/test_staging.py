"""Outputs written under a temporary sibling and renamed into place."""

from __future__ import annotations

from pathlib import Path

import pytest

from dcpctl.errors import OutputError
from dcpctl.storage.staging import StagedOutput

SOURCE = Path("/nonexistent/source")


def test_a_directory_appears_only_when_published(tmp_path):
    staged = StagedOutput(tmp_path / "out", overwrite=False, source=SOURCE)
    (staged.path / "data").write_text("new")
    assert not (tmp_path / "out").exists()
    staged.publish()
    assert (tmp_path / "out" / "data").read_text() == "new"
    assert [p.name for p in tmp_path.iterdir()] == ["out"]


def test_an_existing_directory_is_replaced_only_with_overwrite(tmp_path):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "old").write_text("old")
    with pytest.raises(OutputError, match="not empty.*--overwrite"):
        StagedOutput(tmp_path / "out", overwrite=False, source=SOURCE)
    staged = StagedOutput(tmp_path / "out", overwrite=True, source=SOURCE)
    (staged.path / "new").write_text("new")
    staged.publish()
    assert [p.name for p in (tmp_path / "out").iterdir()] == ["new"]
    assert [p.name for p in tmp_path.iterdir()] == ["out"]


def test_a_file_output(tmp_path):
    target = tmp_path / "model.pt"
    staged = StagedOutput(target, overwrite=False, source=SOURCE, is_directory=False)
    staged.path.write_bytes(b"one")
    staged.publish()
    with pytest.raises(OutputError, match="exists.*--overwrite"):
        StagedOutput(target, overwrite=False, source=SOURCE, is_directory=False)
    staged = StagedOutput(target, overwrite=True, source=SOURCE, is_directory=False)
    staged.path.write_bytes(b"two")
    staged.abort()
    assert target.read_bytes() == b"one"
    assert [p.name for p in tmp_path.iterdir()] == ["model.pt"]
    with pytest.raises(OutputError, match="is a directory"):
        StagedOutput(tmp_path, overwrite=True, source=SOURCE, is_directory=False)


def test_an_empty_directory_filled_while_the_output_was_written_is_not_replaced(tmp_path):
    """Without --overwrite an empty directory is taken; what someone put there while the run
    went on (or a second run published there first) is never deleted."""
    (tmp_path / "out").mkdir()
    staged = StagedOutput(tmp_path / "out", overwrite=False, source=SOURCE)
    (staged.path / "data").write_text("new")
    (tmp_path / "out" / "important.txt").write_text("theirs")
    with pytest.raises(OutputError, match="was filled while dcpctl wrote the output.*"
                                          "--overwrite") as refused:
        staged.publish()
    assert refused.value.exit_code == 75  # another run's, likely: try again (with --overwrite)
    staged.abort()
    assert [p.name for p in (tmp_path / "out").iterdir()] == ["important.txt"]
    assert [p.name for p in tmp_path.iterdir()] == ["out"]
    # empty still at the end: taken
    staged = StagedOutput(tmp_path / "empty", overwrite=False, source=SOURCE)
    (tmp_path / "empty").mkdir()
    (staged.path / "data").write_text("new")
    staged.publish()
    assert [p.name for p in (tmp_path / "empty").iterdir()] == ["data"]


def test_a_file_written_where_the_output_goes_while_it_was_written_is_not_replaced(tmp_path):
    target = tmp_path / "model.pt"
    staged = StagedOutput(target, overwrite=False, source=SOURCE, is_directory=False)
    staged.path.write_bytes(b"mine")
    target.write_bytes(b"theirs")
    with pytest.raises(OutputError, match="was filled while") as refused:
        staged.publish()
    assert refused.value.exit_code == 75
    staged.abort()
    assert target.read_bytes() == b"theirs"
    assert [p.name for p in tmp_path.iterdir()] == ["model.pt"]


def test_abort_removes_the_unfinished_directory(tmp_path):
    staged = StagedOutput(tmp_path / "out", overwrite=False, source=SOURCE)
    (staged.path / "half").write_text("x")
    staged.abort()
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("is_directory", [True, False])
def test_abort_removes_the_directories_made_for_the_output_that_nothing_else_took(
        tmp_path, is_directory):
    (tmp_path / "kept").mkdir()
    staged = StagedOutput(tmp_path / "kept" / "new" / "deeper" / "out", overwrite=False,
                          source=SOURCE, is_directory=is_directory)
    (tmp_path / "kept" / "new" / "someone-elses").write_text("x")
    staged.abort()
    left = sorted(path.name for path in (tmp_path / "kept").rglob("*"))
    assert left == ["new", "someone-elses"]


@pytest.mark.parametrize("where", ["source", "source/..", "source/inner", "source/link/.."])
def test_an_output_that_is_holds_or_lies_inside_the_input_is_refused(tmp_path, where):
    source = tmp_path / "run" / "source"
    source.mkdir(parents=True)
    (source / "data").write_text("keep")
    (source / "link").symlink_to(source)
    destination = tmp_path / "run" / where
    with pytest.raises(OutputError, match="the input"):
        StagedOutput(destination, overwrite=True, source=source)
    assert (source / "data").read_text() == "keep"
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["source"]


def _staging_in_a_process(destination: Path, is_directory: bool):
    """A process that stages an output for destination and waits; its staging path."""
    import subprocess
    import sys

    code = ("import sys, time; from pathlib import Path; "
            "from dcpctl.storage.staging import StagedOutput; "
            f"staged = StagedOutput(Path({str(destination)!r}), False, Path('/nonexistent'), "
            f"is_directory={is_directory}); "
            "(staged.path / 'half' if staged.is_directory else staged.path).write_bytes(b'x'); "
            "print(staged.path, flush=True); time.sleep(600)")
    process = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    return process, Path(process.stdout.readline().strip())


@pytest.mark.parametrize("is_directory", [True, False])
def test_a_killed_runs_staging_goes_with_the_next_run_and_a_live_ones_stays(tmp_path,
                                                                            is_directory):
    destination = tmp_path / ("out" if is_directory else "model.pt")
    live, live_path = _staging_in_a_process(destination, is_directory)
    killed, killed_path = _staging_in_a_process(destination, is_directory)
    try:
        killed.kill()
        killed.wait()
        assert killed_path.exists() and live_path.exists()
        staged = StagedOutput(destination, overwrite=False, source=SOURCE,
                              is_directory=is_directory)
        assert staged.removed_stagings == [killed_path.parent.name if not is_directory
                                           else killed_path.name]
        assert not killed_path.exists() and live_path.exists()
        staged.abort()
    finally:
        live.kill()
        live.wait()


def test_only_this_outputs_unlocked_staging_directories_are_removed(tmp_path):
    (tmp_path / ".out.dcpctl-0123456789ab.tmp").mkdir()  # a dead run's: goes
    scratch = tmp_path / "..out.dcpctl-0123456789ab.tmp.dcpctl-scratch-k2j4"  # and its scratch
    scratch.mkdir()
    (scratch / "spooled").write_bytes(b"payload")
    kept = [".other.dcpctl-0123456789ab.tmp", ".out.old.dcpctl-0123456789ab.tmp", "notes",
            "..out.dcpctl-aaaaaaaaaaaa.tmp.dcpctl-scratch-x"]  # a scratch of no dead staging
    for name in kept:
        (tmp_path / name).mkdir()
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "precious").write_text("x")
    (tmp_path / ".out.dcpctl-ba9876543210.tmp").symlink_to(outside)
    kept += [".out.dcpctl-ba9876543210.tmp", "outside"]
    staged = StagedOutput(tmp_path / "out", overwrite=False, source=SOURCE)
    assert staged.removed_stagings == [".out.dcpctl-0123456789ab.tmp", scratch.name]
    staged.abort()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(kept)
    assert (outside / "precious").read_text() == "x"


def test_a_staging_published_as_it_is_looked_at_is_never_emptied(tmp_path, monkeypatch):
    """A run starting for the same output opened a live run's staging directory, which that
    run then renamed into place and let go of: locked next, the published output (whose run
    had exited 0) was emptied."""
    import fcntl
    import os

    from dcpctl.storage import staging

    live_staging = tmp_path / ".out.dcpctl-0123456789ab.tmp"
    live_staging.mkdir()
    (live_staging / ".metadata").write_bytes(b"published")
    held = os.open(live_staging, os.O_RDONLY | os.O_DIRECTORY)
    fcntl.flock(held, fcntl.LOCK_EX)  # the live run's lock
    opened = staging.open_directory_at

    def published_meanwhile(parent, name):
        descriptor = opened(parent, name)
        live_staging.rename(tmp_path / "out")  # the live run publishes, then lets go
        os.close(held)
        return descriptor

    monkeypatch.setattr(staging, "open_directory_at", published_meanwhile)
    assert staging.remove_dead_stagings(tmp_path / "out") == []
    assert (tmp_path / "out" / ".metadata").read_bytes() == b"published"


@pytest.mark.parametrize("given", [".", "new/sub/.."])
def test_an_output_named_by_dot_or_dotdot_is_the_directory_it_means(tmp_path, monkeypatch, given):
    """`-o .` failed at publish, after all the work (rename of "." is EBUSY), and
    `-o new/sub/..` left new/sub behind."""
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    means = work if given == "." else work / "new"
    staged = StagedOutput(Path(given), overwrite=False, source=SOURCE)
    (staged.path / "data").write_text("new")
    staged.publish()
    assert (means / "data").read_text() == "new"
    assert not (work / "new" / "sub").exists()


def _object_output(s3_server, overwrite=False):
    from dcpctl.storage.paths import storage_path
    from dcpctl.storage.staging import staged_output

    bucket = s3_server.new_bucket()
    destination = storage_path(f"s3://{bucket}/out")
    return staged_output(destination, overwrite, SOURCE), destination


def _put(destination, name: str, data: bytes) -> None:
    destination.store.put((destination / name).key, data)


def _keys(destination) -> list[str]:
    return sorted(destination.store.list_tree(destination.key))


def test_a_second_run_into_an_object_store_output_is_refused_not_let_write_over_it(s3_server):
    """Two runs wrote one S3 output prefix: the first published, the second wrote over its
    data objects, failed on its `.metadata`, and its abort deleted everything under the
    prefix, the first run's published checkpoint with it."""
    first, destination = _object_output(s3_server)
    assert _keys(destination) == [".metadata.tmp"]  # the claim, as a save in progress holds
    from dcpctl.storage.staging import ObjectStoreOutput

    with pytest.raises(OutputError, match="another run is writing this output"):
        ObjectStoreOutput(destination, False, SOURCE)
    _put(destination, "__0_0.distcp", b"data")
    first.confirm(["__0_0.distcp"])
    _put(destination, ".metadata", b"metadata")
    first.publish()
    assert _keys(destination) == [".metadata", "__0_0.distcp"]
    with pytest.raises(OutputError, match="exists and is not empty"):
        ObjectStoreOutput(destination, False, SOURCE)
    assert _keys(destination) == [".metadata", "__0_0.distcp"]


def test_an_object_store_output_taken_over_is_not_published_nor_deleted(s3_server):
    """A run with --overwrite replaced the output while this one wrote it: this one neither
    publishes nor deletes what the other wrote."""
    first, destination = _object_output(s3_server)
    _put(destination, "__0_0.distcp", b"first")
    from dcpctl.storage.staging import ObjectStoreOutput

    second = ObjectStoreOutput(destination, True, SOURCE)
    _put(destination, "__0_0.distcp", b"second")
    with pytest.raises(OutputError, match="another run took this output over"):
        first.confirm(["__0_0.distcp"])
    first.abort()
    assert (destination / "__0_0.distcp").read_bytes() == b"second"
    second.abort()
    assert _keys(destination) == []


def _writes_after_the_claim(monkeypatch, destination, name: str, data: bytes) -> None:
    """Have another run's object land under destination just after the next claim is made,
    as the upload a run taken over still had in flight does."""
    store = destination.store
    real_put = store.put

    def put(key, *args, **kwargs):
        real_put(key, *args, **kwargs)
        if key.endswith("/.metadata.tmp"):
            monkeypatch.setattr(store, "put", real_put)
            real_put((destination / name).key, data)

    monkeypatch.setattr(store, "put", put)


def test_a_run_with_overwrite_takes_over_an_output_whose_writer_still_writes(
        s3_server, monkeypatch):
    """Two runs with --overwrite into one prefix: the second cleared the first's objects and
    claimed the output; an object the first still wrote then made the second give up ("the
    output is not empty: pass --overwrite"), and the first failed on its lost claim: both
    exited 1 and the output held the first's strays. Now the second takes the output over,
    the first stops at its next file, and the second's confirm deletes the strays."""
    from dcpctl.storage.staging import ObjectStoreOutput

    first, destination = _object_output(s3_server, overwrite=True)
    _put(destination, "__0_0.distcp", b"first")
    _writes_after_the_claim(monkeypatch, destination, "__1_0.distcp", b"first, late")
    second = ObjectStoreOutput(destination, True, SOURCE)
    with pytest.raises(OutputError, match="another run took this output over"):
        first.claim.check()
    _put(destination, "__0_0.distcp", b"second")
    second.confirm(["__0_0.distcp"], {"__0_0.distcp": 6})
    _put(destination, ".metadata", b"metadata")
    second.publish()
    first.abort()
    assert _keys(destination) == [".metadata", "__0_0.distcp"]
    assert (destination / "__0_0.distcp").read_bytes() == b"second"


def test_without_overwrite_an_object_that_lands_as_the_output_is_claimed_is_refused(
        s3_server, monkeypatch):
    from dcpctl.storage.paths import storage_path
    from dcpctl.storage.staging import ObjectStoreOutput

    destination = storage_path(f"s3://{s3_server.new_bucket()}/out")
    _writes_after_the_claim(monkeypatch, destination, "__0_0.distcp", b"another's")
    with pytest.raises(OutputError, match="another run wrote here meanwhile"):
        ObjectStoreOutput(destination, False, SOURCE)
    assert _keys(destination) == ["__0_0.distcp"]


def test_a_run_with_overwrite_beaten_to_the_claim_is_not_told_to_pass_overwrite(
        s3_server, monkeypatch):
    """The other run claimed the output between this one clearing it and claiming it."""
    from dcpctl.storage.paths import storage_path
    from dcpctl.storage.staging import ObjectStoreOutput

    destination = storage_path(f"s3://{s3_server.new_bucket()}/out")
    _put(destination, "__0_0.distcp", b"old")
    store, real_put = destination.store, destination.store.put

    def put(key, *args, **kwargs):
        monkeypatch.setattr(store, "put", real_put)
        real_put(key, b"dcpctl another run\n")
        real_put(key, *args, **kwargs)

    monkeypatch.setattr(store, "put", put)
    with pytest.raises(OutputError, match="another run is writing this output") as refused:
        ObjectStoreOutput(destination, True, SOURCE)
    assert "--overwrite" not in str(refused.value) and "run again" in str(refused.value)
    assert _keys(destination) == [".metadata.tmp"]


def test_an_aborted_object_store_output_aborts_the_uploads_of_its_files(moto_s3, monkeypatch):
    """A worker or rank killed mid-write leaves its multipart upload open, which S3 keeps and
    bills, out of every listing. The run's abort aborts those of its own files under its
    prefix at once, and no other. (The day-old clean-up would not yet on S3; moto dates every
    upload in 2010, so here no upload is taken for a day old.)"""
    from dcpctl.storage import paths

    for name, value in moto_s3.environment().items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(paths, "STALE_OBJECT_SECONDS", 1e12)
    output, destination = _object_output(moto_s3)
    client = moto_s3.client()
    bucket, _, prefix = destination.key.partition("/")
    for name in ("__0_0.distcp", "elsewhere.bin"):
        client.create_multipart_upload(Bucket=bucket, Key=f"{prefix}/{name}")
    output.abort(upload_names=["__0_0.distcp", ".metadata"])
    assert [upload["Key"] for upload in client.list_multipart_uploads(Bucket=bucket)["Uploads"]
            ] == [f"{prefix}/elsewhere.bin"]
    assert _keys(destination) == []


def test_a_data_file_set_starts_no_file_once_its_output_was_taken_over(s3_server):
    """Workers and torchrun ranks write an output's data files through DataFileSets (pickled
    to them): a run taken over went on writing files after its claim was gone."""
    import pickle

    from dcpctl.format.checkpoint.publishing import DataFileSet
    from dcpctl.storage.staging import ObjectStoreOutput

    first, destination = _object_output(s3_server)
    files = pickle.loads(pickle.dumps(DataFileSet(destination, None, first.claim)))
    files.data_file("__0_0.distcp").write(b"first")
    files.finish_data_file("__0_0.distcp")
    ObjectStoreOutput(destination, True, SOURCE)
    with pytest.raises(OutputError, match="another run took this output over"):
        files.data_file("__1_0.distcp")
    assert _keys(destination) == [".metadata.tmp"]


@pytest.mark.parametrize("lands", ["before the confirm", "before the last file"])
def test_a_file_a_run_taken_over_had_on_its_way_is_not_left_in_the_others_output(
        s3_server, lands):
    """Run A had a data file on its way when run B, with --overwrite, took the output over:
    A completed it among B's files (a stray B's `.metadata` does not name), and went on. Now
    A never completes it, and an object that lands all the same (the takeover came between
    A's check and its completion) is deleted by B, before or just after its `.metadata`."""
    from dcpctl.format.checkpoint.publishing import DataFileSet
    from dcpctl.storage.staging import ObjectStoreOutput

    first, destination = _object_output(s3_server)
    files = DataFileSet(destination, None, first.claim)
    files.data_file("__3_0.distcp").write(b"first")  # on its way
    second = ObjectStoreOutput(destination, True, SOURCE)
    _put(destination, "__0_0.distcp", b"second")
    with pytest.raises(OutputError, match="another run took this output over") as taken:
        files.finish_data_file("__3_0.distcp")
    assert taken.value.exit_code == 75
    files.discard()
    if lands == "before the confirm":
        _put(destination, "__5_0.distcp", b"first, late")
    second.confirm(["__0_0.distcp"], {"__0_0.distcp": 6})
    if lands == "before the last file":
        _put(destination, "__5_0.distcp", b"first, late")
    _put(destination, ".metadata", b"metadata")
    second.confirm_published(["__0_0.distcp"], {"__0_0.distcp": 6}, ".metadata", b"metadata")
    second.publish()
    first.abort()
    assert _keys(destination) == [".metadata", "__0_0.distcp"]


@pytest.mark.parametrize("size", [6, 8 << 20 | 1], ids=["one PUT", "multipart"])
def test_a_run_that_took_an_output_over_completes_a_file_the_run_taken_over_named_first(
        s3_server, size):
    """Run A's upload of a data file was on its way when run B, with --overwrite, cleared the
    output and claimed it; A's upload completed just after the clear, under a name B then
    wrote. B's write was refused ("another run wrote an object of this name"), A stopped on
    its lost claim, and both failed, leaving nothing. Now B, still holding its claim, deletes
    A's object and completes its own."""
    from dcpctl.format.checkpoint.publishing import DataFileSet
    from dcpctl.storage.staging import ObjectStoreOutput

    first, destination = _object_output(s3_server)
    second = ObjectStoreOutput(destination, True, SOURCE)
    files = DataFileSet(destination, None, second.claim)
    files.data_file("__0_0.distcp").write(b"s" * size)
    _put(destination, "__0_0.distcp", b"first, late")  # A's upload, completed after the clear
    files.finish_data_file("__0_0.distcp")
    second.confirm(["__0_0.distcp"], {"__0_0.distcp": size})
    _put(destination, ".metadata", b"metadata")
    second.publish()
    first.abort()
    assert _keys(destination) == [".metadata", "__0_0.distcp"]
    assert (destination / "__0_0.distcp").read_bytes() == b"s" * size


def test_a_run_taken_over_as_it_clears_a_name_deletes_nothing(s3_server, monkeypatch):
    """Run B, holding its claim, found an object of run A's under a name it writes, and a third
    run C took the output over as B went to delete it: B checked its claim before it looked at
    the object, and deleted the object C then wrote under that name. Now the claim is checked
    after the object is seen (one request before the delete), and B deletes nothing."""
    from dcpctl.storage.staging import ObjectStoreOutput

    second, destination = _object_output(s3_server, overwrite=True)
    _put(destination, "__0_0.distcp", b"the first run's, late")
    store, real_info_now = destination.store, destination.store.info_now

    def info_now(key):
        info = real_info_now(key)
        monkeypatch.setattr(store, "info_now", real_info_now)
        ObjectStoreOutput(destination, True, SOURCE)  # the third run takes the output over
        _put(destination, "__0_0.distcp", b"the third run's")
        return info

    monkeypatch.setattr(store, "info_now", info_now)
    assert not second.claim.clear_name(destination / "__0_0.distcp")
    assert (destination / "__0_0.distcp").read_bytes() == b"the third run's"


def test_a_run_taken_over_as_it_sweeps_its_output_deletes_nothing(s3_server, monkeypatch):
    """The same for the sweep of what a run taken over left (confirm): the claim was checked
    before the listing, so a third run that took the output over just after lost the objects
    it wrote under the listed names. Now the claim is checked after the listing."""
    from dcpctl.storage.staging import ObjectStoreOutput

    second, destination = _object_output(s3_server, overwrite=True)
    _put(destination, "__0_0.distcp", b"second")
    _put(destination, "__5_0.distcp", b"the first run's, late")
    store, real_list_tree = destination.store, destination.store.list_tree

    def list_tree(*args, **kwargs):
        listing = real_list_tree(*args, **kwargs)
        monkeypatch.setattr(store, "list_tree", real_list_tree)
        ObjectStoreOutput(destination, True, SOURCE)  # the third run takes the output over
        _put(destination, "__5_0.distcp", b"the third run's")
        return listing

    monkeypatch.setattr(store, "list_tree", list_tree)
    with pytest.raises(OutputError, match="another run took this output over"):
        second.confirm(["__0_0.distcp"], {"__0_0.distcp": 6})
    assert (destination / "__5_0.distcp").read_bytes() == b"the third run's"


def test_a_run_taken_over_never_writes_over_the_others_sha256sums(s3_server):
    """A run taken over just after it checked its claim wrote its SHA256SUMS (one unconditional
    PUT) over that of the run that took the output over and published it, which then no longer
    verified. Now SHA256SUMS is written as the data files are: only while the claim holds, only
    where no object has the name, and a late one of the run taken over is cleared away."""
    from dcpctl.format.checkpoint.checksums import read_sha256sums, write_sha256sums
    from dcpctl.storage.staging import ObjectStoreOutput

    first, destination = _object_output(s3_server)
    second = ObjectStoreOutput(destination, True, SOURCE)
    _put(destination, "SHA256SUMS", b"the first run's, late")
    write_sha256sums(destination, {"__0_0.distcp": "a" * 64}, second.claim)
    with pytest.raises(OutputError, match="another run took this output over"):
        write_sha256sums(destination, {"__0_0.distcp": "b" * 64}, first.claim)
    assert read_sha256sums(destination) == {"__0_0.distcp": "a" * 64}


def test_without_overwrite_an_object_that_takes_a_name_this_run_writes_is_refused(s3_server):
    """Only a run that took the output over deletes an object in the way of one of its own."""
    from dcpctl.format.checkpoint.publishing import DataFileSet

    staged, destination = _object_output(s3_server)
    files = DataFileSet(destination, None, staged.claim)
    files.data_file("__0_0.distcp").write(b"mine")
    _put(destination, "__0_0.distcp", b"another's")
    with pytest.raises(OutputError, match="another run wrote an object of this name") as refused:
        files.finish_data_file("__0_0.distcp")
    assert refused.value.exit_code == 75
    files.discard()
    assert (destination / "__0_0.distcp").read_bytes() == b"another's"


def test_a_claim_another_process_replaced_is_not_held(s3_server):
    """The claim is read pinned to the ETag first seen: a claim another process put in its
    place raised ObjectChangedError from the check, not the takeover's own error."""
    import subprocess
    import sys

    from conftest import REPO_ROOT

    first, destination = _object_output(s3_server)
    assert first.claim.is_held()
    subprocess.run([sys.executable, "-c", (
        "from dcpctl.storage.paths import storage_path\n"
        "from dcpctl.storage.staging import ObjectStoreOutput\n"
        f"ObjectStoreOutput(storage_path({str(destination)!r}), True, "
        f"storage_path('/nonexistent/source'))\n")], check=True, cwd=REPO_ROOT)
    assert not first.claim.is_held()
    with pytest.raises(OutputError, match="another run took this output over"):
        first.claim.check()


def test_an_object_store_output_whose_objects_went_missing_is_not_published(s3_server):
    output, destination = _object_output(s3_server)
    _put(destination, "__0_0.distcp", b"data")
    destination.store.delete([(destination / "__0_0.distcp").key])
    with pytest.raises(OutputError, match="__1_0.distcp was deleted"):
        output.confirm(["__0_0.distcp", "__1_0.distcp"][1:])
    output.abort()
    assert _keys(destination) == []


def test_a_file_output_in_an_object_store_that_fails_leaves_what_stood_there(s3_server):
    """A file object is written whole or not at all: the abort of a run that failed before its
    object was complete deleted the file `--overwrite` was to replace; one it completed goes."""
    from dcpctl.storage.paths import ObjectOutputFile, storage_path
    from dcpctl.storage.staging import staged_output

    bucket = s3_server.new_bucket()
    destination = storage_path(f"s3://{bucket}/models/model.pt")
    destination.store.put(destination.key, b"the model of last week")
    staged = staged_output(destination, True, SOURCE, is_directory=False)
    with pytest.raises(RuntimeError):
        with ObjectOutputFile(staged.path, replacing=True) as output:
            output.write(b"half of a new one")
            raise RuntimeError("the run failed")
    staged.abort()
    assert destination.read_bytes() == b"the model of last week"
    staged = staged_output(destination, True, SOURCE, is_directory=False)
    with ObjectOutputFile(staged.path, replacing=True) as output:
        output.write(b"a whole new one")
        output.finish()
    staged.abort()  # a later step failed: the run's own object goes
    assert not destination.exists()


def test_an_output_is_replaced_in_one_step_and_a_killed_replacement_is_cleared(tmp_path):
    """A run killed while it replaced its output (--overwrite) left the old output hidden
    beside it for ever, under a name no later run removed; killed between the two renames,
    it left no output at all."""
    from dcpctl.storage.local import exchange

    first, second = tmp_path / "first", tmp_path / "second"
    first.mkdir()
    second.mkdir()
    (first / "a").write_text("first")
    (second / "b").write_text("second")
    assert exchange(first, second)
    assert [path.name for path in first.iterdir()] == ["b"]
    assert [path.name for path in second.iterdir()] == ["a"]
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "__0_0.distcp").write_bytes(b"old")
    staged = StagedOutput(tmp_path / "out", overwrite=True, source=SOURCE)
    (staged.path / "__0_0.distcp").write_bytes(b"new")
    staged.publish()
    assert sorted(path.name for path in tmp_path.iterdir()) == ["first", "out", "second"]
    assert (tmp_path / "out" / "__0_0.distcp").read_bytes() == b"new"


def test_a_destination_that_became_a_file_is_not_replaced(tmp_path):
    """Replaced by a file while the run wrote: the run swapped it for its output, failed on
    removing the old one (`Not a directory`), and left the user's file under a hidden name no
    later run removes."""
    destination = tmp_path / "out"
    destination.mkdir()
    staged = StagedOutput(destination, overwrite=True, source=SOURCE)
    (staged.path / "__0_0.distcp").write_bytes(b"new")
    destination.rmdir()
    destination.write_text("a user's file")
    with pytest.raises(OutputError, match="is no longer a directory"):
        staged.publish()
    staged.abort()
    assert destination.read_text() == "a user's file"
    assert sorted(path.name for path in tmp_path.iterdir()) == ["out"]


def test_an_object_store_output_replaced_with_objects_of_the_same_sizes_is_not_published(
        s3_server):
    """Run A gave its claim up and was about to write `.metadata` when run B (--overwrite)
    deleted A's objects and wrote its own, of the same sizes: A's check compared sizes only,
    so A published its `.metadata` over B's data."""
    first, destination = _object_output(s3_server)
    _put(destination, "__0_0.distcp", b"first")
    first.confirm(["__0_0.distcp"], {"__0_0.distcp": 5})
    other_run = destination.store.fs  # another process: no record of this run's writes
    key = (destination / "__0_0.distcp").key
    other_run.rm_file(key)
    other_run.pipe_file(key, b"other")
    _put(destination, ".metadata", b"metadata")
    with pytest.raises(OutputError, match="__0_0.distcp was replaced .*ETag"):
        first.confirm_published(["__0_0.distcp"], {"__0_0.distcp": 5}, ".metadata",
                                b"metadata")
    first.abort()
    assert _keys(destination) == ["__0_0.distcp"]
    assert other_run.cat_file(key) == b"other"


@pytest.mark.parametrize("size", [100, (8 << 20) + 100], ids=["one PUT", "multipart"])
def test_the_etag_of_this_runs_own_write_is_the_one_its_listing_gives(s3_server, size):
    """What the check above compares: a store that gave a write one ETag and listed the
    object with another would fail every output."""
    first, destination = _object_output(s3_server)
    store, key = destination.store, (destination / "__0_0.distcp").key
    writer = store.open_writer(key, if_absent=True)
    writer.write(bytes(size))
    writer.finish()
    assert store.etag_written(key) == store.list_tree(destination.key)["__0_0.distcp"].etag
    first.confirm(["__0_0.distcp"], {"__0_0.distcp": size})
    first.abort()


@pytest.mark.parametrize("size", [100, (8 << 20) + 100], ids=["one PUT", "multipart"])
def test_a_write_whose_etag_cannot_be_asked_after_it_landed_is_checked_by_size(
        moto_s3, monkeypatch, size):
    """Once an upload of parts completed, the writer asks the store for the object's ETag (a
    HEAD); a HEAD that failed then failed the write, which had landed: the run failed."""
    from s3_servers import Faults, faulty_proxy

    faults = Faults(unreadable_once_written="/out/__0_0.distcp")
    with faulty_proxy(moto_s3, faults) as proxy:
        for name, value in proxy.environment().items():
            monkeypatch.setenv(name, value)
        first, destination = _object_output(proxy)
        store, key = destination.store, (destination / "__0_0.distcp").key
        writer = store.open_writer(key, if_absent=True)
        writer.write(bytes(size))
        writer.finish()
        assert faults.written_to_unreadable
        assert (store.etag_written(key) is None) == (size > 100)  # one PUT's reply gives it
        first.confirm(["__0_0.distcp"], {"__0_0.distcp": size})
        first.abort()


@pytest.mark.parametrize("exchanges", [True, False], ids=["exchange", "two renames"])
def test_an_overwrite_where_inodes_look_changed_once_opened_replaces_and_removes_the_old(
        tmp_path, monkeypatch, exchanges):
    """On a FUSE file system (rclone mount) a directory's inode reads otherwise once it is
    opened, so shutil's rmtree took the old output, moved aside, for a symlink swapped in: the
    run failed, `Cannot call rmtree on a symbolic link`, after its output was in place, and
    the old one stayed beside it."""
    import os.path

    from dcpctl.storage import staging

    monkeypatch.setattr(os.path, "samestat", lambda first, second: False)
    if not exchanges:  # as there: no renameat2 exchange either
        monkeypatch.setattr(staging, "exchange", lambda first, second: False)
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "sub").mkdir()
    (tmp_path / "out" / "sub" / "__0_0.distcp").write_bytes(b"old")
    staged = StagedOutput(tmp_path / "out", overwrite=True, source=SOURCE)
    (staged.path / "__0_0.distcp").write_bytes(b"new")
    staged.publish()
    assert sorted(path.name for path in tmp_path.iterdir()) == ["out"]
    assert [path.name for path in (tmp_path / "out").iterdir()] == ["__0_0.distcp"]


def test_an_old_output_that_cannot_be_removed_is_named_and_the_new_one_stays(
        tmp_path, monkeypatch):
    import errno

    from dcpctl.storage import staging

    def refuse(path):
        raise OSError(errno.EBUSY, "Device or resource busy", str(path))

    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "__0_0.distcp").write_bytes(b"old")
    staged = StagedOutput(tmp_path / "out", overwrite=True, source=SOURCE)
    (staged.path / "__0_0.distcp").write_bytes(b"new")
    with monkeypatch.context() as patch:
        patch.setattr(staging, "remove_directory", refuse)
        with pytest.raises(OutputError, match="holds the new output, but removing the one it "
                           "replaced, moved to .*(Device or resource busy|busy).*the next run "
                           "for this output removes it"):
            staged.publish()
    staged.abort()
    assert (tmp_path / "out" / "__0_0.distcp").read_bytes() == b"new"
    rerun = StagedOutput(tmp_path / "out", overwrite=True, source=SOURCE)  # clears what stayed
    rerun.abort()
    assert sorted(path.name for path in tmp_path.iterdir()) == ["out"]


def test_a_local_output_missing_a_file_written_for_it_is_not_published(tmp_path):
    """torchrun ranks on two machines, the output on a path they do not share: rank 1 wrote
    its data file into a staging directory of its own making on its machine, and rank 0
    published the checkpoint without it, exit 0."""
    from dcpctl.storage.staging import staged_output

    staged = staged_output(tmp_path / "out", False, SOURCE)
    (staged.path / "__0_0.distcp").write_bytes(b"abc")
    staged.confirm(["__0_0.distcp"], {"__0_0.distcp": 3})
    with pytest.raises(OutputError, match="__1_0.distcp, written for this output, is not there"):
        staged.confirm(["__0_0.distcp", "__1_0.distcp"], {"__0_0.distcp": 3})
    with pytest.raises(OutputError, match="__0_0.distcp, written for this output, holds 3 "
                                          "bytes, not 4"):
        staged.confirm([], {"__0_0.distcp": 4})
    staged.abort()
    assert sorted(tmp_path.iterdir()) == []

"""Stores reached through fsspec's generic calls (gs://, az:// and other protocols without a
store of dcpctl's own), against a file system that keeps its objects the way such stores do:
blocks staged as they fill, the object committed when the file closes. Objects written and
dropped, and how a failing store is said and handled."""

from __future__ import annotations

import gc
import threading
import time

import pytest
from fsspec.spec import AbstractBufferedFile, AbstractFileSystem

from dcpctl.storage import objects
from dcpctl.storage.objects import ObjectStore


class StagingFileSystem(AbstractFileSystem):
    """Objects committed by their file's last upload, as adlfs's and gcsfs's files do."""

    protocol = "staging-test"

    def __init__(self, file_class: type, **kwargs) -> None:
        super().__init__(**kwargs)
        self.file_class = file_class
        self.committed: dict[str, bytes] = {}
        self.cancelled: list[str] = []
        self.deleting = threading.Event()  # set: rm_file never returns (a store gone silent)

    def _open(self, path, mode="rb", **kwargs):
        return self.file_class(self, path, mode, **kwargs)

    def rm_file(self, path) -> None:
        if self.deleting.is_set():
            threading.Event().wait()
        if path not in self.committed:
            raise FileNotFoundError(path)
        del self.committed[path]

    def info(self, path, **kwargs):
        if path not in self.committed:
            raise FileNotFoundError(path)
        return {"name": path, "size": len(self.committed[path]), "type": "file"}


class StagingFile(AbstractBufferedFile):
    def _initiate_upload(self) -> None:
        self.staged = b""

    def _upload_chunk(self, final=False) -> bool:
        self.staged += self.buffer.getvalue()
        if final:
            self.fs.committed[self.path] = self.staged
        return True


class CancellingFile(StagingFile):
    def discard(self) -> None:
        self.fs.cancelled.append(self.path)


def _store(file_class: type = None) -> tuple[ObjectStore, StagingFileSystem]:
    filesystem = StagingFileSystem(file_class or StagingFile, skip_instance_cache=True)
    return ObjectStore("staging-test", filesystem), filesystem


def test_a_discarded_object_is_never_committed_when_its_file_is_collected():
    """fsspec's buffered file closes itself when collected, and closing commits it: the
    discarded object was published once the garbage collector came by (and at the
    interpreter's exit, where fsspec's event loop is gone, the close waited forever)."""
    store, filesystem = _store()
    writer = store.open_writer("run/part.tmp", if_absent=True)
    writer.write(b"x" * 1000)
    writer.discard()
    del writer
    gc.collect()
    assert filesystem.committed == {}
    store.open_writer("run/whole").finish()  # a finished object is committed, as before
    assert filesystem.committed == {"run/whole": b""}


def test_a_store_s_own_cancel_runs_and_the_key_keeps_what_another_run_put_there():
    store, filesystem = _store(CancellingFile)
    writer = store.open_writer("run/part.tmp", if_absent=True)
    writer.write(b"x" * (6 << 20))  # past fsspec's block size: an upload has begun
    filesystem.committed["run/part.tmp"] = b"another run's, which took the output over"
    writer.discard()
    gc.collect()
    assert filesystem.cancelled == ["run/part.tmp"]
    assert filesystem.committed == {"run/part.tmp": b"another run's, which took the output over"}


def test_a_run_taken_over_leaves_the_data_files_of_the_run_that_took_it(monkeypatch):
    """A run whose output another took over (--overwrite) fails as it completes a data file;
    that file was no longer listed as open, so the abort never discarded it, and its
    finalizer then committed it over the other run's file of that name (and the first
    version of discard deleted the other files' names outright)."""
    from dcpctl.errors import OutputTakenError
    from dcpctl.format.checkpoint.publishing import DataFileSet
    from dcpctl.storage.claims import OutputClaim

    store, filesystem = _store()

    def cat_file(path, start=None, end=None, **kwargs):
        if path not in filesystem.committed:
            raise FileNotFoundError(path)
        return filesystem.committed[path][start:end]

    monkeypatch.setattr(filesystem, "cat_file", cat_file)
    output = objects.ObjectPath(store, "out")
    claim = OutputClaim(output / ".metadata.tmp", b"dcpctl run A\n")
    filesystem.committed["out/.metadata.tmp"] = claim.data
    files = DataFileSet(output, None, claim)
    for name in ("__0_0.distcp", "__1_0.distcp"):
        files.data_file(name).write(b"A" * 1000)
    taken = {"out/.metadata": b"run B's", "out/__0_0.distcp": b"run B's 0",
             "out/__1_0.distcp": b"run B's 1"}
    del filesystem.committed["out/.metadata.tmp"]
    filesystem.committed.update(taken)
    with pytest.raises(OutputTakenError):
        files.finish_data_file("__0_0.distcp")
    files.discard()
    gc.collect()
    assert filesystem.committed == taken


def test_a_store_that_stopped_answering_does_not_hold_the_failing_command(monkeypatch):
    monkeypatch.setattr(objects, "DISCARD_SECONDS", 0.2)
    store, filesystem = _store()
    writer = store.open_writer("run/part.tmp", if_absent=True)
    writer.write(b"x")
    filesystem.deleting.set()
    started = time.monotonic()
    writer.discard()
    assert time.monotonic() - started < 2
    gc.collect()
    assert filesystem.committed == {}


def test_a_failed_replacement_leaves_the_object_it_was_to_replace():
    """`convert --to torch -o URL --overwrite` writes over the object there, which must stay
    until the new one is complete: the first version of discard deleted it."""
    from dcpctl.storage.paths import ObjectOutputFile

    for file_class in (StagingFile, CancellingFile):
        store, filesystem = _store(file_class)
        filesystem.committed["out/model.pt"] = b"the previous, good model"
        output = ObjectOutputFile(objects.ObjectPath(store, "out/model.pt"), replacing=True)
        output.write(b"half of a new")
        output.discard()
        gc.collect()
        assert filesystem.committed == {"out/model.pt": b"the previous, good model"}


def test_a_timeout_or_an_error_without_a_message_is_said_in_words():
    """gcsfs with requests_timeout raises FSTimeoutError with no message: the line read
    `...: FSTimeoutError: ` and stopped there."""
    from fsspec.exceptions import FSTimeoutError

    store, _ = _store()
    said = []
    for error in (FSTimeoutError(), TimeoutError("read timed out"), ConnectionResetError()):
        try:
            with store.translated_errors("run/x"):
                raise error
        except objects.StorageError as translated:
            said.append(translated.message)
    assert said == ["the store did not answer in time (FSTimeoutError)",
                    "the store did not answer in time (TimeoutError: read timed out)",
                    "ConnectionResetError"]


@pytest.mark.parametrize("failure, asked", [
    (objects.StorageError("the connection kept failing after retries"), False),
    (objects.ObjectChangedError("the object changed while dcpctl read or replaced it"), True),
    (FileNotFoundError(2, "gone"), True)])
def test_a_failure_of_the_store_itself_is_no_reason_to_ask_it_about_a_rewrite(
        monkeypatch, failure, asked):
    """After a read failed on a store that stopped answering, the command asked that store
    whether the checkpoint had been rewritten meanwhile, and waited out the client's retries
    once more (about 33 s against a dead gs:// emulator) before saying what had failed."""
    from dcpctl.format.checkpoint import rewrites

    store, _ = _store()
    questions = []
    monkeypatch.setattr(rewrites, "rewritten_since_read",
                        lambda directory: questions.append(directory) or False)
    with pytest.raises(type(failure)):
        with rewrites.rewrite_named(objects.ObjectPath(store, "run/step-1")):
            raise failure
    assert bool(questions) is asked

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
                                          "--overwrite"):
        staged.publish()
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
    with pytest.raises(OutputError, match="was filled while"):
        staged.publish()
    staged.abort()
    assert target.read_bytes() == b"theirs"
    assert [p.name for p in tmp_path.iterdir()] == ["model.pt"]


def test_abort_removes_the_unfinished_directory(tmp_path):
    staged = StagedOutput(tmp_path / "out", overwrite=False, source=SOURCE)
    (staged.path / "half").write_text("x")
    staged.abort()
    assert list(tmp_path.iterdir()) == []


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

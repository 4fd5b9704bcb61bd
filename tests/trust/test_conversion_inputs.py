"""What `convert` interprets (planner_data's key paths, objects it unpickles) is checked before
anything is written: no entry is dropped without a word, nothing runs away."""

from __future__ import annotations

import pickle

import pytest
import zstandard
from conftest import torch_metadata

SOURCE = "objects_2ranks"


@pytest.fixture
def checkpoint(copy_fixture):
    return copy_fixture(SOURCE)


def _with_planner_data(checkpoint, edit) -> None:
    metadata = torch_metadata(checkpoint)
    edit(metadata)
    (checkpoint / ".metadata").write_bytes(pickle.dumps(metadata))


@pytest.mark.parametrize("paths, words", [
    ({"history": ["step"]}, "another entry's value is at or under"),
    ({"history": ["step", "deeper"]}, "runs through the value of"),
    ({"history": ["config"]}, "another entry's value is at or under"),
    ({"history": ["weights", 10**9]}, "not a name or an index"),
    ({"history": ["config", 0]}, "both a dict and a list"),
])
def test_key_paths_that_cannot_all_hold_their_values_are_refused(run_cli, tmp_path, checkpoint,
                                                                 paths, words):
    """objects_2ranks nests `step`, `config.lr`, `config.nested.depth`, `history`...: key
    paths are made to clash. Without the check, torch's way keeps one and drops the other."""
    _with_planner_data(checkpoint, lambda metadata: metadata.planner_data.update(paths))
    result = run_cli("convert", checkpoint, "--to", "torch", "-o", tmp_path / "state.pt")
    assert result.exit_code == 1, result.output
    assert words in result.output and len(result.output.splitlines()) == 1
    assert not (tmp_path / "state.pt").exists()


def test_planner_data_that_is_not_a_mapping_is_refused(run_cli, tmp_path, checkpoint):
    _with_planner_data(checkpoint, lambda metadata: setattr(metadata, "planner_data", ["x"]))
    result = run_cli("convert", checkpoint, "--to", "torch", "-o", tmp_path / "state.pt")
    assert result.exit_code == 1 and "planner_data is not a mapping" in result.output


def test_an_object_that_decodes_to_gigabytes_is_refused_in_bounded_memory(run_cli, tmp_path,
                                                                          checkpoint):
    bomb = zstandard.ZstdCompressor().compress(bytes(1 << 30))
    metadata = torch_metadata(checkpoint)
    key = next(key for key in metadata.storage_data if key.offset is None)
    info = metadata.storage_data[key]
    with open(checkpoint / info.relative_path, "ab") as stream:
        info.offset, info.length = stream.tell(), len(bomb)
        stream.write(bomb)
    info.transform_descriptors = ["stream.zstd/1"]
    (checkpoint / ".metadata").write_bytes(pickle.dumps(metadata))
    result = run_cli("convert", checkpoint, "--to", "torch", "-o", tmp_path / "state.pt")
    assert result.exit_code == 1, result.output
    assert f"item {key.fqn!r}" in result.output and "more than 268435456 bytes" in result.output

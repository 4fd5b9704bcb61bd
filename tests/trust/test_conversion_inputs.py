"""What `convert` interprets (planner_data's key paths, objects it unpickles) is checked before
anything is written: no entry is dropped without a word, nothing runs away."""

from __future__ import annotations

import pickle
import shutil

import pytest
import zstandard
from conftest import fixture_path, torch_metadata

SOURCE = "objects_2ranks"


@pytest.fixture
def checkpoint(tmp_path):
    path = tmp_path / "ckpt"
    shutil.copytree(fixture_path(SOURCE), path)
    return path


def _with_planner_data(checkpoint, edit) -> None:
    metadata = torch_metadata(checkpoint)
    edit(metadata)
    (checkpoint / ".metadata").write_bytes(pickle.dumps(metadata))


@pytest.mark.parametrize("edit, words", [
    (lambda planner: planner.update({"other": list(planner[next(iter(planner))])}),
     "another entry's value is at or under"),
    (lambda planner: planner.update({"other": (*planner[next(iter(planner))], "deeper")}),
     "runs through the value of"),
    (lambda planner: planner.update({"other": ("model", 10**9)}), "not a name or an index"),
    (lambda planner: planner.update({"other": ("model", 0, "x"), "other2": ("model", "y")}),
     "both a dict and a list"),
])
def test_key_paths_that_cannot_all_hold_their_values_are_refused(run_cli, tmp_path, checkpoint,
                                                                  edit, words):
    def change(metadata):
        first = next(iter(metadata.state_dict_metadata))
        metadata.state_dict_metadata["other"] = metadata.state_dict_metadata[first]
        metadata.state_dict_metadata["other2"] = metadata.state_dict_metadata[first]
        edit(metadata.planner_data)
        metadata.planner_data.setdefault("other2", ("other2",))
        for key in [key for key in metadata.storage_data if key.fqn == first]:
            metadata.storage_data[type(key)("other", key.offset, key.index)] = \
                metadata.storage_data[key]
            metadata.storage_data[type(key)("other2", key.offset, key.index)] = \
                metadata.storage_data[key]

    _with_planner_data(checkpoint, change)
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

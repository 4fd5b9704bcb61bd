"""Objects of plain Python data load without torch, as torch's weights_only loader loads them;
anything else is left to that loader."""

from __future__ import annotations

import io
import struct
import types
from collections import Counter, OrderedDict

import pytest
import torch

from dcpctl.format.torch_save.plain_objects import NotPlainData, load_plain_object


def saved(value, pickle_module=None) -> bytes:
    buffer = io.BytesIO()
    if pickle_module is None:
        torch.save(value, buffer)
    else:
        torch.save(value, buffer, pickle_module=pickle_module)
    return buffer.getvalue()


def assert_same(mine, theirs):
    assert type(mine) is type(theirs)
    if isinstance(mine, dict):
        assert list(mine.items()) == list(theirs.items())
        for key in mine:
            assert_same(mine[key], theirs[key])
    elif isinstance(mine, (list, tuple)):
        assert len(mine) == len(theirs)
        for a, b in zip(mine, theirs):
            assert_same(a, b)
    else:
        assert mine == theirs or (mine != mine and theirs != theirs)  # NaN


SHARED = [1, 2]

PLAIN_VALUES = [
    7, -2**70, 0.1, float("nan"), float("-inf"), True, None, "adamw", "ünï", b"\x00\xff" * 300,
    bytearray(b"ab"), 1 + 2j, {1, 2}, (), (0.9, 0.95), [],
    {"param_groups": [{"lr": 1e-3, "betas": (0.9, 0.95), "params": [0, 1, 2],
                       "foreach": None, "weight_decay": 0.0}], "state": {}},
    OrderedDict([("b", 1), ("a", 2)]), Counter("hello"), {"x": SHARED, "y": SHARED},
    list(range(1000)), {str(key): key for key in range(300)},  # LONG_BINPUT past 255
]


@pytest.mark.parametrize("value", PLAIN_VALUES, ids=lambda value: type(value).__name__)
def test_plain_data_loads_as_torchs_loader_loads_it(value):
    archive = saved(value)
    mine = load_plain_object(archive)
    assert_same(mine, torch.load(io.BytesIO(archive), weights_only=True))


def test_shared_references_stay_shared():
    loaded = load_plain_object(saved({"x": SHARED, "y": SHARED}))
    assert loaded["x"] is loaded["y"]


class _RunsCode:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (str(self.marker), "w"))


class _PrefixedPickler:
    """A pickle module whose Pickler writes `prefix` before what torch.save asks for."""

    def __init__(self, prefix: bytes):
        import pickle

        class Pickler(pickle.Pickler):
            def __init__(self, file, protocol=None):
                super().__init__(file, protocol=protocol)
                self._file = file

            def dump(self, value):
                self._file.write(prefix)
                super().dump(value)

        self.module = types.SimpleNamespace(Pickler=Pickler, __name__="pickle")


@pytest.mark.parametrize("value", [torch.arange(3), torch.Size([2, 3]), torch.float16,
                                   {"nested": [torch.zeros(1)]}, torch.device("cpu")],
                         ids=lambda value: type(value).__name__)
def test_what_is_more_than_plain_data_is_left_to_torch(value):
    with pytest.raises(NotPlainData):
        load_plain_object(saved(value))


def test_a_pickle_that_would_run_code_is_left_to_torch_and_runs_nothing(tmp_path):
    marker = tmp_path / "ran"
    with pytest.raises(NotPlainData, match="open"):
        load_plain_object(saved(_RunsCode(marker)))
    assert not marker.exists()


@pytest.mark.parametrize("prefix", [
    b"Nr" + struct.pack("<I", 2**30) + b"0",  # a memo index far past the pickle
    b"N0",  # POP, which torch's loader does not read
])
def test_pickles_torchs_loader_must_judge_are_left_to_it(prefix):
    archive = saved({"step": 3}, _PrefixedPickler(prefix).module)
    with pytest.raises(NotPlainData):
        load_plain_object(archive)


def test_damaged_archives_are_left_to_torch():
    archive = saved({"step": 12345})
    with pytest.raises(NotPlainData, match="CRC-32"):
        load_plain_object(archive.replace(struct.pack("<H", 12345), struct.pack("<H", 12346)))
    with pytest.raises(NotPlainData):
        load_plain_object(archive[:-30])
    with pytest.raises(NotPlainData):
        load_plain_object(b"not a zip archive")

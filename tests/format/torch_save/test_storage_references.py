"""An object's torch.save archive is one torch.load reads: its data.pkl a pickle, each storage it
names held (format/torch_save/storage_references.py), whatever classes it holds."""

from __future__ import annotations

import argparse
import collections
import dataclasses
import enum
import io
import pickle
import zipfile

import numpy
import pytest
import torch

from dcpctl.errors import DataError
from dcpctl.format.torch_save.archive_check import check_archive
from dcpctl.format.torch_save.storage_references import referenced_storage_keys


class Color(enum.Enum):
    RED = 1


@dataclasses.dataclass
class Settings:
    lr: float
    betas: tuple


def _saved(value, protocol: int = 2) -> bytes:
    stream = io.BytesIO()
    torch.save(value, stream, pickle_protocol=protocol)
    return stream.getvalue()


def _checked(archive: bytes):
    return check_archive(lambda start, count: archive[start:start + count], len(archive),
                         expect_tensor=False)


SHARED = torch.arange(6.0)
OBJECTS = {
    "plain": {"step": 3, "name": "x", "ratio": 0.5, "raw": b"\x00\x01", "none": None},
    "namespace": argparse.Namespace(lr=0.1, layers=[1, 2], dtype=torch.bfloat16),
    "ordered": collections.OrderedDict(a=1, b=[2, 3]),
    "counter": collections.Counter("abca"),
    "dataclass": Settings(0.1, (0.9, 0.99)),
    "enum": {"color": Color.RED, "colors": {Color.RED}},
    "torch bits": [torch.Size([2, 3]), torch.device("cpu"), torch.float16],
    "tensors": {"a": torch.ones(2), "view": SHARED[2:4], "whole": SHARED,
                "half": torch.zeros(3, dtype=torch.bfloat16)},
    "rng": torch.get_rng_state(),
    "numpy": {"state": numpy.random.RandomState(0).get_state(), "array": numpy.arange(3)},
    "nested": {"x": [{"y": ({"z": torch.ones(1)},)}]},
}


@pytest.mark.parametrize("name", OBJECTS)
@pytest.mark.parametrize("protocol", [2, pickle.HIGHEST_PROTOCOL])
def test_every_archive_torch_save_writes_is_taken_with_its_storages(name, protocol):
    archive = _saved(OBJECTS[name], protocol)
    torch.load(io.BytesIO(archive), weights_only=False)  # sound, as torch reads it
    checked = _checked(archive)
    assert checked.crc_mismatches == []
    with zipfile.ZipFile(io.BytesIO(archive)) as opened:
        prefix = opened.namelist()[0].partition("/")[0]
        stored = {entry.rpartition("/")[2] for entry in opened.namelist()
                  if entry.startswith(f"{prefix}/data/")}
        keys = set(referenced_storage_keys(opened.read(f"{prefix}/data.pkl")))
    assert keys == stored


def _rewritten(archive: bytes, leave_out: str = "", replace: dict | None = None) -> bytes:
    with zipfile.ZipFile(io.BytesIO(archive)) as source:
        out = io.BytesIO()
        with zipfile.ZipFile(out, "w") as rewritten:
            for name in source.namelist():
                if not (leave_out and name.endswith(leave_out)):
                    rewritten.writestr(name, (replace or {}).get(name.partition("/")[2],
                                                                 source.read(name)))
    return out.getvalue()


@pytest.mark.parametrize("damage, words", [
    ({"replace": {"data.pkl": b"not a pickle"}}, "data.pkl is no pickle torch.load reads"),
    ({"replace": {"data.pkl": pickle.dumps({"a": 1})[:-1]}},
     "data.pkl is no pickle torch.load reads"),
    ({"leave_out": "/data/0"}, "data.pkl names storage '0', of which the archive holds no "
                               "record"),
])
def test_a_sound_zip_torch_load_cannot_read_is_refused(damage, words):
    """A zip of sound CRC-32s whose data.pkl is no pickle, or names a storage it lacks, was
    taken for a sound torch.save archive: verify said ok of a meta.pt torch cannot load."""
    archive = _rewritten(_saved({"seed": torch.arange(3), "step": 1}), **damage)
    with pytest.raises(Exception):
        torch.load(io.BytesIO(archive), weights_only=False)
    with pytest.raises(DataError, match=words):
        _checked(archive)


def test_a_persistent_id_that_is_no_storage_is_refused():
    class Pickler(pickle.Pickler):
        def persistent_id(self, value):
            return ("module", "x") if value == "marker" else None

    stream = io.BytesIO()
    Pickler(stream, protocol=2).dump(["marker"])
    with pytest.raises(DataError, match="names a persistent id"):
        referenced_storage_keys(stream.getvalue())


def test_no_global_the_pickle_names_is_looked_up(tmp_path):
    """os.system named by a hostile data.pkl stands for nothing: nothing runs."""
    marker = tmp_path / "ran"
    data = b"cos\nsystem\n(S'touch " + str(marker).encode() + b"'\ntR."
    assert referenced_storage_keys(data) == []
    assert not marker.exists()

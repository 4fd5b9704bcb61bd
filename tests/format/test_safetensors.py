"""Safetensors headers written before the data, shard plans, the index, and reading models."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from dcpctl.errors import DataError, UnsupportedLayoutError
from dcpctl.format.dtypes import dtype_by_name
from dcpctl.format.safetensors import (SafetensorsTensor, encode_header, encode_index, plan_shards,
                                       read_safetensors_model, shard_file_name)


def _write_by_hand(path, tensors: dict[str, torch.Tensor]) -> None:
    entries = [SafetensorsTensor(name, dtype_by_name(str(value.dtype)), tuple(value.shape),
                                 nbytes=value.numel() * value.element_size())
               for name, value in tensors.items()]
    with open(path, "wb") as stream:
        stream.write(encode_header(entries))
        for value in tensors.values():
            stream.write(value.contiguous().view(-1).view(torch.uint8).numpy().tobytes())


def test_a_header_computed_before_the_data_gives_a_file_safetensors_reads(tmp_path):
    tensors = {"b.weight": torch.randn(3, 5).to(torch.bfloat16), "a.bias": torch.randn(7),
               "scalar": torch.tensor(2.5), "empty": torch.zeros(0, 4),
               "mask": torch.tensor([True, False]), "ids": torch.arange(6).reshape(2, 3)}
    path = tmp_path / "model.safetensors"
    _write_by_hand(path, tensors)
    header_length = int.from_bytes(path.read_bytes()[:8], "little")
    assert (8 + header_length) % 8 == 0
    loaded = load_file(path)
    assert set(loaded) == set(tensors)
    for name, value in tensors.items():
        assert loaded[name].dtype == value.dtype and torch.equal(loaded[name], value)
    with safe_open(path, "pt") as handle:
        assert handle.metadata() == {"format": "pt"}


def test_a_dtype_safetensors_cannot_store_is_named():
    entry = SafetensorsTensor("z", dtype_by_name("complex128"), (2,), nbytes=32)
    with pytest.raises(UnsupportedLayoutError, match=r"'z'.*complex128.*cannot store \(leave "
                                                     r"it out with --exclude\)"):
        encode_header([entry])  # --dtype casts floats only: no advice to cast


def test_packed_float4_is_written_and_read_with_the_shape_safetensors_counts(tmp_path):
    """safetensors' F4 counts 4-bit values: torch's float4_e2m1fn_x2 [5, 2] (ten bytes) is
    F4 [5, 4]. Both were refused: a dtype safetensors "cannot store", and F4 unknown."""
    packed = torch.arange(30, dtype=torch.uint8).reshape(3, 5, 2).view(torch.float4_e2m1fn_x2)
    path = tmp_path / "model.safetensors"
    _write_by_hand(path, {"w": packed})
    header = json.loads(path.read_bytes()[8:8 + int.from_bytes(path.read_bytes()[:8], "little")])
    assert (header["w"]["dtype"], header["w"]["shape"]) == ("F4", [3, 5, 4])
    with safe_open(path, "pt") as handle:
        loaded = handle.get_tensor("w")
    assert loaded.dtype == packed.dtype
    assert torch.equal(loaded.view(torch.uint8), packed.view(torch.uint8))
    save_file({"w": packed}, path)  # as the library writes it, read back by dcpctl
    (tensor,) = [tensor for _, tensor in read_safetensors_model(path)]
    assert (tensor.dtype.name, tensor.shape, tensor.nbytes) == ("float4_e2m1fn_x2", (3, 5, 2), 30)


@pytest.mark.parametrize("shape", [[5, 3], [3], []])
def test_an_f4_shape_that_packs_no_whole_bytes_is_refused(tmp_path, shape):
    path = tmp_path / "model.safetensors"
    _with_header(path, json.dumps({"w": {"dtype": "F4", "shape": shape,
                                         "data_offsets": [0, 16]}}).encode())
    with pytest.raises(DataError, match=r"'w' has safetensors dtype F4 and shape .* no whole "
                                        r"number of torch.float4_e2m1fn_x2 elements"):
        read_safetensors_model(path)


def test_a_0_d_packed_float4_tensor_is_refused_by_name():
    entry = SafetensorsTensor("s", dtype_by_name("float4_e2m1fn_x2"), (), nbytes=1)
    with pytest.raises(UnsupportedLayoutError, match=r"'s' is a 0-d torch.float4_e2m1fn_x2, "
                                                     r"whose 2 packed values"):
        encode_header([entry])


@pytest.mark.parametrize("sizes,limit,expected", [
    ([4, 4, 4], 8, [[0, 1], [2]]),
    ([4, 4, 4], 12, [[0, 1, 2]]),
    ([10, 1, 1], 4, [[0], [1, 2]]),
    ([1, 10, 1], 4, [[0], [1], [2]]),
    ([0, 0], 1, [[0, 1]]),
    ([], 5, []),
])
def test_shards_fill_in_order_and_a_large_tensor_stands_alone(sizes, limit, expected):
    assert plan_shards(sizes, limit) == expected


def test_file_names_follow_transformers():
    assert shard_file_name(1, 1) == "model.safetensors"
    assert shard_file_name(2, 12) == "model-00002-of-00012.safetensors"


def test_index_document():
    document = json.loads(encode_index(30, {"b": "model-00002-of-00002.safetensors",
                                            "a": "model-00001-of-00002.safetensors"}))
    assert document == {"metadata": {"total_size": 30},
                        "weight_map": {"a": "model-00001-of-00002.safetensors",
                                       "b": "model-00002-of-00002.safetensors"}}


def test_reading_a_model_checks_the_index(tmp_path):
    save_file({"a": torch.ones(2)}, tmp_path / "one.safetensors")
    save_file({"b": torch.ones(3, dtype=torch.float16)}, tmp_path / "two.safetensors")
    index = tmp_path / "model.safetensors.index.json"
    index.write_bytes(encode_index(14, {"a": "one.safetensors", "b": "two.safetensors"}))
    found = {tensor.name: (path.name, tensor.shape, tensor.dtype.name)
             for path, tensor in read_safetensors_model(tmp_path)}
    assert found == {"a": ("one.safetensors", (2,), "float32"),
                     "b": ("two.safetensors", (3,), "float16")}
    index.write_bytes(encode_index(14, {"a": "two.safetensors", "b": "two.safetensors"}))
    with pytest.raises(DataError, match="weight_map puts 'a' in two.safetensors"):
        read_safetensors_model(tmp_path)
    index.write_bytes(encode_index(14, {"a": "../one.safetensors"}))
    with pytest.raises(DataError, match="not a file name inside"):
        read_safetensors_model(tmp_path)
    index.unlink()
    with pytest.raises(DataError, match="neither"):
        read_safetensors_model(tmp_path)


def test_a_truncated_file_is_refused(tmp_path):
    path = tmp_path / "model.safetensors"
    save_file({"a": torch.ones(100)}, path)
    path.write_bytes(path.read_bytes()[:-10])
    with pytest.raises(DataError, match="'a'"):
        read_safetensors_model(path)


def _with_header(path, header: bytes) -> None:
    import struct

    path.write_bytes(struct.pack("<Q", len(header)) + header + bytes(16))


ENTRY = {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]}


@pytest.mark.parametrize("header, message", [
    (json.dumps({"a": {**ENTRY, "dtype": ["F32"]}}).encode(), "'a' is not a valid tensor entry"),
    (json.dumps({"a": {**ENTRY, "dtype": {"F32": 1}}}).encode(), "not a valid tensor entry"),
    (b"[" * 100_000 + b"]" * 100_000, "not JSON \\(nested deeper than any real one\\)"),
    # what the safetensors library refuses, and a rewrite from it could not write back
    (b"\xef\xbb\xbf" + json.dumps({"a": ENTRY}).encode(), "starts with a byte order mark"),
    (b'{"a": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]}, "b": NaN}',
     "holds NaN, which is not JSON"),
    (b'{"\\ud800": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]}}',
     "a string that is not Unicode"),
    (json.dumps({"a": ENTRY, "__metadata__": {"format": 1}}).encode(),
     "__metadata__ that is not a map of strings"),
    (json.dumps({"a": ENTRY, "__metadata__": ["pt"]}).encode(),
     "__metadata__ that is not a map of strings"),
    # Python's parser takes UTF-16 and UTF-32 bytes too; the library reads UTF-8 only
    (json.dumps({"a": ENTRY}).encode("utf-16-le"), "not JSON"),
    (json.dumps({"a": ENTRY}).encode("utf-32"), "not JSON"),
])
def test_hostile_headers_are_refused_in_a_line(tmp_path, header, message):
    """A dtype that is a list crashed on a dict lookup, and a header nested 100,000 deep with
    a RecursionError: internal errors, where a refusal naming the file belongs."""
    path = tmp_path / "model.safetensors"
    _with_header(path, header)
    with pytest.raises(DataError, match=message):
        read_safetensors_model(path)


@pytest.mark.parametrize("claimed, message", [
    (100_000_001, "claims 100000001 bytes, more than the safetensors library reads"),
    (64, "claims 64 bytes; the file ends 16 bytes after its length"),
])
def test_a_header_length_the_library_refuses_is_refused_and_said(tmp_path, claimed, message):
    """A header of 100,000,001 to 100 MiB was read where the library refuses the file; one
    claiming more bytes than the file has was `not JSON (Extra data ...)`."""
    import struct

    path = tmp_path / "model.safetensors"
    path.write_bytes(struct.pack("<Q", claimed) + b"{}" + bytes(14))
    with pytest.raises(DataError, match=message):
        read_safetensors_model(path)


def test_a_null_metadata_is_none_as_the_library_reads_it(tmp_path):
    path = tmp_path / "model.safetensors"
    _with_header(path, json.dumps({"a": ENTRY, "__metadata__": None}).encode())
    assert [tensor.name for _, tensor in read_safetensors_model(path)] == ["a"]


@pytest.mark.parametrize("index, message", [
    ('{"weight_map": {"a": ["model.safetensors"]}}', "gives 'a' the file \\['model"),
    ('{"weight_map": ' + "[" * 100_000 + "]" * 100_000 + "}",
     "not a safetensors index: not JSON \\(nested deeper than any real one\\)"),
    ('{"weight_map": {}}', "its weight_map names no tensors"),  # converted to 0 tensors
    ('{"weight_map": {"a": "model.safetensors"}}' + " " * 250_000,
     "is 250042 bytes, past the 0 MiB"),
    ('["weight_map"]', "not a safetensors index \\(no weight_map object\\)"),
])
def test_hostile_indexes_are_refused_in_a_line(tmp_path, monkeypatch, index, message):
    """A 3 GB index (a real one and NUL bytes after it) was read whole, into 6 GB of memory,
    to be called `not a safetensors index (no weight_map)`."""
    from dcpctl.format import safetensors

    monkeypatch.setattr(safetensors, "MAX_INDEX_BYTES", 250_000)
    _with_header(tmp_path / "model.safetensors", json.dumps({"a": ENTRY}).encode())
    (tmp_path / "model.safetensors.index.json").write_text(index)
    with pytest.raises(DataError, match=message):
        read_safetensors_model(tmp_path)


def test_a_header_is_read_again_once_its_file_is_rewritten(tmp_path):
    """The parsed header was kept by path alone: a long-lived process (a library user's)
    checked a file rewritten at the same size against its old header."""
    import os

    from dcpctl.format.safetensors import read_safetensors_header

    path = tmp_path / "model.safetensors"
    save_file({"a": torch.zeros(4)}, path)
    stat = path.stat()
    assert set(read_safetensors_header(path)[0]) - {"__metadata__"} == {"a"}
    save_file({"b": torch.ones(4)}, path)
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))  # the same size and mtime
    assert path.stat().st_size == stat.st_size
    assert set(read_safetensors_header(path)[0]) - {"__metadata__"} == {"b"}

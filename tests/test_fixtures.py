"""The shipped fixtures still hold what fixtures/make_fixtures.py describes."""

from __future__ import annotations

import json
import struct

import pytest
import torch
from conftest import (FIXTURE_NAMES, FIXTURES_DIR, MANIFEST, TORCH_LOADABLE_FIXTURES, fixture_path,
                      load_with_torch, torch_metadata)
from make_fixtures import FIXTURES, tensor_sha256


def test_manifest_lists_the_fixtures_the_script_defines():
    assert sorted(FIXTURES) == FIXTURE_NAMES
    for name, spec in FIXTURES.items():
        for key in ("world_size", "state", "writer"):
            assert MANIFEST[name][key] == spec[key]


def test_fixtures_stay_small():
    total = sum(path.stat().st_size for path in FIXTURES_DIR.rglob("*") if path.is_file())
    assert total < 5 * 1024 * 1024


@pytest.mark.parametrize("name", FIXTURE_NAMES)
def test_fixture_was_written_by_its_world_size(name):
    metadata = torch_metadata(fixture_path(name))
    ranks = {int(info.relative_path.split("_")[2]) for info in metadata.storage_data.values()}
    assert ranks == set(range(MANIFEST[name]["world_size"]))


@pytest.mark.parametrize("name", TORCH_LOADABLE_FIXTURES)
def test_torch_loads_the_described_values(name):
    loaded = load_with_torch(fixture_path(name))
    expected = MANIFEST[name]
    assert set(loaded) == set(expected["tensors"]) | set(expected["objects"])
    for fqn, description in expected["tensors"].items():
        tensor = loaded[fqn]
        assert str(tensor.dtype) == f"torch.{description['dtype']}"
        assert list(tensor.shape) == description["shape"]
        assert tensor_sha256(tensor) == description["sha256"], fqn
    for fqn, value in expected["objects"].items():
        assert json.loads(json.dumps(loaded[fqn])) == value


def test_safetensors_fixture_holds_the_described_values():
    """torch's FileSystemReader cannot load this layout; assemble it with safetensors itself."""
    from safetensors.torch import load as load_safetensors

    name = "safetensors_fsdp2_2ranks"
    metadata = torch_metadata(fixture_path(name))
    expected = MANIFEST[name]["tensors"]
    full = {fqn: torch.empty(d["shape"], dtype=getattr(torch, d["dtype"]))
            for fqn, d in expected.items()}
    blob_offsets = {(info.relative_path, info.offset) for key, info in
                    metadata.storage_data.items() if key.offset is not None}
    for relative_path, offset in blob_offsets:
        data = (fixture_path(name) / relative_path).read_bytes()[offset:]
        (header_length,) = struct.unpack("<Q", data[:8])
        header = json.loads(data[8:8 + header_length])
        sharding = json.loads(header["__metadata__"]["DCP_SHARDING_INFO"])
        for fqn, piece in load_safetensors(data).items():
            index = tuple(slice(start, start + size) for start, size in
                          zip(sharding[fqn]["saved_offsets"], piece.shape))
            full[fqn][index] = piece
    for fqn, tensor in full.items():
        assert tensor_sha256(tensor) == expected[fqn]["sha256"], fqn

"""Checkpoints compressed with floatsplit: torch loads them through dcpctl.storage_reader on any
number of ranks, stock torch refuses them, and they turn back into plain or zstd items."""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from conftest import (MANIFEST, TORCH_LOADABLE_FIXTURES, assert_plain_items_equal_decoded,
                      fixture_path, load_with_torch)
from make_fixtures import STATE_BUILDERS, describe_state, run_gloo_job, tensor_sha256
from rank_loading import assert_matches_manifest
from safetensors.torch import load_file
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint.format_utils import _EmptyStateDictLoadPlanner
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

import dcpctl
from dcpctl.format.checkpoint.view import open_checkpoint
from dcpctl.format.codecs.names import FLOATSPLIT_DESCRIPTOR
from dcpctl.format.codecs.registry import (IDENTITY, codec_for_descriptors, floatsplit_codec,
                                           zstd_codec)
from dcpctl.ops.convert.key_selection import KeySelection
from dcpctl.ops.convert.to_safetensors import convert_to_safetensors
from dcpctl.ops.inspection.report import inspect_checkpoint
from dcpctl.ops.reshard.execution import reshard_checkpoint
from dcpctl.ops.transcode import transcode_checkpoint
from dcpctl.ops.verify.verifier import verify_checkpoint


def _load_scrambled_state(rank: int, world_size: int, checkpoint: str, state_kind: str,
                          out_file: str) -> None:
    """Build the fixture's state on this rank, overwrite every tensor, then load into it."""
    state = STATE_BUILDERS[state_kind](world_size)
    flat, _ = flatten_state_dict(state)
    with torch.no_grad():
        for value in flat.values():
            if isinstance(value, torch.Tensor) and value.numel():
                value.fill_(7)
    dcp.load(state, storage_reader=dcpctl.storage_reader(checkpoint))
    description = describe_state(state)  # collective: full_tensor() on every rank
    if rank == 0:
        Path(out_file).write_text(json.dumps(description))


def _compressed(name: str, tmp_path: Path) -> Path:
    out = tmp_path / f"{name}-floatsplit"
    transcode_checkpoint(fixture_path(name), floatsplit_codec(), str(out), threads=2)
    return out


@pytest.mark.slow
@pytest.mark.parametrize("name,world_size", [("fsdp2_adamw_3ranks", 2), ("objects_2ranks", 3)])
def test_loads_through_storage_reader_on_other_world_sizes(name, world_size, tmp_path):
    checkpoint = _compressed(name, tmp_path)
    out_file = tmp_path / "description.json"
    run_gloo_job(world_size, _load_scrambled_state, str(checkpoint), MANIFEST[name]["state"],
                 str(out_file))
    assert_matches_manifest(json.loads(out_file.read_text()), name)


@pytest.mark.parametrize("name", TORCH_LOADABLE_FIXTURES)
def test_every_item_is_floatsplit_and_loads_equal_in_one_process(name, tmp_path):
    checkpoint = _compressed(name, tmp_path)
    storage = open_checkpoint(checkpoint).metadata.storage_data
    assert {tuple(info.transform_descriptors) for info in storage.values()} == {
        (FLOATSPLIT_DESCRIPTOR,)}
    state: dict = {}
    _load_state_dict(state, storage_reader=dcpctl.storage_reader(checkpoint),
                     planner=_EmptyStateDictLoadPlanner(), no_dist=True)
    loaded, _ = flatten_state_dict(state)
    expected = load_with_torch(fixture_path(name))
    assert loaded.keys() == expected.keys()
    for fqn, value in expected.items():
        if isinstance(value, torch.Tensor):
            assert value.dtype == loaded[fqn].dtype
            assert value.reshape(-1).view(torch.uint8).equal(
                loaded[fqn].reshape(-1).view(torch.uint8)), fqn
        else:
            assert loaded[fqn] == value


def test_stock_torch_fails_with_unknown_extension(tmp_path):
    checkpoint = _compressed("objects_2ranks", tmp_path)
    with pytest.raises(BaseException, match="Unknown extension"):
        load_with_torch(checkpoint)
    report = inspect_checkpoint(checkpoint)
    assert report.to_json()["compression"] == {"floatsplit": len(
        open_checkpoint(checkpoint).metadata.storage_data)}


@pytest.mark.parametrize("name", TORCH_LOADABLE_FIXTURES)
def test_decompress_gives_back_the_original_items(name, tmp_path):
    transcode_checkpoint(str(_compressed(name, tmp_path)), IDENTITY, str(tmp_path / "plain"))
    assert_plain_items_equal_decoded(fixture_path(name), tmp_path / "plain")


def test_compress_to_zstd_makes_it_loadable_by_stock_torch(tmp_path):
    name = "fsdp2_adamw_3ranks"
    zstd_out = tmp_path / "zstd"
    transcode_checkpoint(str(_compressed(name, tmp_path)), zstd_codec(), str(zstd_out))
    loaded = load_with_torch(zstd_out)
    for fqn, value in load_with_torch(fixture_path(name)).items():
        assert torch.equal(loaded[fqn], value) if isinstance(value, torch.Tensor) else \
            loaded[fqn] == value


def test_floatsplit_is_smaller_than_zstd_on_float_weights(tmp_path):
    """A quick synthetic check; bench/bench_floatsplit.py measures the real weights."""
    generator = torch.Generator().manual_seed(0)
    state = {"w": (torch.randn(300_000, generator=generator) * 0.02).to(torch.bfloat16)}
    dcp.save(state, storage_writer=dcp.FileSystemWriter(tmp_path / "plain"), no_dist=True)
    floatsplit = transcode_checkpoint(str(tmp_path / "plain"), floatsplit_codec(),
                                      str(tmp_path / "fs"))
    zstd = transcode_checkpoint(str(tmp_path / "plain"), zstd_codec(), str(tmp_path / "z"))
    assert floatsplit.stored_bytes_after < 0.9 * zstd.stored_bytes_after


def test_verify_and_reshard_read_floatsplit(tmp_path):
    checkpoint = _compressed("fsdp2_adamw_3ranks", tmp_path)
    assert verify_checkpoint(checkpoint).problems == []
    out = tmp_path / "resharded"
    reshard_checkpoint(checkpoint, 2, str(out))
    assert {codec_for_descriptors(info.transform_descriptors).name for info in
            open_checkpoint(out).metadata.storage_data.values()} == {"floatsplit"}
    assert verify_checkpoint(out).problems == []


def test_convert_reads_floatsplit(tmp_path):
    name = "mesh2d_4ranks"
    convert_to_safetensors(_compressed(name, tmp_path), tmp_path / "out",
                           KeySelection(include=("*",)), threads=2)
    converted = load_file(tmp_path / "out" / "model.safetensors")
    assert {fqn: tensor_sha256(value) for fqn, value in converted.items()} == {
        fqn: described["sha256"] for fqn, described in MANIFEST[name]["tensors"].items()}


def _version_1_checkpoint(directory: Path) -> dict[str, torch.Tensor]:
    """A checkpoint whose items are the golden `dcpctl.floatsplit/1` streams, as an earlier
    dcpctl wrote them: a data file of the streams and a `.metadata` naming version 1."""
    from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, Metadata,
                                                       MetadataIndex, TensorProperties,
                                                       TensorStorageMetadata)
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    golden = Path(__file__).resolve().parents[1] / "format" / "codecs" / "golden"
    directory.mkdir()
    tensors, state_metadata, storage, data = {}, {}, {}, bytearray()
    for name in ("bfloat16", "float16", "float32", "int64"):
        tensor = torch.load(golden / f"{name}.item", weights_only=True)
        stream = (golden / f"{name}.floatsplit").read_bytes()
        tensors[name] = tensor
        chunk = ChunkStorageMetadata(offsets=torch.Size([0, 0]), sizes=tensor.size())
        state_metadata[name] = TensorStorageMetadata(
            properties=TensorProperties(dtype=tensor.dtype), size=tensor.size(), chunks=[chunk])
        storage[MetadataIndex(name, torch.Size([0, 0]))] = _StorageInfo(
            "__0_0.distcp", len(data), len(stream), transform_descriptors=["dcpctl.floatsplit/1"])
        data += stream
    (directory / "__0_0.distcp").write_bytes(bytes(data))
    metadata = Metadata(state_dict_metadata=state_metadata, storage_data=storage)
    (directory / ".metadata").write_bytes(pickle.dumps(metadata))
    return tensors


def test_a_version_1_checkpoint_still_reads_and_rewrites(tmp_path):
    """Checkpoints compressed by an earlier dcpctl (`dcpctl.floatsplit/1`) load through
    dcpctl's reader, verify, and decompress; compressing them again writes version 2."""
    tensors = _version_1_checkpoint(tmp_path / "v1")
    assert not verify_checkpoint(str(tmp_path / "v1")).problems
    state = {name: torch.empty_like(tensor) for name, tensor in tensors.items()}
    dcp.load(state, storage_reader=dcpctl.storage_reader(tmp_path / "v1"))
    for name, tensor in tensors.items():
        assert state[name].view(torch.uint8).equal(tensor.view(torch.uint8)), name
    transcode_checkpoint(tmp_path / "v1", IDENTITY, str(tmp_path / "plain"), threads=2)
    transcode_checkpoint(tmp_path / "v1", floatsplit_codec(), str(tmp_path / "v2"), threads=2)
    assert {tuple(info.transform_descriptors) for info in
            open_checkpoint(tmp_path / "v2").metadata.storage_data.values()} == {
        (FLOATSPLIT_DESCRIPTOR,)}
    for rewritten in ("plain", "v2"):
        loaded = {name: torch.empty_like(tensor) for name, tensor in tensors.items()}
        dcp.load(loaded, storage_reader=dcpctl.storage_reader(tmp_path / rewritten))
        for name, tensor in tensors.items():
            assert loaded[name].view(torch.uint8).equal(tensor.view(torch.uint8)), name


class _RunsCommand:
    def __init__(self, command: str) -> None:
        self.command = command

    def __reduce__(self):
        import os

        return (os.system, (self.command,))


def test_the_reader_refuses_a_hostile_metadata_before_torch_runs_it(tmp_path):
    """The local reader was torch's, whose read_metadata unpickles whatever it finds; the one
    for buckets checked `.metadata` with dcpctl's allowlist first."""
    from torch.distributed.checkpoint.api import CheckpointException

    import dcpctl

    marker = tmp_path / "ran"
    dcp.save({"w": torch.ones(2)}, checkpoint_id=tmp_path / "ck", no_dist=True)
    (tmp_path / "ck" / ".metadata").write_bytes(pickle.dumps(_RunsCommand(f"touch {marker}")))
    with pytest.raises(CheckpointException, match="not a DCP metadata class; refusing"):
        dcp.load({"w": torch.zeros(2)}, storage_reader=dcpctl.storage_reader(tmp_path / "ck"),
                 no_dist=True)
    assert not marker.exists()


@pytest.mark.parametrize("planted", ["../secret/__0_0.distcp", "{secret}/__0_0.distcp",
                                     "link.distcp"])
def test_the_reader_refuses_a_data_file_outside_the_checkpoint(tmp_path, planted):
    """The local reader handed `.metadata`'s data file names to torch's reader, which opened
    `../secret/__0_0.distcp`, an absolute path or a symlink out, and loaded that file's values;
    the reader for buckets refused them."""
    from torch.distributed.checkpoint.api import CheckpointException

    import dcpctl

    dcp.save({"w": torch.full((4,), 1000.0)}, checkpoint_id=tmp_path / "secret", no_dist=True)
    dcp.save({"w": torch.zeros(4)}, checkpoint_id=tmp_path / "ck", no_dist=True)
    (tmp_path / "ck" / "link.distcp").symlink_to(tmp_path / "secret" / "__0_0.distcp")
    metadata_path = tmp_path / "ck" / ".metadata"
    metadata = pickle.loads(metadata_path.read_bytes())
    for info in metadata.storage_data.values():
        info.relative_path = planted.format(secret=tmp_path / "secret")
    metadata_path.write_bytes(pickle.dumps(metadata))
    state = {"w": torch.zeros(4)}
    with pytest.raises(CheckpointException, match="outside the checkpoint directory|not a "
                                                  "plain path inside the checkpoint"):
        dcp.load(state, storage_reader=dcpctl.storage_reader(tmp_path / "ck"), no_dist=True)
    assert torch.equal(state["w"], torch.zeros(4))

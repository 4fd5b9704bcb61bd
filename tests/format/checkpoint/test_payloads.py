"""Reading stored chunks' payloads: in place, or decoded once (in memory or a spool file) for
items under a codec."""

from __future__ import annotations

import dataclasses
import io
import math
import os

import pytest
import torch
import zstandard
from conftest import fixture_path

from dcpctl.errors import DataError
from dcpctl.format.checkpoint.view import open_checkpoint
from dcpctl.format.codecs.registry import zstd_codec
from dcpctl.format.checkpoint.items import ItemLocation, locate_item, read_item
from dcpctl.format.checkpoint.payloads import PayloadReader


def first_tensor_item(name: str):
    checkpoint = open_checkpoint(fixture_path(name))
    tensor = next(t for t in checkpoint.tensors if math.prod(t.chunks[0].sizes) > 1)
    chunk = tensor.chunks[0]
    return (locate_item(checkpoint, tensor.fqn, chunk.storage, True),
            math.prod(chunk.sizes) * tensor.dtype.itemsize)


@pytest.mark.parametrize("name", ["fsdp2_adamw_3ranks", "zstd_fsdp2_2ranks"])
def test_payload_equals_what_torch_loads(tmp_path, name):
    location, nbytes = first_tensor_item(name)
    reader = PayloadReader(tmp_path, {location: 1})
    source = reader.source_of(location, False, nbytes)
    data = bytearray(nbytes)
    reader.read_into(source, 0, memoryview(data))
    loaded = torch.load(io.BytesIO(bytes(read_item(location))), weights_only=True)
    assert data == loaded.contiguous().view(torch.uint8).numpy().tobytes()
    reader.release(location)
    reader.close()


def test_small_item_under_a_codec_is_decoded_in_memory(tmp_path):
    location, nbytes = first_tensor_item("zstd_fsdp2_2ranks")
    reader = PayloadReader(tmp_path, {location: 1})
    source = reader.source_of(location, False, nbytes)
    assert source.path is None and len(source.data) == nbytes
    assert list(tmp_path.iterdir()) == []
    data = bytearray(nbytes)
    reader.read_into(source, 0, memoryview(data))
    loaded = torch.load(io.BytesIO(bytes(read_item(location))), weights_only=True)
    assert data == loaded.contiguous().view(torch.uint8).numpy().tobytes()


@pytest.mark.parametrize("memory_item_bytes", [0, 1 << 20])
def test_item_that_decodes_to_far_more_than_its_tensor_is_refused(tmp_path, memory_item_bytes):
    """torch saves tensors with storages of their own bytes; here a view kept its whole
    storage, 400 KB for a 16-byte tensor (a decompression bomb looks the same)."""
    archive = io.BytesIO()
    torch.save(torch.arange(100_000, dtype=torch.float32)[:4], archive)
    stored = zstandard.ZstdCompressor().compress(archive.getvalue())
    (tmp_path / "data.distcp").write_bytes(stored)
    location = ItemLocation("view", tmp_path / "data.distcp", 0, len(stored), zstd_codec())
    spool = tmp_path / "spool"
    spool.mkdir()
    reader = PayloadReader(spool, {location: 1}, memory_item_bytes)
    with pytest.raises(DataError, match=f"data.distcp: item 'view' at bytes 0..{len(stored)}: "
                                        f"decodes to more than {16 + 65536} bytes"):
        reader.source_of(location, False, 16)
    assert list(spool.iterdir()) == []  # no spool file left behind
    reader.close()


def test_spool_file_goes_with_the_last_user(tmp_path):
    location, nbytes = first_tensor_item("zstd_fsdp2_2ranks")
    reader = PayloadReader(tmp_path, {location: 2}, memory_item_bytes=0)
    first = reader.source_of(location, False, nbytes)
    assert reader.source_of(location, False, nbytes) == first  # decoded once
    assert list(tmp_path.iterdir()) == [first.path]
    reader.release(location)
    assert first.path.exists()
    reader.release(location)
    assert not first.path.exists()
    reader.close()


def test_payload_of_another_size_than_the_metadata_implies_is_refused(tmp_path):
    location, nbytes = first_tensor_item("fsdp2_adamw_3ranks")
    reader = PayloadReader(tmp_path, {location: 1})
    with pytest.raises(DataError, match=f"holds {nbytes} bytes of tensor data, the metadata "
                                        f"implies {nbytes + 4}"):
        reader.source_of(location, False, nbytes + 4)
    reader.close()


def test_payload_cut_short_is_refused_naming_where(tmp_path):
    location, nbytes = first_tensor_item("fsdp2_adamw_3ranks")
    copy = tmp_path / "data.distcp"
    copy.write_bytes(location.path.read_bytes())
    location = dataclasses.replace(location, path=copy)
    reader = PayloadReader(tmp_path / "spool", {location: 1})
    source = reader.source_of(location, False, nbytes)
    cut = source.offset + nbytes // 2
    os.truncate(copy, cut)
    with pytest.raises(DataError, match=f"{copy}: truncated at byte {cut}$"):
        reader.read_into(source, 0, memoryview(bytearray(nbytes)))
    reader.close()

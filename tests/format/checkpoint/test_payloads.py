"""Reading stored chunks' payloads: in place, or decoded once (in memory or a spool file) for
items under a codec, and laid out row-major for items saved as strided views."""

from __future__ import annotations

import dataclasses
import io
import math
import os
import re
import zlib

import pytest
import torch
import zstandard
from conftest import fixture_path, flip_bit

from dcpctl.errors import DataError
from dcpctl.format.checkpoint.items import read_item
from dcpctl.format.checkpoint.locations import ExpectedTensor, ItemLocation, locate_chunk
from dcpctl.format.checkpoint.payloads import PayloadReader
from dcpctl.format.checkpoint.view import open_checkpoint
from dcpctl.format.codecs.registry import zstd_codec
from dcpctl.format.dtypes import dtype_by_name
from dcpctl.format.torch_save.layout import max_tensor_archive_bytes


def first_tensor_item(name: str):
    """The location of a chunk of more than one element."""
    checkpoint = open_checkpoint(fixture_path(name))
    tensor = next(t for t in checkpoint.tensors if math.prod(t.chunks[0].sizes) > 1)
    return locate_chunk(checkpoint, tensor, tensor.chunks[0])


@pytest.mark.parametrize("name", ["fsdp2_adamw_3ranks", "zstd_fsdp2_2ranks"])
def test_payload_equals_what_torch_loads(tmp_path, name):
    location = first_tensor_item(name)
    nbytes = location.expected.nbytes
    reader = PayloadReader(tmp_path, {location: 1})
    source = reader.source_of(location)
    data = bytearray(nbytes)
    reader.read_into(source, 0, memoryview(data))
    loaded = torch.load(io.BytesIO(bytes(read_item(location))), weights_only=True)
    assert data == loaded.contiguous().view(torch.uint8).numpy().tobytes()
    reader.release(location)
    reader.close()


def _item_of_128_kib(directory):
    """The location of the one item of a checkpoint saved in directory: a 256 x 128 float32
    tensor."""
    import torch.distributed.checkpoint as dcp

    dcp.save({"weight": torch.randn(256, 128)}, storage_writer=dcp.FileSystemWriter(directory),
             no_dist=True)
    checkpoint = open_checkpoint(directory)
    tensor = checkpoint.tensors[0]
    return locate_chunk(checkpoint, tensor, tensor.chunks[0])


@pytest.mark.parametrize("users", [1, 3], ids=["read in place", "held in memory"])
def test_each_read_gives_the_crc_of_the_bytes_it_read(tmp_path, users):
    """A reshard's output chunk of exactly those bytes takes that CRC-32 for its own archive."""
    location = _item_of_128_kib(tmp_path / "ckpt")
    nbytes = location.expected.nbytes
    reader = PayloadReader(tmp_path, {location: users})
    source = reader.source_of(location)
    assert (source.data is None) == (users == 1)
    cuts = [0, nbytes // 3, nbytes - 5, nbytes]
    for begin, end in zip(cuts, cuts[1:]):
        out = bytearray(end - begin)
        assert reader.read_into(source, begin, memoryview(out)) == zlib.crc32(out)
    for _ in range(users):
        reader.release(location)
    reader.close()


@pytest.mark.parametrize("ranges", [[(0, 2), (2, 4)], [(1, 2), (2, 3)], [(0, 3), (1, 4)]],
                         ids=["read whole in halves", "ends never read", "ranges overlapping"])
def test_damage_in_an_item_held_in_memory_is_found_when_its_last_user_is_done(tmp_path, ranges):
    """The record of an item of several users is read once and served from memory; the CRC-32s
    of the ranges served, and of the bytes nobody took, must add up to the archive's."""
    location = _item_of_128_kib(tmp_path / "ckpt")
    spool = tmp_path / "spool"
    spool.mkdir()
    quarter = location.expected.nbytes // 4
    probe = PayloadReader(spool, {location: 2})
    payload_start = probe.source_of(location).offset
    probe.close()
    for damaged_quarter in range(4):
        flip_bit(location.path, payload_start + damaged_quarter * quarter + 1, 0x10)
        reader = PayloadReader(spool, {location: len(ranges)})
        source = reader.source_of(location)
        assert source.data is not None  # read once, held
        for begin, end in ranges:
            out = memoryview(bytearray((end - begin) * quarter))
            reader.read_into(source, begin * quarter, out)
        for _ in ranges[1:]:
            reader.release(location)
        with pytest.raises(DataError, match="does not match its CRC-32"):
            reader.release(location)
        reader.close()
        flip_bit(location.path, payload_start + damaged_quarter * quarter + 1, 0x10)
    reader = PayloadReader(spool, {location: len(ranges)})
    source = reader.source_of(location)
    for begin, end in ranges:
        reader.read_into(source, begin * quarter, memoryview(bytearray((end - begin) * quarter)))
    for _ in ranges:
        reader.release(location)  # undamaged: no error
    reader.close()


def test_an_item_held_in_memory_for_small_ranges_is_checked_whole_at_once(tmp_path):
    """Joining the CRC-32s of a hundred 1 KiB ranges would cost more than one pass over the
    record: it is checked when it is read, and its reads give no CRC-32."""
    location = _item_of_128_kib(tmp_path / "ckpt")
    spool = tmp_path / "spool"
    spool.mkdir()
    reader = PayloadReader(spool, {location: 128})
    source = reader.source_of(location)
    assert source.data is not None and source.crc is None
    assert reader.read_into(source, 0, memoryview(bytearray(1024))) is None
    reader.close()
    flip_bit(location.path, source.offset + 5000, 0x10)
    reader = PayloadReader(spool, {location: 128})
    with pytest.raises(DataError, match="does not match its CRC-32"):
        reader.source_of(location)
    reader.close()


def test_small_item_under_a_codec_is_decoded_in_memory(tmp_path):
    location = first_tensor_item("zstd_fsdp2_2ranks")
    nbytes = location.expected.nbytes
    reader = PayloadReader(tmp_path, {location: 1})
    source = reader.source_of(location)
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
    location = ItemLocation("view", tmp_path / "data.distcp", 0, len(stored), zstd_codec(),
                            ExpectedTensor(dtype_by_name("float32"), (4,)),
                            max_decoded_bytes=max_tensor_archive_bytes(16))
    spool = tmp_path / "spool"
    spool.mkdir()
    reader = PayloadReader(spool, {location: 1}, memory_item_bytes)
    with pytest.raises(DataError, match=f"data.distcp: item 'view' at bytes 0..{len(stored)}: "
                                        f"decodes to more than {16 + 65536} bytes"):
        reader.source_of(location)
    assert list(spool.iterdir()) == []  # no spool file left behind
    reader.close()


def test_spool_file_goes_with_the_last_user(tmp_path):
    location = first_tensor_item("zstd_fsdp2_2ranks")
    reader = PayloadReader(tmp_path, {location: 2}, memory_item_bytes=0)
    first = reader.source_of(location)
    assert reader.source_of(location) == first  # decoded once
    assert list(tmp_path.iterdir()) == [first.path]
    reader.release(location)
    assert first.path.exists()
    reader.release(location)
    assert not first.path.exists()
    reader.close()


def test_payload_of_another_dtype_or_shape_than_the_metadata_gives_is_refused(tmp_path):
    location = first_tensor_item("fsdp2_adamw_3ranks")
    dtype, sizes = location.expected.dtype, location.expected.sizes
    reader = PayloadReader(tmp_path)
    other_shape = (sizes[0] + 1, *sizes[1:])
    with pytest.raises(DataError, match=re.escape(
            f"holds a {dtype.name} tensor of shape {list(sizes)}, the metadata says "
            f"{dtype.name} {list(other_shape)}")):
        reader.source_of(dataclasses.replace(location,
                                             expected=ExpectedTensor(dtype, other_shape)))
    same_width = dtype_by_name("int32" if dtype.itemsize == 4 else "int16")
    with pytest.raises(DataError, match=f"the metadata says {same_width.name}"):
        reader.source_of(dataclasses.replace(location, expected=ExpectedTensor(same_width, sizes)))
    reader.close()


def test_payload_cut_short_is_refused_naming_where(tmp_path):
    location = first_tensor_item("fsdp2_adamw_3ranks")
    nbytes = location.expected.nbytes
    copy = tmp_path / "data.distcp"
    copy.write_bytes(location.path.read_bytes())
    location = dataclasses.replace(location, path=copy)
    reader = PayloadReader(tmp_path / "spool", {location: 1})
    source = reader.source_of(location)
    cut = source.offset + nbytes // 2
    os.truncate(copy, cut)
    with pytest.raises(DataError, match=f"{copy}: bytes {source.offset}..{source.offset + nbytes}"
                                        f": truncated: the file ends at byte {cut}$"):
        reader.read_into(source, 0, memoryview(bytearray(nbytes)))
    reader.close()


def _save_views(path, views: dict) -> None:
    """A checkpoint whose items hold these tensors with their own strides, as torch saves a
    dense view (a channels_last weight, a transposed one): it keeps the memory format."""
    import torch.distributed.checkpoint as dcp

    dcp.save(views, storage_writer=dcp.FileSystemWriter(path), no_dist=True)


STRIDED_VIEWS = {
    "transposed": torch.arange(6 * 700, dtype=torch.float32).reshape(6, 700).t(),
    "channels_last": torch.randn(8, 3, 5, 7).to(memory_format=torch.channels_last),
}


@pytest.mark.parametrize("memory_item_bytes", [0, 1 << 20])
@pytest.mark.parametrize("compressed", [False, True])
def test_strided_views_read_as_row_major_bytes(tmp_path, memory_item_bytes, compressed):
    checkpoint_dir = tmp_path / "ckpt"
    _save_views(checkpoint_dir, STRIDED_VIEWS)
    if compressed:
        from dcpctl.ops.transcode import transcode_checkpoint
        transcode_checkpoint(checkpoint_dir, zstd_codec())
    checkpoint = open_checkpoint(checkpoint_dir)
    spool = tmp_path / "spool"
    spool.mkdir()
    reader = PayloadReader(spool, memory_item_bytes=memory_item_bytes)
    for tensor in checkpoint.tensors:
        chunk = tensor.chunks[0]
        data = reader.read_chunk(locate_chunk(checkpoint, tensor, chunk)).data
        expected = STRIDED_VIEWS[tensor.fqn].contiguous().view(torch.uint8).numpy().tobytes()
        assert bytes(data) == expected, tensor.fqn
    assert list(spool.iterdir()) == []  # what was laid out went with its one user
    reader.close()

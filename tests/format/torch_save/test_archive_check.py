"""Checking archives streamed once front to back finds what random access finds."""

from __future__ import annotations

import contextlib
import io
import zlib

import pytest
import torch
from conftest import FIXTURE_NAMES, fixture_path
from test_zip_records import reader_of

from dcpctl.format.checkpoint.items import read_item
from dcpctl.format.checkpoint.locations import locate_chunk, locate_object
from dcpctl.format.checkpoint.view import SAFETENSORS, open_checkpoint
from dcpctl.format.torch_save.archive_check import (ArchiveStreamCheck, check_archive,
                                                    spooled_read_range)


def fixture_items():
    """(label, decoded bytes, is_tensor) of every torch.save item of the fixtures."""
    for name in FIXTURE_NAMES:
        checkpoint = open_checkpoint(fixture_path(name))
        for tensor in checkpoint.tensors:
            for chunk in tensor.chunks:
                if checkpoint.files[chunk.storage.relative_path].serialization != SAFETENSORS:
                    location = locate_chunk(checkpoint, tensor, chunk)
                    yield f"{name}:{tensor.fqn}", read_item(location), True
        for entry in checkpoint.objects:
            location = locate_object(checkpoint, entry)
            yield f"{name}:{entry.fqn}", read_item(location), False


def stream_check(data: bytes, expect_tensor: bool, piece_bytes: int, window_bytes: int):
    """Run the streamed check; also say whether it needed the random-access fallback."""
    fallbacks = []

    @contextlib.contextmanager
    def open_random_access():
        fallbacks.append(True)
        with spooled_read_range(iter([data])) as read_range:
            yield read_range

    check = ArchiveStreamCheck(window_bytes)
    for start in range(0, len(data), piece_bytes):
        check.update(data[start:start + piece_bytes])
    return check.finish(expect_tensor, open_random_access), bool(fallbacks)


def test_every_fixture_item_streams_clean():
    items = list(fixture_items())
    assert len(items) > 150
    for label, data, is_tensor in items:
        reference = check_archive(reader_of(data), len(data), is_tensor)
        assert reference.crc_mismatches == [] and reference.crc_recorded, label
        assert reference.layout_error is None and (reference.layout is not None) == is_tensor
        for piece_bytes, window_bytes in [(len(data), 1 << 18), (7, 1 << 18), (100, 700),
                                          (64, 64)]:
            streamed, _ = stream_check(data, is_tensor, piece_bytes, window_bytes)
            assert streamed == reference, (label, piece_bytes, window_bytes)


def _saved(tensor: torch.Tensor) -> bytes:
    buffer = io.BytesIO()
    torch.save(tensor, buffer)
    return buffer.getvalue()


LARGE = _saved(torch.randn(500_000))  # 2 MB of data between the windows


@pytest.mark.parametrize("window_bytes, expect_fallback", [(4096, False), (64, True)])
def test_large_archive_single_pass_and_fallback(window_bytes, expect_fallback):
    streamed, fell_back = stream_check(LARGE, True, 65_536, window_bytes)
    assert fell_back == expect_fallback
    assert streamed == check_archive(reader_of(LARGE), len(LARGE), True)
    assert streamed.crc_mismatches == [] and streamed.layout.tensor.shape == (500_000,)


@pytest.mark.parametrize("window_bytes", [4096, 64])
@pytest.mark.parametrize("where", [0.5, 0.999])
def test_flipped_bit_gives_the_record_and_its_actual_crc(window_bytes, where):
    damaged = bytearray(LARGE)
    layout = check_archive(reader_of(LARGE), len(LARGE), True).layout
    position = layout.storage.data_offset + int(layout.storage.size_bytes * where)
    damaged[position] ^= 0x10
    streamed, _ = stream_check(bytes(damaged), True, 65_536, window_bytes)
    [(record, actual_crc)] = streamed.crc_mismatches
    assert record.name == "archive/data/0"
    assert actual_crc == zlib.crc32(damaged[record.data_offset:record.data_end])
    assert streamed.layout is not None  # the data.pkl is intact


def test_archive_saved_without_crcs():
    torch.serialization.set_crc32_options(False)
    try:
        data = _saved(torch.arange(10.0))
    finally:
        torch.serialization.set_crc32_options(True)
    streamed, _ = stream_check(data, True, 100, 4096)
    assert not streamed.crc_recorded and streamed.crc_mismatches == []
    assert streamed.layout.tensor.shape == (10,)


def test_damaged_pickle_is_a_layout_error_beside_its_crc():
    data = bytearray(_saved(torch.arange(10.0)))
    data[data.index(b"_rebuild_tensor_v2")] ^= 1
    streamed, _ = stream_check(bytes(data), True, 100, 4096)
    assert "refusing to unpickle" in streamed.layout_error
    assert [record.name for record, _ in streamed.crc_mismatches] == ["archive/data.pkl"]

"""The layout of torch.save archives, read without torch, agrees with torch.load and zipfile."""

from __future__ import annotations

import io
import pickle
import random
import zipfile
import zlib

import pytest
import torch
from conftest import FIXTURE_NAMES, fixture_path
from test_zip_records import assert_record_agrees_with_zipfile, reader_of

from dcpctl.errors import DataError, UnsupportedLayoutError
from dcpctl.format.checkpoint.view import TORCH_SAVE, open_checkpoint
from dcpctl.format.torch_save.layout import parse_tensor_pickle, read_torch_save_layout


def saved(tensor: torch.Tensor) -> bytes:
    buffer = io.BytesIO()
    torch.save(tensor, buffer)
    return buffer.getvalue()


def storage_bytes(tensor: torch.Tensor) -> bytes:
    """The raw bytes of the tensor's whole storage."""
    return torch.empty(0, dtype=torch.uint8).set_(tensor.untyped_storage()).numpy().tobytes()


def assert_layout_matches_torch(data: bytes) -> None:
    reads = []

    def read_range(start: int, count: int) -> bytes:
        reads.append(count)
        return reader_of(data)(start, count)

    layout = read_torch_save_layout(read_range, len(data))
    assert_record_agrees_with_zipfile(data, layout.storage)
    loaded = torch.load(io.BytesIO(data), weights_only=True)
    tensor = layout.tensor
    assert repr(tensor.dtype) == str(loaded.dtype)
    assert (tensor.shape, tensor.stride, tensor.storage_offset) == (
        tuple(loaded.shape), loaded.stride(), loaded.storage_offset())
    assert tensor.is_contiguous == loaded.is_contiguous()
    assert tensor.nbytes == loaded.numel() * loaded.element_size()
    storage = storage_bytes(loaded)
    assert layout.storage.size_bytes == len(storage)
    assert data[layout.storage.data_offset:layout.storage.data_end] == storage
    if tensor.is_contiguous:
        first = loaded.storage_offset() * loaded.element_size()
        assert data[layout.payload_offset:layout.payload_offset + tensor.nbytes] == (
            storage[first:first + tensor.nbytes])
    # Only the archive's ends are read, never the tensor data in between.
    assert sum(reads) <= 2 * 4096 or len(data) <= 2 * 4096


def test_every_fixture_tensor_item():
    count = 0
    for name in FIXTURE_NAMES:
        checkpoint = open_checkpoint(fixture_path(name))
        for tensor in checkpoint.tensors:
            for chunk in tensor.chunks:
                info = chunk.storage
                data_file = checkpoint.files[info.relative_path]
                if info.transform_descriptors or data_file.serialization != TORCH_SAVE:
                    continue
                data = (checkpoint.path / info.relative_path).read_bytes()
                item = data[info.offset:info.offset + info.length]
                assert_layout_matches_torch(item)
                layout = read_torch_save_layout(reader_of(item), len(item))
                assert layout.tensor.shape == chunk.sizes
                assert layout.tensor.dtype == tensor.dtype
                count += 1
    assert count > 80


@pytest.mark.parametrize("make", [
    lambda: torch.arange(12.0).reshape(3, 4),
    lambda: torch.arange(12.0).reshape(3, 4).t(),  # column-major
    lambda: torch.arange(20, dtype=torch.int64)[5:9],  # a view: whole storage saved, offset 5
    lambda: torch.arange(24.0).reshape(2, 3, 4)[:, 1],  # strided view
    lambda: torch.tensor(3.5, dtype=torch.bfloat16),  # scalar
    lambda: torch.empty(0, 4),
    lambda: torch.tensor([True, False, True]),
    lambda: torch.randn(3, 2, dtype=torch.complex64),
    lambda: torch.arange(8, dtype=torch.float32).to(torch.float8_e4m3fn),  # _rebuild_tensor_v3
    lambda: torch.arange(8).to(torch.uint16),
    lambda: torch.randn(3000, 300),  # data past the first and last 4 KiB
])
def test_tensors_torch_saves(make):
    assert_layout_matches_torch(saved(make()))


def test_storage_offset_moves_the_payload():
    base = torch.arange(20, dtype=torch.int64)
    data = saved(base[5:9])
    layout = read_torch_save_layout(reader_of(data), len(data))
    assert layout.tensor.storage_offset == 5 and layout.tensor.storage_numel == 20
    assert data[layout.payload_offset:layout.payload_offset + 32] == base[5:9].numpy().tobytes()


def test_zip64_archive_as_torch_writes_it():
    """torch always writes the zip64 end records; the fixtures hold them too."""
    data = saved(torch.ones(10))
    assert b"PK\x06\x06" in data and b"PK\x06\x07" in data
    assert_layout_matches_torch(data)


class _Hostile:
    def __reduce__(self):
        import os
        return (os.system, ("echo should never run",))


@pytest.mark.parametrize("payload, message", [
    (pickle.dumps(_Hostile(), protocol=2), "refusing to unpickle"),
    (pickle.dumps({"a": 1}, protocol=2), "holds a dict, not one tensor"),
    (b"\x80\x02garbage", "holds pickle opcode GET at byte 2"),
    (b"\x80\x02h\x05.", "does not unpickle"),  # a memo entry never put
    # BYTEARRAY8 of 2**62 bytes: refused before Python tries to allocate it
    (b"\x80\x02\x96" + (2**62).to_bytes(8, "little") + b".", "opcode BYTEARRAY8 at byte 2"),
    (b"\x80\x05\x96\x01\x00\x00\x00\x00\x00\x00\x00x.", "opcode BYTEARRAY8 at byte 2"),
])
def test_pickles_other_than_one_tensor_are_refused(payload, message):
    with pytest.raises(DataError, match=message):
        parse_tensor_pickle(payload)


def test_object_archives_are_not_tensors():
    buffer = io.BytesIO()
    torch.save({"lr": 0.1}, buffer)
    data = buffer.getvalue()
    with pytest.raises(DataError, match="not one tensor"):
        read_torch_save_layout(reader_of(data), len(data))


def saved_without_crcs(tensor: torch.Tensor) -> bytes:
    """torch.save with its CRC-32s turned off (all zero), as it can be asked to."""
    torch.serialization.set_crc32_options(False)
    try:
        return saved(tensor)
    finally:
        torch.serialization.set_crc32_options(True)


def test_storage_record_of_the_wrong_size_is_refused():
    """The CRC-32 of data.pkl would catch the edit first: the archive carries none here, as
    torch.save writes it with CRC-32s turned off, so the record sizes are what refuse it."""
    data = saved_without_crcs(torch.arange(4.0))
    pickle_start = data.index(b"\x80\x02")
    damaged = data.replace(b"K\x04t", b"K\x05t", 1)  # storage numel 4 -> 5 in data.pkl
    assert damaged != data and damaged.index(b"\x80\x02") == pickle_start
    with pytest.raises(DataError, match="holds 16 bytes, but data.pkl says 5 elements"):
        read_torch_save_layout(reader_of(damaged), len(damaged))


def test_a_data_pkl_that_fails_its_crc_is_refused():
    data = saved(torch.arange(4.0))
    damaged = data.replace(b"K\x04t", b"K\x05t", 1)
    with pytest.raises(DataError, match="data.pkl' does not match its CRC-32"):
        read_torch_save_layout(reader_of(damaged), len(damaged))


def test_one_pickle_parsed_under_two_prefixes_names_two_storage_records():
    """Parses are shared between equal pickles, but never across archive prefixes."""
    with zipfile.ZipFile(io.BytesIO(saved(torch.ones(3)))) as archive:
        pickle_bytes = archive.read("archive/data.pkl")
    first = parse_tensor_pickle(pickle_bytes, "first/data/")
    second = parse_tensor_pickle(bytearray(pickle_bytes), "second/data/")
    assert (first.storage_record, second.storage_record) == ("first/data/0", "second/data/0")
    assert parse_tensor_pickle(pickle_bytes, "first/data/") == first


def test_missing_storage_record_is_refused_naming_it():
    data = saved(torch.arange(4.0))
    damaged = data.replace(b"archive/data/0", b"archive/data/9")  # local header and directory
    with pytest.raises(DataError, match="storage record 'archive/data/0', which the archive "
                                        "lacks"):
        read_torch_save_layout(reader_of(damaged), len(damaged))


def _fresh_layout_or_error(data: bytes):
    from dcpctl.format.torch_save import layout
    layout._layout_templates.clear()
    return _layout_or_error(data)


def _layout_or_error(data: bytes):
    try:
        return read_torch_save_layout(reader_of(data), len(data))
    except (DataError, UnsupportedLayoutError) as error:
        return str(error)


def test_an_archive_of_a_known_layout_is_matched_not_parsed_and_keeps_its_own_crc(monkeypatch):
    from dcpctl.format.torch_save import layout
    first = saved(torch.arange(3000, dtype=torch.bfloat16).reshape(30, 100))
    second = saved(torch.ones(30, 100, dtype=torch.bfloat16))
    expected = _fresh_layout_or_error(second)
    _fresh_layout_or_error(first)  # the layout is now known

    def no_parse(*args):
        raise AssertionError("the archive was parsed")

    monkeypatch.setattr(layout, "read_central_directory", no_parse)
    matched = read_torch_save_layout(reader_of(second), len(second))
    assert matched == expected
    assert matched.storage.crc32 == zlib.crc32(storage_bytes(torch.ones(30, 100,
                                                                        dtype=torch.bfloat16)))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_template_reads_any_damaged_archive_as_a_fresh_parse_does(dtype):
    """Random byte edits in a torch.save archive's records before its tensor data and in its
    central directory and end records, read once the undamaged archive's layout is known: the
    layout, or the refusal, is that of a parse that knows no layout."""
    good = saved(torch.randn(40, 50).to(dtype))
    storage = _fresh_layout_or_error(good).storage
    generator = random.Random(11)
    for _ in range(400):
        damaged = bytearray(good)
        position = generator.choice([generator.randrange(0, storage.data_offset),
                                     generator.randrange(storage.data_end, len(good))])
        damaged[position] = generator.choice([value for value in range(256)
                                              if value != good[position]])
        _fresh_layout_or_error(good)
        with_template = _layout_or_error(bytes(damaged))
        assert with_template == _fresh_layout_or_error(bytes(damaged)), position

"""Archives written without torch load in torch.load, and parse back with dcpctl's reader."""

from __future__ import annotations

import io
import math
import zipfile

import pytest
import torch

from dcpctl.format.dtypes import dtype_by_name
from dcpctl.format.torch_save.layout import find_payload_start, read_torch_save_layout
from dcpctl.format.torch_save.writer import (iter_torch_save_archive, rebuilt_tail, tail_fields,
                                             torch_save_archive)
from dcpctl.format.torch_save.zip_records import read_zip_records

CASES = [
    (torch.bfloat16, (2, 3)), (torch.float32, (70_000, 3)), (torch.int64, ()),
    (torch.bool, (0, 4)), (torch.float16, (5,)), (torch.float64, (3, 300, 2)),
    (torch.int8, (1, 1, 1)), (torch.complex64, (3,)), (torch.uint8, (513,)),
    # dtypes without a legacy storage class: torch.save writes _rebuild_tensor_v3 for them
    (torch.float8_e4m3fn, (4, 5)), (torch.float8_e5m2, (7,)), (torch.float8_e8m0fnu, (2, 2)),
    (torch.float4_e2m1fn_x2, (3, 2)), (torch.uint16, (9,)), (torch.uint32, (2, 3)),
    (torch.uint64, (70_000,)), (torch.complex32, (5,)),
]


def _sample(dtype, shape):
    if dtype.itemsize == 1 and dtype not in (torch.bool, torch.int8, torch.uint8):
        return torch.randint(0, 256, shape, dtype=torch.uint8).view(dtype)  # float8, float4
    if dtype in (torch.uint16, torch.uint32, torch.uint64, torch.complex32):
        return torch.randint(0, 256, (*shape, dtype.itemsize), dtype=torch.uint8).view(
            dtype).reshape(shape)
    if dtype == torch.bool:
        return torch.rand(shape) > 0.5
    if dtype.is_complex:
        return torch.randn(shape, dtype=dtype)
    return (torch.randn(shape) * 100).to(dtype)


@pytest.mark.parametrize("dtype,shape", CASES)
@pytest.mark.parametrize("piece_bytes", [1, 1000, 1 << 20])
def test_archive_loads_in_torch_equal(dtype, shape, piece_bytes):
    tensor = _sample(dtype, shape)
    payload = tensor.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    pieces = [payload[i:i + piece_bytes] for i in range(0, len(payload), piece_bytes)]
    data = b"".join(iter_torch_save_archive(dtype_by_name(str(dtype)), tuple(shape), pieces))
    loaded = torch.load(io.BytesIO(data), weights_only=True)
    assert loaded.dtype == dtype and loaded.shape == tensor.shape
    assert _bytes_of(loaded) == payload
    assert zipfile.ZipFile(io.BytesIO(data)).testzip() is None
    layout = read_torch_save_layout(lambda start, length: data[start:start + length], len(data))
    assert layout.tensor.shape == tuple(shape) and layout.payload_offset % 64 == 0
    assert data[layout.payload_offset:layout.payload_offset + len(payload)] == payload


def test_archive_has_torchs_size_for_a_small_tensor():
    tensor = torch.arange(6, dtype=torch.bfloat16).reshape(2, 3)
    reference = io.BytesIO()
    torch.save(tensor, reference)
    payload = tensor.view(torch.uint8).numpy().tobytes()
    ours = b"".join(iter_torch_save_archive(dtype_by_name("bfloat16"), (2, 3), [payload]))
    assert len(ours) == len(reference.getvalue())
    assert [i.filename for i in zipfile.ZipFile(io.BytesIO(ours)).infolist()] == [
        i.filename for i in zipfile.ZipFile(reference).infolist()]


@pytest.mark.parametrize("shape", [(0,), (3, 0), (2, 3)])
def test_archive_is_laid_out_as_torchs_for_empty_tensors_too(shape):
    """torch.save (miniz) ends an empty record with its header: no data descriptor, flag bit 3
    clear. One more descriptor than torch's moved every record after it, where torch's own
    reader works storage offsets out by its writer's layout (mmap loads)."""
    tensor = torch.arange(math.prod(shape), dtype=torch.float32).reshape(shape)
    reference = io.BytesIO()
    torch.save(tensor, reference)
    ours = b"".join(iter_torch_save_archive(dtype_by_name("float32"), shape,
                                            [tensor.numpy().tobytes()]))
    theirs = reference.getvalue()

    def layout(data: bytes) -> list[tuple]:
        """Each record's name, flags and the bytes between its data and the next header."""
        records = read_zip_records(lambda start, length: data[start:start + length], len(data))
        flags = {info.filename: info.flag_bits
                 for info in zipfile.ZipFile(io.BytesIO(data)).infolist()}
        return [(record.name, flags[record.name], following.header_offset - record.data_end)
                for record, following in zip(records, records[1:])]

    assert layout(ours) == layout(theirs)  # data.pkl aside (ours has no memo records)


def test_wrong_payload_size_is_refused():
    with pytest.raises(ValueError, match="payload of 3 bytes"):
        b"".join(iter_torch_save_archive(dtype_by_name("float32"), (2,), [b"abc"]))


@pytest.mark.parametrize("dtype,shape", CASES)
def test_archive_built_in_one_buffer_is_the_streamed_archive(dtype, shape):
    tensor = _sample(dtype, shape)
    payload = tensor.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    dtype_name = dtype_by_name(str(dtype))
    filled = []

    def fill(out: memoryview) -> None:
        filled.append(len(out))
        out[:] = payload

    archive = torch_save_archive(dtype_name, tuple(shape), fill)
    assert filled == [len(payload)]
    assert bytes(archive) == b"".join(iter_torch_save_archive(dtype_name, tuple(shape), [payload]))
    assert _bytes_of(torch.load(io.BytesIO(bytes(archive)), weights_only=True)) == payload


def _bytes_of(tensor: torch.Tensor) -> bytes:
    return tensor.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def _saved(tensor) -> tuple[bytes, int, bytes, int]:
    """torch.save's archive of tensor: its head (up to the storage's bytes), storage size, tail
    (after them), and the whole archive's length."""
    buffer = io.BytesIO()
    torch.save(tensor, buffer)
    archive = buffer.getvalue()
    start = find_payload_start(archive[:1 << 16])
    size = tensor.untyped_storage().nbytes()
    return archive[:start], size, archive[start + size:], len(archive)


@pytest.mark.parametrize("dtype,shape", CASES)
def test_torchs_own_tail_is_rebuilt_from_its_head_and_fields(dtype, shape):
    """What torch.save writes after a tensor's bytes, byte for byte, from the archive's head,
    the payload's size and the fields that vary (floatsplit version 2 stores just those)."""
    head, size, tail, _ = _saved(_sample(dtype, shape))
    fields = tail_fields(head, size, tail)
    assert fields is not None and fields.version == b"3\n"
    assert len(fields.serialization_id) == 40 and fields.serialization_id.isdigit()
    assert rebuilt_tail(head, size, fields) == tail


def test_the_writers_own_tails_are_rebuilt_and_end_as_torchs_do():
    """dcpctl's own archives (reshard's chunks) are laid out as torch lays them out after the
    tensor's bytes too, and their zip64 end record names the system torch's names (Unix, zip
    3.0); its data.pkl is torch's without the pickler's memo records."""
    tensor = _sample(torch.bfloat16, (40, 64))
    head, size, tail, _ = _saved(tensor)
    payload = tensor.view(torch.uint8).numpy().tobytes()
    ours = b"".join(iter_torch_save_archive(dtype_by_name("bfloat16"), (40, 64), [payload]))
    our_head = ours[:find_payload_start(ours[:1 << 16])]
    our_tail = ours[len(our_head) + size:]
    fields = tail_fields(our_head, size, our_tail)
    assert fields is not None and rebuilt_tail(our_head, size, fields) == our_tail
    zip64_end = tail.rindex(b"PK\x06\x06")
    our_zip64_end = our_tail.rindex(b"PK\x06\x06")
    assert our_tail[our_zip64_end:our_zip64_end + 16] == tail[zip64_end:zip64_end + 16]


def test_a_tail_that_is_not_torchs_layout_gives_no_fields():
    head, size, tail, _ = _saved(_sample(torch.float32, (300, 2)))
    for damaged in (tail[:-1], tail + b"\0", tail[:100] + b"X" + tail[101:],
                    tail.replace(b"3\n", b"4\n", 1)[:len(tail)] + b"", b""):
        fields = tail_fields(head, size, damaged)
        assert fields is None or rebuilt_tail(head, size, fields) == damaged
    assert tail_fields(head[:-1], size, tail) is None
    assert tail_fields(head, size + 1, tail) is None

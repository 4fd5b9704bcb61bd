"""Archives written without torch load in torch.load, and parse back with dcpctl's reader."""

from __future__ import annotations

import io
import zipfile

import pytest
import torch

from dcpctl.format.dtypes import dtype_by_name
from dcpctl.format.torch_save.layout import read_torch_save_layout
from dcpctl.format.torch_save.writer import iter_torch_save_archive, torch_save_archive

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

"""The floatsplit codec: bit-exact round trips of torch.save items, and damage it refuses."""

from __future__ import annotations

import io
import math
import struct

import numpy
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dcpctl.errors import DataError
from dcpctl.format.codecs.base import PayloadHint, iter_decoded, iter_encoded
from dcpctl.format.codecs.floatsplit.planes import (BFLOAT16, FLOAT16, FLOAT32, LAYOUTS_BY_CODE,
                                                    join_planes, split_planes)
from dcpctl.format.codecs.floatsplit.stream_format import (BYTES_BLOCK, END_BLOCK, FLOATS_BLOCK,
                                                           MAGIC, STREAM_HEADER)
from dcpctl.format.codecs.names import FLOATSPLIT_DESCRIPTOR, describe_codec
from dcpctl.format.codecs.registry import (DEFAULT_ZSTD_LEVEL, codec_for_descriptors,
                                           floatsplit_codec, zstd_codec)
from dcpctl.format.torch_save.layout import find_payload_start
from floatsplit_streams import block_structure

DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.float64, torch.complex32,
          torch.complex64, torch.complex128, torch.int64, torch.int32, torch.int16, torch.int8,
          torch.uint8, torch.bool, torch.float8_e4m3fn, torch.float8_e5m2]
SPECIAL_VALUES = [0.0, -0.0, math.inf, -math.inf, math.nan, 1e-45, -1e-310, 6e-8, 1e-40,
                  65504.0, 3.4e38, 1.0, -2.5]


def torch_save_bytes(tensor: torch.Tensor) -> bytes:
    archive = io.BytesIO()
    torch.save(tensor, archive)
    return archive.getvalue()


def hint_for(tensor: torch.Tensor) -> PayloadHint:
    return PayloadHint(str(tensor.dtype).removeprefix("torch."),
                       tensor.numel() * tensor.element_size())


def encode(item: bytes, hint: PayloadHint | None, piece_bytes: int,
           level: int = DEFAULT_ZSTD_LEVEL) -> bytes:
    encoder = floatsplit_codec(level).new_encoder(None, hint)
    pieces = [encoder.encode(item[start:start + piece_bytes])
              for start in range(0, len(item), piece_bytes)]
    return b"".join(pieces) + encoder.finish()


def decode(stream: bytes, piece_bytes: int) -> bytes:
    pieces = (stream[start:start + piece_bytes] for start in range(0, len(stream), piece_bytes))
    return b"".join(iter_decoded(floatsplit_codec().new_decoder(), pieces))


@st.composite
def tensors(draw) -> torch.Tensor:
    """Tensors of every dtype and small shape (0-d and empty too), from arbitrary bits (every
    NaN payload, infinity, -0.0 and subnormal is a bit pattern) or from special values."""
    dtype = draw(st.sampled_from(DTYPES))
    shape = tuple(draw(st.lists(st.integers(0, 9), min_size=0, max_size=3)))
    count = math.prod(shape)
    itemsize = torch.empty((), dtype=dtype).element_size()
    if dtype.is_floating_point and draw(st.booleans()):
        values = draw(st.lists(st.sampled_from(SPECIAL_VALUES), min_size=count, max_size=count))
        return torch.tensor(values, dtype=torch.float64).to(dtype).reshape(shape)
    raw = draw(st.binary(min_size=count * itemsize, max_size=count * itemsize))
    if dtype == torch.bool:
        raw = bytes(byte & 1 for byte in raw)
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(dtype).reshape(shape) \
        if raw else torch.empty(shape, dtype=dtype)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(tensor=tensors(), encode_piece=st.integers(1, 4096), decode_piece=st.integers(1, 4096))
def test_any_tensor_round_trips_to_the_bit(tensor, encode_piece, decode_piece):
    item = torch_save_bytes(tensor)
    stream = encode(item, hint_for(tensor), encode_piece)
    decoded = decode(stream, decode_piece)
    assert decoded == item
    loaded = torch.load(io.BytesIO(decoded), weights_only=True)
    assert loaded.dtype == tensor.dtype and loaded.shape == tensor.shape
    assert loaded.reshape(-1).view(torch.uint8).tolist() == \
        tensor.reshape(-1).view(torch.uint8).tolist()


@settings(max_examples=60, deadline=None)
@given(item=st.binary(max_size=3000), payload_bytes=st.integers(0, 5000),
       dtype_name=st.sampled_from(["bfloat16", "float32", "float64", "int8", "nonsense"]),
       piece=st.integers(1, 700))
def test_wrong_hints_and_foreign_bytes_still_round_trip(item, payload_bytes, dtype_name, piece):
    """The hint only steers compression: bytes that are no torch.save archive, or a hint that
    is too long, too short or of another dtype, decode to what was encoded."""
    stream = encode(item, PayloadHint(dtype_name, payload_bytes), piece)
    assert decode(stream, piece) == item


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_payload_across_many_blocks_and_odd_pieces(dtype):
    generator = torch.Generator().manual_seed(0)
    tensor = (torch.randn(1_500_001, generator=generator) * 0.02).to(dtype)
    item = torch_save_bytes(tensor)
    stream = encode(item, hint_for(tensor), piece_bytes=(1 << 20) + 3)
    assert stream.count(bytes((FLOATS_BLOCK,))) >= 2
    assert decode(stream, piece_bytes=999_983) == item


def test_bfloat16_weights_code_below_plain_zstd():
    generator = torch.Generator().manual_seed(1)
    tensor = (torch.randn(200_000, generator=generator) * 0.02).to(torch.bfloat16)
    item = torch_save_bytes(tensor)
    split = encode(item, hint_for(tensor), 1 << 22)
    plain = b"".join(iter_encoded(zstd_codec().new_encoder(len(item)), [item]))
    assert len(split) < 0.9 * len(plain)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
def test_the_stream_depends_on_the_item_alone(dtype):
    """Blocks are cut where the item's bytes say: the same stream whatever pieces the item
    arrives in, and whether the caller knows the tensor (compress, from the metadata) or the
    encoder reads it from data.pkl (torch's writer, through the extension)."""
    generator = torch.Generator().manual_seed(2)
    tensor = (torch.randn(2_300_001, generator=generator) * 0.02).to(dtype)
    item = torch_save_bytes(tensor)
    known = encode(item, hint_for(tensor), len(item))
    assert known.count(bytes((FLOATS_BLOCK,))) >= 2
    for piece_bytes in (1, 7, 4093, 999_983, (4 << 20) + 1):
        if piece_bytes < 4093:
            head = encode(item[:70_000], None, piece_bytes)
            assert head == encode(item[:70_000], None, len(item)), piece_bytes
            continue
        assert encode(item, None, piece_bytes) == known, piece_bytes
        assert encode(item, hint_for(tensor), piece_bytes) == known, piece_bytes


_ARCHIVE = torch_save_bytes((torch.randn(20_000) * 0.02).to(torch.bfloat16))


@settings(max_examples=200, deadline=None)
@given(edits=st.lists(st.tuples(st.integers(0, 800), st.integers(0, 255)), min_size=1,
                      max_size=8),
       piece=st.integers(1, 5000))
def test_a_damaged_archive_head_without_a_hint_still_round_trips(edits, piece):
    """The encoder reads data.pkl from the item itself when no hint is given: whatever the
    head's records, names, descriptors or pickle hold, it never fails and never loses a
    byte (the head only steers compression)."""
    item = bytearray(_ARCHIVE)
    for position, value in edits:
        item[position] = value
    stream = encode(bytes(item), None, piece)
    assert decode(stream, 4096) == bytes(item)


def test_without_a_hint_only_a_tensor_archive_is_split():
    """A torch.save of anything but one tensor (an object, a tensor inside a list), and an
    archive whose data.pkl fails its CRC-32, are coded as plain bytes and decode unchanged."""
    tensor = torch.randn(50_000).to(torch.bfloat16)
    damaged = bytearray(torch_save_bytes(tensor))
    pickle_at = damaged.index(b"data.pkl") + len(b"data.pkl") + 20
    damaged[pickle_at] ^= 0x01
    for item in (torch_save_bytes([tensor]), torch_save_bytes({"step": 3, "w": tensor}),
                 bytes(damaged)):
        stream = encode(item, None, 65_537)
        assert {block[0] for block in block_structure(stream)} == {BYTES_BLOCK, END_BLOCK}
        assert decode(stream, 4096) == item
    split = block_structure(encode(torch_save_bytes(tensor), None, 65_537))
    assert [block[:3] for block in split if block[0] == FLOATS_BLOCK] == [
        (FLOATS_BLOCK, BFLOAT16.code, 50_000)]


def test_view_with_a_larger_storage_round_trips():
    """torch.save writes a view's whole storage; the hint covers only the view's elements."""
    base = torch.randn(1000).to(torch.bfloat16)
    view = base[100:400]
    item = torch_save_bytes(view)
    assert decode(encode(item, hint_for(view), 100), 77) == item


@pytest.mark.parametrize("layout", list(LAYOUTS_BY_CODE.values()), ids=lambda layout: layout.name)
def test_planes_join_back_and_hold_the_exponent_apart(layout):
    data = numpy.random.default_rng(0).integers(0, 256, 64 * layout.itemsize,
                                                dtype=numpy.uint8).tobytes()
    planes = [plane.copy() for plane in split_planes(layout, data)]
    joined = bytearray(len(data))
    join_planes(layout, [bytes(plane) for plane in planes], joined)
    assert bytes(joined) == data
    if layout.name in ("bfloat16", "float32"):
        exponent_shift = 7 if layout.itemsize == 2 else 23
        words = numpy.frombuffer(data, dtype=layout.word_type)
        exponents = ((words >> exponent_shift) & 0xFF).astype(numpy.uint8)
        rotated = ((exponents >> 1) | ((exponents & 1) << 7)).astype(numpy.uint8)
        assert planes[0].tolist() == rotated.tolist()


@settings(max_examples=80, deadline=None)
@given(code=st.sampled_from(sorted(LAYOUTS_BY_CODE)), count=st.integers(0, 5000),
       seed=st.integers(0, 2**32 - 1), writable=st.booleans())
def test_any_bytes_split_and_join_back(code, count, seed, writable):
    """Planes given as read-only bytes (raw planes where they lie in the stream) or as arrays
    the join may change (decoded planes in scratch memory) join back to the same words."""
    layout = LAYOUTS_BY_CODE[code]
    data = numpy.random.default_rng(seed).integers(0, 256, count * layout.itemsize,
                                                   dtype=numpy.uint8).tobytes()
    planes = [plane.copy() if writable else bytes(plane) for plane in split_planes(layout, data)]
    joined = numpy.empty(len(data), dtype=numpy.uint8)
    join_planes(layout, planes, joined)
    assert joined.tobytes() == data


def _layout_codes(stream: bytes) -> list[int]:
    """The layout of every FLOATS block of a stream."""
    return [block[1] for block in block_structure(stream) if block[0] == FLOATS_BLOCK]


@pytest.mark.parametrize("dtype, signs, layout_code", [
    (torch.bfloat16, "positive", FLOAT16.code), (torch.bfloat16, "negative", FLOAT16.code),
    (torch.bfloat16, "mixed", BFLOAT16.code), (torch.float32, "positive", FLOAT32.code)])
def test_blocks_of_one_sign_skip_the_exchange_where_a_layout_allows(dtype, signs, layout_code):
    """Layout 2 splits any 2-byte words without the exchange: bfloat16 blocks whose elements
    all have one sign (an optimizer's second moments) are written with it."""
    values = torch.randn(300_000, generator=torch.Generator().manual_seed(3)) * 0.02
    values = {"positive": values.abs(), "negative": -values.abs(), "mixed": values}[signs]
    tensor = values.to(dtype)
    item = torch_save_bytes(tensor)
    stream = encode(item, hint_for(tensor), 1 << 20)
    assert set(_layout_codes(stream)) == {layout_code}
    assert decode(stream, 65_537) == item


def test_pieces_a_caller_reuses_are_read_before_they_change():
    tensor = (torch.randn(1_500_001, generator=torch.Generator().manual_seed(4)) * 0.02).to(
        torch.float32)
    item = torch_save_bytes(tensor)
    stream = encode(item, hint_for(tensor), 1 << 20)
    decoder, piece, decoded = floatsplit_codec().new_decoder(), bytearray(4093), []
    for start in range(0, len(stream), len(piece)):
        chunk = stream[start:start + len(piece)]
        piece[:len(chunk)] = chunk
        decoded += [bytes(part) for part in decoder.decode(memoryview(piece)[:len(chunk)])]
        piece[:] = b"\xee" * len(piece)
    decoder.finish()
    assert b"".join(decoded) == item


def test_payload_start_is_the_data_record():
    item = torch_save_bytes(torch.arange(10, dtype=torch.float32))
    start = find_payload_start(item[:4096])
    assert start % 64 == 0
    assert item[start:start + 40] == torch.arange(10, dtype=torch.float32).numpy().tobytes()
    assert find_payload_start(item[:start - 1]) is None


def test_descriptor_resolves_to_the_codec():
    assert codec_for_descriptors([FLOATSPLIT_DESCRIPTOR]).name == "floatsplit"
    assert codec_for_descriptors(["dcpctl.floatsplit/1.2"]).name == "floatsplit"
    assert codec_for_descriptors(["dcpctl.floatsplit/1"]).name == "floatsplit"
    assert describe_codec([FLOATSPLIT_DESCRIPTOR]) == "floatsplit"
    assert describe_codec(["dcpctl.floatsplit/1"]) == "floatsplit"
    assert describe_codec(["dcpctl.floatsplit/3"]) == "dcpctl.floatsplit/3"
    assert describe_codec(["stream.zstd/2"]) == "stream.zstd/2"
    # A version 1 item keeps its own descriptor: recoding it is not taken for a copy.
    assert codec_for_descriptors(["dcpctl.floatsplit/1"]).descriptors == ("dcpctl.floatsplit/1",)


def _stream_of_a_tensor() -> bytes:
    tensor = torch.randn(300).to(torch.bfloat16)
    return encode(torch_save_bytes(tensor), hint_for(tensor), 1 << 20)


@pytest.mark.parametrize("damage, message", [
    (lambda stream: stream[:-1], "cut short"),
    (lambda stream: stream[:len(stream) // 2], "cut short"),
    (lambda stream: stream + b"\0", "bytes follow the end"),
    (lambda stream: b"XXXX" + stream[4:], "not a floatsplit stream"),
    (lambda stream: stream[:4] + b"\x07" + stream[5:], "unknown block kind 7"),
    (lambda stream: stream[:5] + b"\x09" + stream[6:], "unknown stream coding 9"),
    (lambda stream: stream[:6] + struct.pack("<I", 1 << 30) + stream[10:], "more than"),
    (lambda stream: stream[:-8] + struct.pack("<Q", 12345), "end block counts 12345"),
])
def test_damaged_streams_are_refused(damage, message):
    stream = damage(_stream_of_a_tensor())
    with pytest.raises(DataError, match=message):
        decode(stream, 1 << 20)


def test_frame_claiming_another_length_than_its_header_is_refused():
    """Caught before zstd allocates what the frame claims (the first block is decoded before
    the end block, which would disagree too, arrives)."""
    stream = _stream_of_a_tensor()
    decoded_bytes, stored_bytes = struct.unpack_from("<II", stream, 6)
    damaged = stream[:6] + struct.pack("<I", decoded_bytes + 1) + stream[10:]
    block_end = len(MAGIC) + 1 + STREAM_HEADER.size + stored_bytes
    pieces = [damaged[:block_end], damaged[block_end:]]
    with pytest.raises(DataError, match="a zstd frame claims"):
        list(iter_decoded(floatsplit_codec().new_decoder(), pieces))


def test_damaged_zstd_frame_is_refused():
    stream = bytearray(_stream_of_a_tensor())
    frame_start = stream.find(b"\x28\xb5\x2f\xfd")
    stream[frame_start + 12:frame_start + 20] = b"\xff" * 8
    with pytest.raises(DataError, match="floatsplit stream damaged"):
        decode(bytes(stream), 1 << 20)

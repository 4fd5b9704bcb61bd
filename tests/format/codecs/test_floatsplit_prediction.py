"""floatsplit version 2: PREDICTED blocks (prediction.py), the framing dictionary, and the
damage a version 2 decoder refuses."""

from __future__ import annotations

import hashlib
import struct

import numpy
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dcpctl.errors import DataError
from dcpctl.format.codecs.base import PayloadHint, iter_decoded, iter_encoded
from dcpctl.format.codecs.floatsplit.framing_dictionary_v2 import DICTIONARY, SHA256
from dcpctl.format.codecs.floatsplit.planes import BFLOAT16, FLOAT16, FLOAT32
from dcpctl.format.codecs.floatsplit.prediction import (PREDICTED_LAYOUTS, join_predicted,
                                                        predict, split_predicted)
from dcpctl.format.codecs.floatsplit.stream_format import (BYTES_BLOCK, DICTIONARY_CODING,
                                                           END_BLOCK, END_HEADER, FLOATS_BLOCK,
                                                           MAGIC, MAGIC_V2, PREDICTED_BLOCK,
                                                           PREDICTED_HEADER, STREAM_HEADER,
                                                           TAIL_BLOCK, TAIL_HEADER)
from dcpctl.format.codecs.registry import floatsplit_codec
from floatsplit_streams import block_starts, block_structure
from test_floatsplit import decode, encode, torch_save_bytes

LAYOUTS = [BFLOAT16, FLOAT16, FLOAT32]
TORCH_DTYPES = {BFLOAT16.code: torch.bfloat16, FLOAT16.code: torch.float16,
                FLOAT32.code: torch.float32}


def hint_with_rows(tensor: torch.Tensor) -> PayloadHint:
    return PayloadHint.of_contiguous(str(tensor.dtype).removeprefix("torch."),
                                     tensor.element_size(), tensor.shape)


def scaled_weights(shape: tuple[int, int], dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """Gaussian weights whose rows and columns have scales of their own over a few octaves,
    as trained matrices (and Adam's moments of them) have."""
    generator = torch.Generator().manual_seed(seed)
    rows = 2.0 ** (torch.rand(shape[0], 1, generator=generator, dtype=torch.float64) * 4 - 2)
    columns = 2.0 ** (torch.rand(1, shape[1], generator=generator, dtype=torch.float64) * 6 - 3)
    values = torch.randn(shape, generator=generator, dtype=torch.float64) * 0.02
    return (values * rows * columns).to(dtype)


def _join(layout, row_length: int, prediction, parts, readonly: bool) -> bytes:
    streams = [bytes(stream) if readonly else stream.copy()
               for stream in prediction.streams() + parts.streams()]
    out = numpy.empty(len(parts.residuals) * layout.itemsize, dtype=numpy.uint8)
    join_predicted(layout, row_length, streams, out)
    return out.tobytes()


@settings(max_examples=150, deadline=None)
@given(code=st.sampled_from(sorted(PREDICTED_LAYOUTS)), rows=st.integers(1, 40),
       row_length=st.integers(1, 70), seed=st.integers(0, 2**32 - 1),
       kind=st.sampled_from(["bits", "scaled", "zeros", "mixed"]), readonly=st.booleans())
def test_any_block_splits_and_joins_back_to_the_bit(code, rows, row_length, seed, kind,
                                                    readonly):
    """Arbitrary bit patterns (NaNs with payloads, infinities, subnormals, -0.0), scaled
    weights, all zeros, and weights with arbitrary words mixed in join back exactly: whatever
    does not fit a residual byte is escaped."""
    layout = PREDICTED_LAYOUTS[code]
    rng = numpy.random.default_rng(seed)
    count = rows * row_length
    if kind == "bits":
        data = rng.integers(0, 256, count * layout.itemsize, dtype=numpy.uint8).tobytes()
    elif kind == "zeros":
        data = bytes(count * layout.itemsize)
    else:
        tensor = scaled_weights((rows, row_length), TORCH_DTYPES[code], seed % 1000)
        words = tensor.reshape(-1).view(torch.uint8).numpy().copy()
        if kind == "mixed":
            replaced = rng.integers(0, count, max(1, count // 10))
            noise = rng.integers(0, 256, count * layout.itemsize, dtype=numpy.uint8)
            for index in replaced:
                span = slice(index * layout.itemsize, (index + 1) * layout.itemsize)
                words[span] = noise[span]
        data = words.tobytes()
    prediction = predict(layout, data, row_length)
    parts = split_predicted(layout, data, row_length, prediction)
    assert _join(layout, row_length, prediction, parts, readonly) == data


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda layout: layout.name)
def test_scaled_weights_code_smaller_predicted_than_split(layout):
    """Where rows and columns have their own scales, the encoder picks PREDICTED blocks, and
    they store smaller than version 1's planes of the same bytes."""
    tensor = scaled_weights((512, 384), TORCH_DTYPES[layout.code])
    item = torch_save_bytes(tensor)
    predicted = encode(item, hint_with_rows(tensor), 1 << 20)
    split = encode(item, PayloadHint(hint_with_rows(tensor).dtype_name, tensor.nbytes), 1 << 20)
    assert {block[0] for block in block_structure(predicted)} == {
        BYTES_BLOCK, PREDICTED_BLOCK, TAIL_BLOCK, END_BLOCK}
    assert FLOATS_BLOCK in {block[0] for block in block_structure(split)}
    assert len(predicted) < 0.98 * len(split)
    assert decode(predicted, 65_537) == item


def test_the_fast_level_predicts_nothing_and_keeps_small_tensors_whole():
    """Level 1 codes for speed: the blocks a prediction would pay for are split as in version
    1, and a tensor under 16 KiB goes whole into one dictionary-coded BYTES block; both decode
    to the item, a little larger than at the default level."""
    tensor = scaled_weights((512, 384), torch.bfloat16)
    item = torch_save_bytes(tensor)
    stream = encode(item, hint_with_rows(tensor), 1 << 20, level=1)
    assert {block[0] for block in block_structure(stream)} == {
        BYTES_BLOCK, FLOATS_BLOCK, TAIL_BLOCK, END_BLOCK}
    assert len(encode(item, hint_with_rows(tensor), 1 << 20)) < 0.98 * len(stream)
    assert decode(stream, 4099) == item
    small = scaled_weights((40, 100), torch.bfloat16)  # 8,000 bytes
    small_item = torch_save_bytes(small)
    small_stream = encode(small_item, hint_with_rows(small), 1 << 20, level=1)
    assert [block[0] for block in block_structure(small_stream)] == [BYTES_BLOCK, END_BLOCK]
    assert decode(small_stream, 4099) == small_item


def test_words_without_structure_stay_split():
    """A block whose residuals would code no smaller than the planes (random words) is split
    as in version 1: a prediction never makes a block larger by its side data."""
    words = numpy.random.default_rng(5).integers(0, 2**16, (256, 300), dtype=numpy.uint16)
    tensor = torch.from_numpy(words.view(numpy.int16)).view(torch.bfloat16)
    item = torch_save_bytes(tensor)
    stream = encode(item, hint_with_rows(tensor), 1 << 20)
    assert PREDICTED_BLOCK not in {block[0] for block in block_structure(stream)}
    assert decode(stream, 4099) == item


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_a_predicted_stream_depends_on_the_item_alone(dtype):
    """Blocks of whole rows are cut where the item's bytes say: the same stream whatever pieces
    the item arrives in, and whether the row length comes from the metadata (compress) or from
    data.pkl (torch's writer through the extension)."""
    tensor = scaled_weights((3000, 1000), dtype, seed=3)
    item = torch_save_bytes(tensor)
    known = encode(item, hint_with_rows(tensor), len(item))
    blocks = [block for block in block_structure(known) if block[0] == PREDICTED_BLOCK]
    assert len(blocks) >= 2 and all(block[3] == 1000 for block in blocks)
    assert sum(block[2] for block in blocks) == tensor.numel()
    for piece_bytes in (4093, 999_983, (4 << 20) + 1):
        assert encode(item, None, piece_bytes) == known, piece_bytes
        assert encode(item, hint_with_rows(tensor), piece_bytes) == known, piece_bytes
    assert decode(known, 999_983) == item


def test_views_and_transposes_are_not_taken_for_rows():
    """data.pkl of a view (an offset, other strides) gives no rows: the elements are split as
    in version 1, and decode unchanged."""
    base = scaled_weights((400, 300), torch.bfloat16)
    for tensor in (base.t(), base[10:]):
        item = torch_save_bytes(tensor)
        stream = encode(item, None, 1 << 20)
        assert PREDICTED_BLOCK not in {block[0] for block in block_structure(stream)}
        assert decode(stream, 1 << 20) == item


def test_the_framing_dictionary_is_the_one_version_2_names():
    """Streams name the dictionary by their version alone: its bytes may never change."""
    assert hashlib.sha256(DICTIONARY).hexdigest() == SHA256
    assert SHA256 == "18cf1db07432098fdd93be164e8df5788e246fb6f1294ab852e6f8a7c5387084"


def test_framing_codes_to_tens_of_bytes():
    """torch.save's framing before the tensor's bytes (704 bytes), coded with the dictionary,
    and after them (873 bytes), a TAIL block of the fields that vary: tens of bytes each, where
    plain zstd leaves hundreds."""
    tensor = scaled_weights((128, 384), torch.bfloat16)
    item = torch_save_bytes(tensor)
    stream = encode(item, hint_with_rows(tensor), 1 << 20)
    blocks = block_structure(stream)
    assert blocks[0][:2] == (BYTES_BLOCK, (DICTIONARY_CODING, 704))
    assert blocks[-2][0] == TAIL_BLOCK
    head_stored = STREAM_HEADER.unpack_from(stream, len(MAGIC_V2) + 1)[2]
    tail_start = dict(block_starts(stream))[TAIL_BLOCK]
    assert head_stored < 80
    assert len(stream) - END_HEADER.size - tail_start < 40
    assert decode(stream, 333) == item


def _predicted_tensor() -> torch.Tensor:
    """Scaled weights with elements far above their row's and column's scale, which no residual
    byte holds (unless their own weight moves the prediction close enough), and a subnormal and
    a zero, which a residual byte holds."""
    tensor = scaled_weights((64, 300), torch.bfloat16)
    tensor[3, 4] = 3e38
    tensor[5, 6] = -2e38
    tensor[7, 8] = 1e-39
    tensor[9, 10] = 0
    return tensor


def _predicted_stream() -> tuple[bytes, int]:
    """A stream of one PREDICTED block with escaped elements, and where that block starts."""
    tensor = _predicted_tensor()
    stream = encode(torch_save_bytes(tensor), hint_with_rows(tensor), 1 << 20)
    return stream, stream.index(bytes((PREDICTED_BLOCK, BFLOAT16.code)))


def _with_header(stream: bytes, start: int, **fields) -> bytes:
    kind, code, elements, row_length, escaped = PREDICTED_HEADER.unpack_from(stream, start)
    values = {"code": code, "elements": elements, "row_length": row_length, "escaped": escaped,
              **fields}
    header = PREDICTED_HEADER.pack(kind, values["code"], values["elements"],
                                   values["row_length"], values["escaped"])
    return stream[:start] + header + stream[start + PREDICTED_HEADER.size:]


def test_the_predicted_test_stream_has_escapes():
    stream, start = _predicted_stream()
    assert PREDICTED_HEADER.unpack_from(stream, start)[4] >= 1
    assert decode(stream, 999) == torch_save_bytes(_predicted_tensor())


@pytest.mark.parametrize("fields, message", [
    ({"code": 4}, "unknown predicted float layout 4"),
    ({"row_length": 0}, "has rows of 0"),
    ({"row_length": 7}, "has rows of 7"),
    ({"escaped": 1 << 30}, "escaped elements"),
    ({"escaped": 0}, r"sub-stream holds \d+ bytes, not 0"),
    ({"row_length": 150}, "holds 300 bytes, not 150"),
])
def test_damaged_predicted_headers_are_refused(fields, message):
    stream, start = _predicted_stream()
    with pytest.raises(DataError, match=message):
        decode(_with_header(stream, start, **fields), 1 << 20)


def test_an_escape_count_the_residuals_deny_is_refused():
    """The header's escaped count and the stored escaped elements agree, but the residuals hold
    another number of escape bytes."""
    stream, start = _predicted_stream()
    escaped = PREDICTED_HEADER.unpack_from(stream, start)[4]
    position = start + PREDICTED_HEADER.size
    for _ in range(2):  # past the column and row predictions
        position += STREAM_HEADER.size + STREAM_HEADER.unpack_from(stream, position)[2]
    header_at = position
    coding, decoded, stored = STREAM_HEADER.unpack_from(stream, header_at)
    residuals = numpy.frombuffer(decode_sub_stream(stream, header_at), dtype=numpy.uint8).copy()
    residuals[residuals == 0] = 128
    damaged = (stream[:header_at] + STREAM_HEADER.pack(0, decoded, decoded)
               + residuals.tobytes() + stream[header_at + STREAM_HEADER.size + stored:])
    assert escaped >= 1
    with pytest.raises(DataError, match=f"escapes 0 elements and holds {escaped}"):
        decode(damaged, 1 << 20)


def decode_sub_stream(stream: bytes, header_at: int) -> bytes:
    import zstandard

    coding, decoded, stored = STREAM_HEADER.unpack_from(stream, header_at)
    data = stream[header_at + STREAM_HEADER.size:header_at + STREAM_HEADER.size + stored]
    return data if coding == 0 else zstandard.ZstdDecompressor().decompress(data)


def test_version_2_blocks_and_codings_are_refused_in_a_version_1_stream():
    stream, start = _predicted_stream()
    as_version_1 = MAGIC + stream[len(MAGIC_V2):]
    with pytest.raises(DataError, match="unknown stream coding 2"):
        decode(as_version_1, 1 << 20)
    plain = MAGIC + bytes((BYTES_BLOCK,)) + STREAM_HEADER.pack(0, 1, 1) + b"x"
    with pytest.raises(DataError, match="unknown block kind 3 in a version 1 stream"):
        decode(plain + stream[start:], 1 << 20)


def test_a_version_2_stream_cut_anywhere_is_refused():
    stream, _ = _predicted_stream()
    for cut in range(1, len(stream), max(1, len(stream) // 60)):
        with pytest.raises(DataError):
            decode(stream[:cut], 997)


def test_the_codec_writes_version_2_with_its_descriptor():
    assert floatsplit_codec().descriptors == ("dcpctl.floatsplit/2",)
    tensor = scaled_weights((64, 300), torch.float16)
    item = torch_save_bytes(tensor)
    stream = b"".join(iter_encoded(floatsplit_codec().new_encoder(len(item),
                                                                  hint_with_rows(tensor)), [item]))
    assert stream[:4] == MAGIC_V2
    assert b"".join(iter_decoded(floatsplit_codec().new_decoder(), [stream])) == item
    assert struct.unpack_from("<Q", stream, len(stream) - 8)[0] == len(item)


def test_a_tail_block_without_the_archive_it_ends_is_refused():
    """A TAIL block stands for the end of the archive whose head is the stream's first block:
    first in a stream, after bytes too short for a zip record or that are none, or with an id of
    more digits than it says, it is damage (refused where it lies), never bytes made up."""
    stream, _ = _predicted_stream()
    tail_start = dict(block_starts(stream))[TAIL_BLOCK]
    tail = stream[tail_start:len(stream) - END_HEADER.size]
    end = END_HEADER.pack(END_BLOCK, 0)
    plain = bytes((BYTES_BLOCK,)) + STREAM_HEADER.pack(0, 3, 3) + b"abc"
    no_zip = bytes((BYTES_BLOCK,)) + STREAM_HEADER.pack(0, 40, 40) + b"x" * 40
    for damaged in (MAGIC_V2 + tail + end, MAGIC_V2 + plain + tail + end,
                    MAGIC_V2 + no_zip + tail + end):
        with pytest.raises(DataError, match="a tail block that follows no torch.save archive"):
            decode(damaged, 1 << 20)
    kind, crc, version_bytes, digits, value_bytes = TAIL_HEADER.unpack_from(tail)
    too_few_digits = TAIL_HEADER.pack(kind, crc, version_bytes, 5, value_bytes) + \
        tail[TAIL_HEADER.size:]
    with pytest.raises(DataError, match="a tail block that follows no torch.save archive"):
        decode(stream[:tail_start] + too_few_digits + stream[len(stream) - END_HEADER.size:],
               1 << 20)
    # a bit flipped in the version record's data, which no CRC-32 covers in the stream: the
    # record rebuilt with it (and a CRC-32 of its own) decoded, exit 0, as torch never wrote it
    version_at = tail_start + TAIL_HEADER.size
    assert stream[version_at:version_at + version_bytes] == b"3\n"
    for flipped in (b"\x13\n", b"3\x0b", b"#\n"):  # 0x33 ^ 0x20, 0x0a ^ 0x01, 0x33 ^ 0x10
        damaged = stream[:version_at] + flipped + stream[version_at + version_bytes:]
        with pytest.raises(DataError, match="or with a version record torch.save does not "
                                            "write"):
            decode(damaged, 1 << 20)

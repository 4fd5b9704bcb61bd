"""floatsplit streams written once, kept byte for byte, must decode forever.

golden/ holds version 1 (`dcpctl.floatsplit/1`): for small tensors of each float dtype (and a
non-float one, and a pickled object), the item as torch saved it (`<name>.item`) and the stream
dcpctl encoded it to (`<name>.floatsplit`). dcpctl writes version 2 now; a decoder change that
breaks version 1 fails here.

golden/v2/ holds version 2 (`dcpctl.floatsplit/2`) streams of the same items and of tensors
whose rows and columns have scales of their own, with zeros and subnormals among them (so that
PREDICTED blocks, escaped elements and the framing dictionary are all exercised). A decoder
change that breaks version 2 fails here, and so does an encoder whose streams no longer have the
same blocks (kinds, headers, sub-stream codings and lengths): zstd's own compressed bytes may
vary between zstandard releases, the stream format may not.

The files are written once, by `python tests/format/codecs/test_floatsplit_golden.py --write`
(version 2 files only, and only where missing); never rewrite them for their version (a new
version gets files of its own).
"""

from __future__ import annotations

import io
import sys
from pathlib import Path

import pytest

from dcpctl.format.codecs.base import PayloadHint, iter_decoded, iter_encoded
from dcpctl.format.codecs.floatsplit.stream_format import (FLOATS_BLOCK, PREDICTED_BLOCK,
                                                           TAIL_BLOCK)
from dcpctl.format.codecs.registry import floatsplit_codec
from floatsplit_streams import block_structure, stream_version

GOLDEN_DIR = Path(__file__).parent / "golden"
V2_DIR = GOLDEN_DIR / "v2"
ITEMSIZES = {"bfloat16": 2, "float16": 2, "float32": 4, "float64": 8, "complex64": 8,
             "int64": 8}
# name -> (dtype, shape) of the tensors; "object" is a pickled Python object.
ITEMS = {
    "bfloat16": ("bfloat16", (96, 128)),
    "float16": ("float16", (96, 128)),
    "float32": ("float32", (48, 128)),
    "float64": ("float64", (24, 128)),
    "complex64": ("complex64", (24, 128)),
    "int64": ("int64", (24, 128)),
    "object": (None, None),
}
# Version 2 only: tensors with row and column scales, zeros and subnormals.
SCALED_ITEMS = {
    "bfloat16_scaled": ("bfloat16", (128, 96)),
    "float16_scaled": ("float16", (128, 96)),
    "float32_scaled": ("float32", (64, 96)),
}
V2_ITEMS = {**ITEMS, **SCALED_ITEMS}


def _item_path(name: str) -> Path:
    return (GOLDEN_DIR if name in ITEMS else V2_DIR) / f"{name}.item"


def _encode(item: bytes, name: str) -> bytes:
    dtype, shape = V2_ITEMS[name]
    hint = None
    if dtype is not None:
        hint = PayloadHint.of_contiguous(dtype, ITEMSIZES[dtype], shape)
    return b"".join(iter_encoded(floatsplit_codec().new_encoder(len(item), hint), [item]))


def _decode(stream: bytes, piece_bytes: int) -> bytes:
    pieces = [stream[start:start + piece_bytes] for start in range(0, len(stream), piece_bytes)]
    return b"".join(iter_decoded(floatsplit_codec().new_decoder(), pieces))


@pytest.mark.parametrize("name", sorted(ITEMS))
@pytest.mark.parametrize("piece_bytes", [1, 4099, 1 << 22])
def test_version_1_streams_decode_to_their_items(name, piece_bytes):
    item = (GOLDEN_DIR / f"{name}.item").read_bytes()
    stream = (GOLDEN_DIR / f"{name}.floatsplit").read_bytes()
    assert stream_version(stream) == 1
    assert _decode(stream, piece_bytes) == item


@pytest.mark.parametrize("name", sorted(V2_ITEMS))
@pytest.mark.parametrize("piece_bytes", [1, 4099, 1 << 22])
def test_version_2_streams_decode_to_their_items(name, piece_bytes):
    item = _item_path(name).read_bytes()
    stream = (V2_DIR / f"{name}.floatsplit").read_bytes()
    assert stream_version(stream) == 2
    assert _decode(stream, piece_bytes) == item


@pytest.mark.parametrize("name", sorted(V2_ITEMS))
def test_the_encoder_writes_the_golden_version_2_blocks(name):
    item = _item_path(name).read_bytes()
    golden = (V2_DIR / f"{name}.floatsplit").read_bytes()
    stream = _encode(item, name)
    assert block_structure(stream) == block_structure(golden)
    assert _decode(stream, 1 << 22) == item


def _float_blocks(directory: Path, name: str) -> list[tuple]:
    return [block for block in block_structure((directory / f"{name}.floatsplit").read_bytes())
            if block[0] in (FLOATS_BLOCK, PREDICTED_BLOCK)]


def test_version_1_items_are_split_into_planes():
    """The golden items exercise what version 1 is for: float blocks of each layout."""
    layouts = {name: {block[1] for block in _float_blocks(GOLDEN_DIR, name)} for name in ITEMS}
    assert layouts["bfloat16"] == {1} and layouts["float16"] == {2}
    assert layouts["float32"] <= {1, 3} and layouts["float32"]  # bfloat16's split is float32's
    assert layouts["float64"] and layouts["complex64"]
    assert layouts["int64"] == set() and layouts["object"] == set()


def test_version_2_items_exercise_predicted_blocks_and_escapes():
    """The scaled items are coded as PREDICTED blocks of each layout, some with escaped
    elements; the framing is coded with the dictionary (coding 2) before a tensor's bytes and as
    a TAIL block after them."""
    for name, layout_code in (("bfloat16_scaled", 1), ("float16_scaled", 2),
                              ("float32_scaled", 3)):
        blocks = _float_blocks(V2_DIR, name)
        assert [block[:2] for block in blocks] == [(PREDICTED_BLOCK, layout_code)], name
    assert any(block[4] for name in SCALED_ITEMS for block in _float_blocks(V2_DIR, name))
    framing = block_structure((V2_DIR / "object.floatsplit").read_bytes())[0]
    assert framing[1][0] == 2
    for name in ("bfloat16", "float16", "float32", *SCALED_ITEMS):
        assert block_structure((V2_DIR / f"{name}.floatsplit").read_bytes())[-2][0] == TAIL_BLOCK


def _scaled_tensor(dtype: str, shape: tuple[int, int]):
    """Gaussian values scaled by row and by column over a few octaves, with exact zeros and,
    for float16, subnormals: what a predicted block must carry element for element."""
    import torch

    generator = torch.Generator().manual_seed(2027)
    rows = torch.logspace(-2, 1, shape[0], base=2.0, dtype=torch.float64)
    columns = torch.logspace(-3, 3, shape[1], base=2.0, dtype=torch.float64)
    values = torch.randn(shape, generator=generator, dtype=torch.float64) * 0.02
    values = values * rows[:, None] * columns[None, :]
    values[3, :] = 0
    values[:, 5] = 0
    values[7, 9] = 1e-7 if dtype == "float16" else 1e-30
    values[11, 13] = 6e4 if dtype == "float16" else 3e38
    return values.to(getattr(torch, dtype))


def _write_golden_files() -> None:
    import torch

    V2_DIR.mkdir(exist_ok=True)
    for name, (dtype, shape) in SCALED_ITEMS.items():
        if not _item_path(name).exists():
            buffer = io.BytesIO()
            torch.save(_scaled_tensor(dtype, shape), buffer)
            _item_path(name).write_bytes(buffer.getvalue())
    for name in V2_ITEMS:
        stream_path = V2_DIR / f"{name}.floatsplit"
        if not stream_path.exists():
            stream_path.write_bytes(_encode(_item_path(name).read_bytes(), name))


if __name__ == "__main__" and sys.argv[1:] == ["--write"]:
    _write_golden_files()

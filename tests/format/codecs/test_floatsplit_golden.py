"""`dcpctl.floatsplit/1` streams written once, kept byte for byte, must decode forever.

golden/ holds, for small tensors of each float dtype (and a non-float one, and a pickled
object), the item as torch saved it (`<name>.item`) and the floatsplit stream dcpctl encoded it
to (`<name>.floatsplit`). A change to the decoder that breaks version 1 fails here, and so does
an encoder whose streams no longer have the same blocks (kinds, float layouts, element counts,
sub-stream codings and lengths): zstd's own compressed bytes may vary between zstandard
releases, the stream format may not.

The files are written once, by `python tests/format/codecs/test_floatsplit_golden.py --write`;
never rewrite them for version 1 (a new version gets files of its own).
"""

from __future__ import annotations

import io
import sys
from pathlib import Path

import pytest

from dcpctl.format.codecs.base import PayloadHint, iter_decoded, iter_encoded
from dcpctl.format.codecs.floatsplit.stream_format import FLOATS_BLOCK
from dcpctl.format.codecs.registry import floatsplit_codec
from floatsplit_streams import block_structure

GOLDEN_DIR = Path(__file__).parent / "golden"
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


def _encode(item: bytes, name: str) -> bytes:
    dtype, shape = ITEMS[name]
    hint = None
    if dtype is not None:
        itemsize = {"bfloat16": 2, "float16": 2, "float32": 4, "float64": 8, "complex64": 8,
                    "int64": 8}[dtype]
        hint = PayloadHint(dtype, itemsize * shape[0] * shape[1])
    return b"".join(iter_encoded(floatsplit_codec().new_encoder(len(item), hint), [item]))


def _decode(stream: bytes, piece_bytes: int) -> bytes:
    pieces = [stream[start:start + piece_bytes] for start in range(0, len(stream), piece_bytes)]
    return b"".join(iter_decoded(floatsplit_codec().new_decoder(), pieces))


@pytest.mark.parametrize("name", sorted(ITEMS))
@pytest.mark.parametrize("piece_bytes", [1, 4099, 1 << 22])
def test_golden_streams_decode_to_their_items(name, piece_bytes):
    item = (GOLDEN_DIR / f"{name}.item").read_bytes()
    stream = (GOLDEN_DIR / f"{name}.floatsplit").read_bytes()
    assert _decode(stream, piece_bytes) == item


@pytest.mark.parametrize("name", sorted(ITEMS))
def test_the_encoder_writes_the_golden_blocks(name):
    item = (GOLDEN_DIR / f"{name}.item").read_bytes()
    golden = (GOLDEN_DIR / f"{name}.floatsplit").read_bytes()
    stream = _encode(item, name)
    assert block_structure(stream) == block_structure(golden)
    assert _decode(stream, 1 << 22) == item


def test_float_items_are_split_into_planes():
    """The golden items exercise what version 1 is for: float blocks of each layout."""
    layouts = {name: {block[1] for block in block_structure(
        (GOLDEN_DIR / f"{name}.floatsplit").read_bytes()) if block[0] == FLOATS_BLOCK}
        for name in ITEMS}
    assert layouts["bfloat16"] == {1} and layouts["float16"] == {2}
    assert layouts["float32"] <= {1, 3} and layouts["float32"]  # bfloat16's split is float32's
    assert layouts["float64"] and layouts["complex64"]
    assert layouts["int64"] == set() and layouts["object"] == set()


def _write_golden_files() -> None:
    import torch

    GOLDEN_DIR.mkdir(exist_ok=True)
    generator = torch.Generator().manual_seed(2026)
    for name, (dtype, shape) in ITEMS.items():
        buffer = io.BytesIO()
        if dtype is None:
            torch.save({"step": 1000, "lr": 3e-4, "names": ["a", "b"]}, buffer)
        elif dtype == "int64":
            torch.save(torch.randint(-1000, 1000, shape, generator=generator), buffer)
        else:
            values = torch.randn(shape, generator=generator, dtype=torch.float64) * 0.02
            torch.save(values.to(getattr(torch, dtype)), buffer)
        item = buffer.getvalue()
        (GOLDEN_DIR / f"{name}.item").write_bytes(item)
        (GOLDEN_DIR / f"{name}.floatsplit").write_bytes(_encode(item, name))


if __name__ == "__main__" and sys.argv[1:] == ["--write"]:
    _write_golden_files()

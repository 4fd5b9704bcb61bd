"""Every single-bit flip of a torch.save item, anywhere in it (payload, data.pkl, local headers,
central directory, end records), is either caught by dcpctl's checks or harmless: torch's own
loader then reads the same value. No CRC-32 covers the zip structures, so this holds only if
every field torch's reader acts on is checked.

Both ways dcpctl reads an item are tried: the check every command makes of an item it streams
(verify, compress, checksum), and the chunk payload reader (reshard, convert), which may read
past damage to records it does not use but must then read the right values.
"""

from __future__ import annotations

import io
import warnings

import pytest
import torch

from dcpctl.errors import DcpctlError
from dcpctl.format.checkpoint.item_check import ItemCheck
from dcpctl.format.checkpoint.locations import ExpectedTensor, ItemLocation
from dcpctl.format.checkpoint.payloads import PayloadReader
from dcpctl.format.codecs.registry import IDENTITY
from dcpctl.format.dtypes import DTYPES_BY_NAME

pytestmark = pytest.mark.slow  # some 25,000 flips

ITEMS = {
    "tensor": torch.arange(12, dtype=torch.float32).reshape(3, 4),
    "object": {"step": 3, "lr": 0.1, "name": "run"},
}


def _saved(value) -> bytes:
    stream = io.BytesIO()
    torch.save(value, stream)
    return stream.getvalue()


def _torch_reads(data: bytes):
    """What torch's DCP reader gets from the item (torch.load, weights_only), or None."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception:
        return None


def _same(expected, loaded) -> bool:
    if isinstance(expected, torch.Tensor):
        return (isinstance(loaded, torch.Tensor) and loaded.dtype == expected.dtype
                and loaded.shape == expected.shape and not loaded.is_conj()
                and not loaded.is_neg() and torch.equal(
                    loaded.contiguous().view(torch.uint8), expected.view(torch.uint8)))
    return type(loaded) is type(expected) and loaded == expected


def _item_check_passes(location: ItemLocation, data: bytes) -> bool:
    check = ItemCheck(location)
    try:
        check.feed(data)
    except DcpctlError:  # refused as it went by (an item that starts like no archive)
        return False
    return not check.problems(lambda: [data])


def _payload_reads(location: ItemLocation, spool, users: int) -> list[bytes] | None:
    """What each of `users` users of the item reads (an item of several is read whole, once,
    and served from memory), or None if the reader refuses it."""
    reader = PayloadReader(spool, {location: users})
    try:
        return [bytes(reader.read_chunk(location).data) for _ in range(users)]
    except DcpctlError:
        return None
    finally:
        reader.close()


@pytest.mark.parametrize("kind", sorted(ITEMS))
def test_every_bit_flip_is_caught_or_harmless(kind, tmp_path):
    value = ITEMS[kind]
    good = _saved(value)
    path, spool = tmp_path / "item", tmp_path / "spool"
    spool.mkdir()
    expected = (ExpectedTensor(DTYPES_BY_NAME["float32"], tuple(value.shape))
                if kind == "tensor" else None)
    location = ItemLocation(kind, path, 0, len(good), IDENTITY, expected)
    path.write_bytes(good)
    assert _item_check_passes(location, good)
    missed = []
    for position in range(len(good)):
        for bit in range(8):
            damaged = bytearray(good)
            damaged[position] ^= 1 << bit
            damaged = bytes(damaged)
            path.write_bytes(damaged)
            loaded = _torch_reads(damaged)
            harmless = loaded is not None and _same(value, loaded)
            if not harmless and _item_check_passes(location, damaged):
                missed.append(f"byte {position} bit {bit}: the item check passes")
            if expected is not None:  # what it reads, if it reads, must be the values
                for users in (1, 2):
                    payloads = _payload_reads(location, spool, users)
                    if payloads is not None and payloads != [value.numpy().tobytes()] * users:
                        missed.append(f"byte {position} bit {bit}: the payload reader passes "
                                      f"({users} users)")
    assert not missed, f"{len(missed)} flips missed, the first: {missed[:5]}"

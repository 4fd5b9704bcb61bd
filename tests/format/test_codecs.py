"""Decoding readers stay bounded in memory and turn bad frames into DataError."""

from __future__ import annotations

import io

import pytest

from dcpctl.errors import DataError
from dcpctl.format.codecs import IDENTITY, zstd_codec


def _compressed(data: bytes) -> bytes:
    encoder = zstd_codec().new_encoder()
    return encoder.encode(data) + encoder.finish()


def test_reads_return_at_most_what_they_ask_for():
    zeros = bytes(64 << 20)
    frame = _compressed(zeros)
    assert len(frame) < 10_000  # 64 MiB of zeros in a few KiB
    reader = zstd_codec().open_reader(io.BytesIO(frame))
    sizes = []
    while piece := reader.read(1 << 20):
        sizes.append(len(piece))
    assert max(sizes) <= 1 << 20 and sum(sizes) == len(zeros)


def test_identity_reader_is_the_stored_stream():
    stored = io.BytesIO(b"abc")
    assert IDENTITY.open_reader(stored) is stored


def test_corrupt_frame_is_a_data_error():
    frame = bytearray(_compressed(bytes(1 << 20) + b"tail"))
    frame[len(frame) // 2] ^= 0xFF
    reader = zstd_codec().open_reader(io.BytesIO(bytes(frame)))
    with pytest.raises(DataError, match="zstd frame does not decode"):
        while reader.read(1 << 16):
            pass

"""Decoding stays bounded in memory and turns bad frames into DataError."""

from __future__ import annotations

import io
import os

import pytest
import zstandard

from dcpctl.errors import DataError
from dcpctl.format.codecs.base import PieceStream, iter_decoded
from dcpctl.format.codecs.registry import IDENTITY, zstd_codec


def _compressed(data: bytes) -> bytes:
    encoder = zstd_codec().new_encoder()
    return encoder.encode(data) + encoder.finish()


def _decoded(stored: bytes, max_bytes: int | None = None, piece_bytes: int = 1 << 16):
    pieces = (stored[start:start + piece_bytes] for start in range(0, len(stored), piece_bytes))
    return iter_decoded(zstd_codec().new_decoder(), pieces, max_bytes)


def test_decoding_stops_past_the_bytes_an_item_may_hold():
    frame = _compressed(bytes(64 << 20))
    decoded = 0
    with pytest.raises(DataError, match="decodes to more than 1000000 bytes"):
        for piece in _decoded(frame, max_bytes=1_000_000):
            decoded += len(piece)
    assert decoded <= 1_000_000  # nothing past the bound was handed out
    assert sum(map(len, _decoded(frame, max_bytes=64 << 20))) == 64 << 20


def test_identity_decodes_to_the_stored_bytes():
    assert b"".join(iter_decoded(IDENTITY.new_decoder(), [b"ab", b"c"])) == b"abc"


def test_corrupt_frame_is_a_data_error():
    frame = bytearray(_compressed(bytes(1 << 20) + b"tail"))
    frame[len(frame) // 2] ^= 0xFF
    # the flipped byte breaks the frame's block structure or its contents, as it falls
    with pytest.raises(DataError, match="zstd frame (does not decode|is cut short)"):
        for _ in _decoded(bytes(frame)):
            pass


@pytest.mark.parametrize("read_bytes", [1, 1000, 1 << 20])
def test_piece_stream_gives_at_most_what_is_asked_and_every_byte_once(read_bytes):
    data = bytes(range(256)) * 3000 + bytes(1 << 20)
    stream = io.BufferedReader(PieceStream(_decoded(_compressed(data))), read_bytes)
    pieces = list(iter(lambda: stream.read1(read_bytes), b""))
    assert all(len(piece) <= read_bytes for piece in pieces)
    assert b"".join(pieces) == data


def _decode_in_pieces(data: bytes, piece_bytes: int) -> list[bytes]:
    decoder = zstd_codec().new_decoder()
    out = [decoded for start in range(0, len(data), piece_bytes)
           for decoded in decoder.decode(data[start:start + piece_bytes])]
    decoder.finish()
    return out


@pytest.mark.parametrize("compressor", [
    zstandard.ZstdCompressor(level=3),
    zstandard.ZstdCompressor(level=1, write_checksum=True),
    zstandard.ZstdCompressor(level=19, write_content_size=False),
])
@pytest.mark.parametrize("piece_bytes", [1, 5, 4096, 1 << 22])
def test_decoder_gives_back_every_byte_whatever_the_piece_size(compressor, piece_bytes):
    original = os.urandom(300_000) + bytes(range(256)) * 2_000 + bytes(500_000)
    pieces = _decode_in_pieces(compressor.compress(original), piece_bytes)
    assert b"".join(pieces) == original


def test_decoded_pieces_stay_small_however_well_the_item_compressed():
    zeros = zstandard.ZstdCompressor(level=3).compress(bytes(64 << 20))
    assert len(zeros) < 100_000
    pieces = _decode_in_pieces(zeros, 4 << 20)
    assert sum(map(len, pieces)) == 64 << 20
    assert max(map(len, pieces)) <= 128 << 10


@pytest.mark.parametrize("damage,message", [
    (lambda data: data[:-1], "cut short"),
    (lambda data: data[:len(data) // 2], "cut short"),
    (lambda data: data + b"\x00", "bytes follow"),
    (lambda data: b"\x00" + data[1:], "do not start a zstd frame"),
])
def test_damaged_frames_are_data_errors(damage, message):
    data = zstandard.ZstdCompressor(level=3, write_checksum=True).compress(os.urandom(200_000))
    with pytest.raises(DataError, match=message):
        _decode_in_pieces(damage(data), 65536)


@pytest.mark.parametrize("size_bytes", [0, 1, 300_000])
@pytest.mark.parametrize("given_whole", [True, False])
def test_zstd_encoder_makes_one_frame_whole_or_in_pieces(size_bytes, given_whole):
    data = bytes(range(256)) * (size_bytes // 256) + b"x" * (size_bytes % 256)
    for known_size in (size_bytes, None):
        for _ in range(2):  # the second item reuses the first one's compressor
            encoder = zstd_codec(3).new_encoder(known_size)
            pieces = ([data] if given_whole else
                      [data[start:start + 7000] for start in range(0, size_bytes, 7000)])
            frame = b"".join([encoder.encode(piece) for piece in pieces] + [encoder.finish()])
            parameters = zstandard.get_frame_parameters(frame)
            assert parameters.content_size == (
                size_bytes if known_size is not None else zstandard.CONTENTSIZE_UNKNOWN)
            assert parameters.has_checksum  # any zstd reader checks what it decodes
            assert zstandard.ZstdDecompressor().decompressobj().decompress(frame) == data


def test_zstd_encoder_refuses_bytes_past_the_size_it_was_given():
    encoder = zstd_codec(3).new_encoder(4)
    encoder.encode(b"abcd")
    with pytest.raises(ValueError, match="more bytes than the item's size"):
        encoder.encode(b"e")

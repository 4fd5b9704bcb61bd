"""Byte planes coded as zstd frames: what any zstd decoder reads back, and when they stay raw."""

from __future__ import annotations

import numpy
import pytest
import zstandard

from dcpctl.format.codecs.floatsplit.plane_zstd import PlaneCompressor, literal_coding_available

CODERS = [pytest.param(True, id="literal-and-matching",
                       marks=pytest.mark.skipif(not literal_coding_available(),
                                                reason="zstandard's cffi backend is missing")),
          pytest.param(False, id="matching-only")]


def exponent_like_plane(count: int, seed: int = 0) -> numpy.ndarray:
    """Bytes with a few frequent values, as the exponents of weights have."""
    values = numpy.random.default_rng(seed).normal(0, 0.02, count).astype(numpy.float32)
    return ((values.view(numpy.uint32) >> 23) & 0xFF).astype(numpy.uint8)


def runs_plane(count: int) -> numpy.ndarray:
    """Long runs of zeros between exponent-like stretches, as sparse optimizer states have."""
    plane = exponent_like_plane(count, seed=1)
    for start in range(0, count, 4096):
        plane[start:start + 3072] = 0
    return plane


@pytest.mark.parametrize("literal_coding", CODERS)
@pytest.mark.parametrize("count", [5000, 40_000, 300_000, 2_000_000])
def test_planes_code_to_standard_frames_that_record_their_size(literal_coding, count):
    compressor = PlaneCompressor(literal_coding)
    for plane in (exponent_like_plane(count), runs_plane(count)):
        frame = compressor.compress(plane, 0.03)
        assert frame is not None and len(frame) < 0.6 * count
        parameters = zstandard.get_frame_parameters(frame)
        assert parameters.content_size == count and not parameters.has_checksum
        assert zstandard.ZstdDecompressor().decompress(frame) == plane.tobytes()


@pytest.mark.parametrize("literal_coding", CODERS)
@pytest.mark.parametrize("count", [5000, 300_000])
def test_random_planes_stay_raw(literal_coding, count):
    plane = numpy.random.default_rng(2).integers(0, 256, count, dtype=numpy.uint8)
    assert PlaneCompressor(literal_coding).compress(plane, 0.03) is None


@pytest.mark.skipif(not literal_coding_available(), reason="zstandard's cffi backend is missing")
def test_matches_are_used_where_they_pay_and_only_there():
    compressor = PlaneCompressor(True)
    literal_only = PlaneCompressor(True)._literal
    runs = runs_plane(1_000_000)
    assert len(compressor.compress(runs, 0.03)) < 0.5 * len(literal_only.compress(runs))
    exponents = exponent_like_plane(1_000_000)
    assert bytes(compressor.compress(exponents, 0.03)) == bytes(literal_only.compress(exponents))

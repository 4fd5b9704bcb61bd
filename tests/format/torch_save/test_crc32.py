"""The CRC-32 of a span from running CRCs agrees with zlib."""

from __future__ import annotations

import random
import zlib

from dcpctl.format.torch_save.crc32 import crc32_of_span, shift_crc32


def test_span_crc_matches_zlib_everywhere():
    generator = random.Random(7)
    data = generator.randbytes(50_000)
    cuts = [(0, 0), (0, len(data)), (len(data), len(data)), (1, 2)]
    cuts += [tuple(sorted(generator.sample(range(len(data) + 1), 2))) for _ in range(300)]
    for start, end in cuts:
        crc_before, crc_through = zlib.crc32(data[:start]), zlib.crc32(data[:end])
        assert crc32_of_span(crc_before, crc_through, end - start) == zlib.crc32(data[start:end])


def test_shift_over_long_spans_matches_zlib():
    """crc32(A + zeros(n)) = shift(crc(A), n) ^ crc32(zeros(n)), for spans up to 64 MiB."""
    for length in (1, 1000, 65_537, (4 << 20) + 3, 64 << 20):
        zeros = bytes(length)
        for crc in (0, 1, 0xDEADBEEF, 0xFFFFFFFF):
            assert shift_crc32(crc, length) ^ zlib.crc32(zeros) == zlib.crc32(zeros, crc)


def test_shift_is_periodic_past_32_bits_of_length():
    """x has order dividing 2^32 - 1 modulo the CRC polynomial: lengths far past 4 GiB work."""
    crc = 0x12345678
    assert shift_crc32(crc, 0) == crc
    period_bits = (1 << 32) - 1  # shifting by 8 * period_bits bits is the identity
    assert shift_crc32(crc, period_bits) == crc
    assert shift_crc32(crc, 5 * (1 << 40) + 3) == shift_crc32(shift_crc32(crc, 5 << 40), 3)

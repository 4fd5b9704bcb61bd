"""CRC-32 (zlib's) of a span, from the running CRC-32 of a stream at the span's two ends.

zlib's crc32_combine rests on crc(A + B) = shift(crc(A), len(B)) ^ crc(B), where shift
multiplies by x^(8 len(B)) modulo the CRC polynomial. Run backwards it gives
crc(B) = crc(A + B) ^ shift(crc(A), len(B)): the CRC of any span of a stream read once, from
the running CRC where the span starts and where it ends, without holding the span.
"""

from __future__ import annotations

import functools

_POLYNOMIAL = 0xEDB88320  # reflected, as zlib uses it


def _multiply(a: int, b: int) -> int:
    """a * b modulo the polynomial, in the reflected bit order (zlib's multmodp)."""
    bit = 1 << 31
    product = 0
    while a:
        if a & bit:
            product ^= b
            a ^= bit
        bit >>= 1
        b = (b >> 1) ^ _POLYNOMIAL if b & 1 else b >> 1
    return product


def _powers_of_x() -> list[int]:
    """x^(2^k) for k in 0..31; x^(2^32) is x again, so the list repeats with period 32."""
    powers = [1 << 30]
    for _ in range(31):
        powers.append(_multiply(powers[-1], powers[-1]))
    return powers


_X_TO_TWO_TO_THE = _powers_of_x()


@functools.cache
def _byte_tables(k: int) -> tuple[list[int], ...]:
    """Multiplying by x^(2^k) is linear: tables of its effect on each byte of a 32-bit value."""
    factor = _X_TO_TWO_TO_THE[k]
    tables = []
    for byte_index in range(4):
        basis = [_multiply(factor, 1 << (8 * byte_index + bit)) for bit in range(8)]
        table = [0] * 256
        for value in range(1, 256):
            lowest = value & -value
            table[value] = table[value ^ lowest] ^ basis[lowest.bit_length() - 1]
        tables.append(table)
    return tuple(tables)


def shift_crc32(crc: int, length_bytes: int) -> int:
    """crc times x^(8 length_bytes): what crc(A) contributes to crc(A + B) when B is
    length_bytes long."""
    k = 3  # 8 * length = length * 2^3
    while length_bytes:
        if length_bytes & 1:
            t0, t1, t2, t3 = _byte_tables(k & 31)
            crc = t0[crc & 255] ^ t1[(crc >> 8) & 255] ^ t2[(crc >> 16) & 255] ^ t3[crc >> 24]
        length_bytes >>= 1
        k += 1
    return crc


def crc32_of_span(crc_before: int, crc_through: int, span_bytes: int) -> int:
    """CRC-32 of a span of span_bytes bytes, given the stream's running CRC-32 just before the
    span (crc_before) and just after it (crc_through)."""
    return crc_through ^ shift_crc32(crc_before, span_bytes)


def crc32_of_concatenation(crc: int, next_crc: int, next_bytes: int) -> int:
    """CRC-32 of A + B from that of A (crc) and that of B (next_crc), B being next_bytes long:
    zlib's crc32_combine."""
    return shift_crc32(crc, next_bytes) ^ next_crc if next_bytes else crc

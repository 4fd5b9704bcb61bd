"""The block structure of floatsplit streams, for tests: what the stream format fixes, leaving out
the bytes zstd chose."""

from __future__ import annotations

from dcpctl.format.codecs.floatsplit.prediction import stream_count
from dcpctl.format.codecs.floatsplit.planes import LAYOUTS_BY_CODE
from dcpctl.format.codecs.floatsplit.stream_format import (BYTES_BLOCK, END_BLOCK, END_HEADER,
                                                           FLOATS_BLOCK, FLOATS_HEADER, MAGICS,
                                                           PREDICTED_BLOCK, PREDICTED_HEADER,
                                                           STREAM_HEADER, TAIL_BLOCK, TAIL_HEADER)

FLOAT_BLOCKS = (FLOATS_BLOCK, PREDICTED_BLOCK)
"""The kinds of block that hold float elements split or predicted."""


def stream_version(stream: bytes) -> int:
    """The version its magic names."""
    return MAGICS[stream[:4]]


def block_structure(stream: bytes) -> list[tuple]:
    """Every block's kind and header, and each sub-stream's coding and decoded length: what
    the format fixes, leaving out the bytes zstd chose."""
    return [block for _, block in _walk(stream)]


def block_starts(stream: bytes) -> list[tuple[int, int]]:
    """Every block's kind and where it starts in the stream."""
    return [(block[0], start) for start, block in _walk(stream)]


def _walk(stream: bytes):
    stream_version(stream)
    position = 4

    def sub_streams(count: int) -> list[tuple[int, int]]:
        nonlocal position
        found = []
        for _ in range(count):
            coding, decoded, stored = STREAM_HEADER.unpack_from(stream, position)
            found.append((coding, decoded))
            position += STREAM_HEADER.size + stored
        return found

    while True:
        kind, start = stream[position], position
        if kind == END_BLOCK:
            assert position + END_HEADER.size == len(stream)
            yield start, END_HEADER.unpack_from(stream, position)
            return
        if kind == BYTES_BLOCK:
            position += 1
            yield start, (BYTES_BLOCK, *sub_streams(1))
        elif kind == FLOATS_BLOCK:
            header = FLOATS_HEADER.unpack_from(stream, position)
            position += FLOATS_HEADER.size
            yield start, (*header, *sub_streams(LAYOUTS_BY_CODE[header[1]].itemsize))
        elif kind == PREDICTED_BLOCK:
            header = PREDICTED_HEADER.unpack_from(stream, position)
            position += PREDICTED_HEADER.size
            yield start, (*header, *sub_streams(stream_count(LAYOUTS_BY_CODE[header[1]])))
        else:
            assert kind == TAIL_BLOCK
            header = TAIL_HEADER.unpack_from(stream, position)
            position += TAIL_HEADER.size + header[2] + header[4]
            yield start, (kind, *header[2:4])  # the lengths: the CRC-32 and id vary

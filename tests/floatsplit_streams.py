"""The block structure of floatsplit streams, for tests: what the stream format fixes, leaving out
the bytes zstd chose."""

from __future__ import annotations

from dcpctl.format.codecs.floatsplit.stream_format import (BYTES_BLOCK, END_BLOCK, END_HEADER,
                                                           FLOATS_BLOCK, FLOATS_HEADER, MAGIC,
                                                           STREAM_HEADER)


def block_structure(stream: bytes) -> list[tuple]:
    """Every block's kind and header, and each sub-stream's coding and decoded length: what
    the format fixes, leaving out the bytes zstd chose."""
    assert stream[:len(MAGIC)] == MAGIC
    position, blocks = len(MAGIC), []

    def sub_streams(count: int) -> list[tuple[int, int]]:
        nonlocal position
        found = []
        for _ in range(count):
            coding, decoded, stored = STREAM_HEADER.unpack_from(stream, position)
            found.append((coding, decoded))
            position += STREAM_HEADER.size + stored
        return found

    while True:
        kind = stream[position]
        if kind == END_BLOCK:
            blocks.append(END_HEADER.unpack_from(stream, position))
            assert position + END_HEADER.size == len(stream)
            return blocks
        if kind == BYTES_BLOCK:
            position += 1
            blocks.append((BYTES_BLOCK, *sub_streams(1)))
        else:
            assert kind == FLOATS_BLOCK
            header = FLOATS_HEADER.unpack_from(stream, position)
            position += FLOATS_HEADER.size
            planes = {1: 2, 2: 2, 3: 4, 4: 8}[header[1]]
            blocks.append((*header, *sub_streams(planes)))

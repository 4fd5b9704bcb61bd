"""Assembling an output chunk of a reshard from the overlapping rows of its input chunks, read
straight into place, as the torch.save archive of the chunk: a chunk of up to a piece is built
whole in one buffer, so its bytes are copied once; a larger one streams in blocks of rows,
never whole in memory. The archive's CRC-32 of the payload comes from the reads where a single
read filled a buffer (the reader works it out to check the input), so those bytes are not
passed over twice."""

from __future__ import annotations

import math
import zlib
from typing import Iterator

import numpy

from dcpctl.format.checkpoint.payloads import PayloadReader
from dcpctl.format.torch_save.crc32 import crc32_of_concatenation
from dcpctl.format.torch_save.writer import iter_torch_save_archive, torch_save_archive
from dcpctl.ops.reshard.planning import ChunkTask


def _row_blocks(task: ChunkTask, piece_bytes: int) -> Iterator[tuple[int, int]]:
    """Absolute [first, last) row ranges of at most piece_bytes each (a whole row at least)."""
    if not task.offsets:
        yield 0, 1
        return
    row_bytes = task.nbytes // task.sizes[0] if task.sizes[0] else 0
    if not row_bytes:
        return
    step = max(1, piece_bytes // row_bytes)
    first, stop = task.offsets[0], task.offsets[0] + task.sizes[0]
    for begin in range(first, stop, step):
        yield begin, min(begin + step, stop)


def _fill_rows(task: ChunkTask, begin: int, end: int, reader: PayloadReader,
               out: memoryview) -> int | None:
    """Write rows [begin, end) of the output chunk into out, from the overlapping input
    elements (an input chunk may be wider or narrower than the output chunk: a 2-D mesh); the
    CRC-32 of out where one read filled it and worked that out, else None."""
    itemsize = task.dtype.itemsize
    if not task.offsets:
        source = task.sources[0]
        return reader.read_into(reader.source_of(source.location), 0, out)
    inner_offsets, inner = task.offsets[1:], task.sizes[1:]
    whole_rows = [s for s in task.sources if s.sizes[1:] == inner and s.offsets[1:] == inner_offsets
                  and s.offsets[0] <= begin and end <= s.offsets[0] + s.sizes[0]]
    if whole_rows:  # one input chunk holds these rows whole: a single contiguous read
        source = whole_rows[0]
        row_bytes = math.prod(inner) * itemsize
        payload = reader.source_of(source.location)
        return reader.read_into(payload, (begin - source.offsets[0]) * row_bytes, out)
    block = numpy.frombuffer(out, dtype=numpy.uint8).reshape((end - begin, *inner, itemsize))
    for source in task.sources:
        first = max(begin, source.offsets[0])
        last = min(end, source.offsets[0] + source.sizes[0])
        if first >= last:
            continue
        row_bytes = math.prod(source.sizes[1:]) * itemsize
        payload = reader.source_of(source.location)
        rows = memoryview(numpy.empty((last - first) * row_bytes, dtype=numpy.uint8))
        reader.read_into(payload, (first - source.offsets[0]) * row_bytes, rows)
        overlaps = [(max(offset, source_offset), min(offset + size, source_offset + source_size))
                    for offset, size, source_offset, source_size
                    in zip(inner_offsets, inner, source.offsets[1:], source.sizes[1:])]
        into = (slice(first - begin, last - begin),) + tuple(
            slice(low - offset, high - offset) for (low, high), offset in zip(overlaps,
                                                                              inner_offsets))
        taken = (slice(None),) + tuple(
            slice(low - offset, high - offset) for (low, high), offset in zip(overlaps,
                                                                              source.offsets[1:]))
        block[into] = numpy.frombuffer(rows, dtype=numpy.uint8).reshape(
            (last - first, *source.sizes[1:], itemsize))[taken]
    return None


class _BlocksOfRows:
    """The output chunk's rows in blocks of at most piece_bytes, each read into a buffer of its
    own as it is asked for, and the CRC-32 of the blocks given so far."""

    def __init__(self, task: ChunkTask, reader: PayloadReader, piece_bytes: int) -> None:
        self._task, self._reader, self._piece_bytes = task, reader, piece_bytes
        self.crc = 0

    def __iter__(self) -> Iterator[memoryview]:
        task = self._task
        row_bytes = task.nbytes // task.sizes[0] if task.offsets else task.nbytes  # 0-d: 1 row
        for begin, end in _row_blocks(task, self._piece_bytes):
            out = memoryview(numpy.empty((end - begin) * row_bytes, dtype=numpy.uint8))
            crc = _fill_rows(task, begin, end, self._reader, out)
            self.crc = crc32_of_concatenation(self.crc, zlib.crc32(out) if crc is None else crc,
                                              len(out))
            yield out


def chunk_archive(task: ChunkTask, reader: PayloadReader, piece_bytes: int
                  ) -> tuple[Iterator[bytes], int | None]:
    """The output chunk's torch.save archive as pieces, and its size when known: a chunk of up
    to piece_bytes comes whole in one buffer, its rows read straight into place (and its
    CRC-32 the one reading them worked out, where a single read filled it)."""
    if task.nbytes <= piece_bytes:
        first_row = task.offsets[0] if task.offsets else 0
        last_row = first_row + (task.sizes[0] if task.offsets else 1)
        archive = torch_save_archive(task.dtype, task.sizes, lambda payload: _fill_rows(
            task, first_row, last_row, reader, payload))
        return iter([archive]), len(archive)
    blocks = _BlocksOfRows(task, reader, piece_bytes)
    return iter_torch_save_archive(task.dtype, task.sizes, blocks, lambda: blocks.crc), None

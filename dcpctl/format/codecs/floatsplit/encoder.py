"""The floatsplit stream transform (`dcpctl.floatsplit/1`): float payloads coded plane by plane.

A tensor item is a torch.save archive: some framing, the tensor's raw bytes, more framing. The
encoder codes the framing with plain zstd and cuts the raw bytes into blocks of whole elements,
each split into byte planes (planes.py) that are coded on their own (plane_zstd.py): the
exponent plane as Huffman-coded zstd literals (which reach the plane's order-0 entropy), the
sign and mantissa planes the same way, each stored raw where coding does not pay. Blocks are
independent and small, so both directions stream with bounded memory. The byte layout is
documented in docs/floatsplit.md and stream_format.py; decoding (decoder.py) needs nothing but
the stream.
"""

from __future__ import annotations

import zstandard

from dcpctl.format.codecs.base import PayloadHint
from dcpctl.format.codecs.floatsplit.plane_zstd import plane_compressor
from dcpctl.format.codecs.floatsplit.planes import layout_for_block, layout_for_dtype, split_planes
from dcpctl.format.codecs.floatsplit.stream_format import (BYTES_BLOCK, END_BLOCK, END_HEADER,
                                                           FLOATS_BLOCK, FLOATS_HEADER, MAGIC,
                                                           MAX_BLOCK_BYTES, RAW_CODING,
                                                           STREAM_HEADER, ZSTD_CODING)
from dcpctl.format.codecs.per_thread import PerThread
from dcpctl.format.torch_save.layout import find_payload_start

_MIN_BLOCK_BYTES = 1 << 20
# A stream is stored coded only if that saves this fraction of it: decoding a nearly random
# mantissa plane costs as much time as decoding the exponent plane, for a fraction of a percent.
MIN_CODING_GAIN = 0.03
_MIN_SPLIT_BYTES = 16 << 10
_HEAD_SEARCH_BYTES = 64 << 10
# This thread's compressors for plain bytes, by level.
_compressors: PerThread[dict[int, zstandard.ZstdCompressor]] = PerThread(dict)


def _compressor(level: int) -> zstandard.ZstdCompressor:
    """This thread's compressor for plain bytes at `level`."""
    cache = _compressors.get()
    compressor = cache.get(level)
    if compressor is None:
        compressor = cache[level] = zstandard.ZstdCompressor(level=level)
    return compressor


class FloatSplitEncoder:
    """Encodes one item given piece by piece; with a hint, its tensor bytes go into planes."""

    def __init__(self, level: int, payload: PayloadHint | None) -> None:
        self._level = level
        # Splitting a tiny tensor costs more time than it saves bytes: one zstd frame codes it.
        splits = payload is not None and payload.payload_bytes >= _MIN_SPLIT_BYTES
        self._layout = layout_for_dtype(payload.dtype_name) if splits else None
        self._payload_left = payload.payload_bytes if self._layout else 0
        self._in_head = self._payload_left > 0
        self._pending = b""
        self._decoded_bytes = 0
        self._started = False

    def encode(self, piece: bytes) -> bytes:
        self._decoded_bytes += len(piece)
        data = self._pending + piece if self._pending else piece
        parts = self._start()
        consumed = self._code(memoryview(data), parts, final=False)
        self._pending = bytes(data[consumed:])
        return b"".join(parts)

    def finish(self) -> bytes:
        parts = self._start()
        self._code(memoryview(self._pending), parts, final=True)
        parts.append(END_HEADER.pack(END_BLOCK, self._decoded_bytes))
        return b"".join(parts)

    def _start(self) -> list:
        if self._started:
            return []
        self._started = True
        return [MAGIC]

    def _code(self, data: memoryview, parts: list, final: bool) -> int:
        """Emit every block `data` completes; returns how many of its bytes they took."""
        position = 0
        if self._in_head:
            start = find_payload_start(bytes(data[:_HEAD_SEARCH_BYTES]))
            if start is None and not final and len(data) < _HEAD_SEARCH_BYTES:
                return 0
            self._in_head = False
            if start is None:
                self._payload_left = 0
            elif start:
                self._add_bytes_block(data[:start], parts)
                position = start
        while position < len(data):
            available = len(data) - position
            in_payload = self._payload_left >= self._layout.itemsize if self._layout else False
            limit = min(self._payload_left, MAX_BLOCK_BYTES) if in_payload else MAX_BLOCK_BYTES
            if not final and available < min(limit, _MIN_BLOCK_BYTES):
                break
            size = min(available, limit)
            if in_payload:
                size -= size % self._layout.itemsize
                if size == 0:  # the item ends inside an element
                    self._payload_left = 0
                    continue
                self._add_floats_block(data[position:position + size], parts)
                self._payload_left -= size
            else:
                self._add_bytes_block(data[position:position + size], parts)
            position += size
        return position

    def _add_bytes_block(self, data: memoryview, parts: list) -> None:
        parts.append(bytes((BYTES_BLOCK,)))
        compressed = _compressor(self._level).compress(data)
        _add_stream(data, compressed if len(compressed) <= len(data) * (1 - MIN_CODING_GAIN)
                    else None, parts)

    def _add_floats_block(self, data: memoryview, parts: list) -> None:
        layout = layout_for_block(self._layout, data)
        parts.append(FLOATS_HEADER.pack(FLOATS_BLOCK, layout.code, len(data) // layout.itemsize))
        compressor = plane_compressor()
        for plane in split_planes(layout, data):
            _add_stream(plane, compressor.compress(plane, MIN_CODING_GAIN), parts)


def _add_stream(data, compressed: bytes | None, parts: list) -> None:
    """A sub-stream of data: the zstd frame given, or data itself (raw) where there is none."""
    size = len(data)
    if compressed is None:
        parts += [STREAM_HEADER.pack(RAW_CODING, size, size), bytes(data)]
    else:
        parts += [STREAM_HEADER.pack(ZSTD_CODING, size, len(compressed)), compressed]

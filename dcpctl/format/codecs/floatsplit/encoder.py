"""The floatsplit stream transform (`dcpctl.floatsplit/1`): float payloads coded plane by plane.

A tensor item is a torch.save archive: some framing, the tensor's raw bytes, more framing. The
encoder codes the framing with plain zstd and cuts the raw bytes into blocks of whole elements,
each split into byte planes (planes.py) that are coded on their own (plane_zstd.py): the
exponent plane as Huffman-coded zstd literals (which reach the plane's order-0 entropy), the
sign and mantissa planes the same way, each stored raw where coding does not pay. Blocks are
independent and small, so both directions stream with bounded memory. The byte layout is
documented in docs/floatsplit.md and stream_format.py; decoding (decoder.py) needs nothing but
the stream.

Blocks are cut where the item's bytes say, never where the pieces it arrives in happen to end:
the head (up to the tensor's bytes), then the tensor's bytes in blocks of MAX_BLOCK_BYTES, then
the rest in blocks of MAX_BLOCK_BYTES. So one item encodes to the same stream whether `dcpctl
compress` reads it in pieces or torch.save writes it through the DCP extension, and a piece of
gigabytes is coded where it lies, never copied whole.
"""

from __future__ import annotations

import zstandard

from dcpctl.format.codecs.base import PayloadHint
from dcpctl.format.codecs.floatsplit.plane_zstd import plane_compressor
from dcpctl.format.codecs.floatsplit.planes import (FloatLayout, layout_for_block,
                                                    layout_for_dtype, split_planes)
from dcpctl.format.codecs.floatsplit.stream_format import (BYTES_BLOCK, END_BLOCK, END_HEADER,
                                                           FLOATS_BLOCK, FLOATS_HEADER, MAGIC,
                                                           MAX_BLOCK_BYTES, RAW_CODING,
                                                           STREAM_HEADER, ZSTD_CODING)
from dcpctl.format.codecs.per_thread import PerThread
from dcpctl.format.torch_save.layout import find_payload_start, saved_tensor_in_head
from dcpctl.format.torch_save.zip_records import LOCAL_SIGNATURE

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
    """Encodes one item given piece by piece, its tensor bytes (if it is a tensor's archive) into
    planes. The payload hint says the tensor's dtype and size where the caller knows them; with
    none, the encoder reads them from the archive's data.pkl as the item's head goes by."""

    def __init__(self, level: int, payload: PayloadHint | None) -> None:
        self._level = level
        self._layout: FloatLayout | None = None
        self._payload_left = 0
        self._set_payload(payload)
        # The item's first bytes, kept until they show where its tensor's bytes start; None once
        # they have, or where there is no tensor to find.
        self._head: bytearray | None = bytearray() if payload is None or self._layout else None
        self._reads_hint = payload is None
        self._pending = bytearray()
        self._decoded_bytes = 0
        self._parts: list = [MAGIC]

    def _set_payload(self, payload: PayloadHint | None) -> None:
        # Splitting a tiny tensor costs more time than it saves bytes: one zstd frame codes it.
        if payload is None or payload.payload_bytes < _MIN_SPLIT_BYTES:
            self._layout, self._payload_left = None, 0
            return
        self._layout = layout_for_dtype(payload.dtype_name)
        self._payload_left = (payload.payload_bytes - payload.payload_bytes % self._layout.itemsize
                              if self._layout else 0)

    def encode(self, piece) -> bytes:
        data = memoryview(piece).cast("B")
        self._decoded_bytes += len(data)
        if self._head is not None:
            data = self._take_head(data, final=False)
        self._take(data)
        return self._flush()

    def finish(self) -> bytes:
        if self._head is not None:
            self._take_head(memoryview(b""), final=True)
        if self._pending:
            self._add_last_block(memoryview(self._pending))
            self._pending = bytearray()
        self._parts.append(END_HEADER.pack(END_BLOCK, self._decoded_bytes))
        return self._flush()

    def _flush(self) -> bytes:
        parts, self._parts = self._parts, []
        return b"".join(parts)

    def _take_head(self, data: memoryview, final: bool) -> memoryview:
        """Keep data in the head until it shows where the tensor's bytes start, then code the
        head as a block of its own; returns what of data lies past the head."""
        room = _HEAD_SEARCH_BYTES - len(self._head)
        self._head += data[:room]
        head = bytes(self._head)
        start = find_payload_start(head)
        if (start is None and not final and len(head) < _HEAD_SEARCH_BYTES
                and head[:len(LOCAL_SIGNATURE)] == LOCAL_SIGNATURE[:len(head)]):
            return data[len(data):]
        self._head = None
        if self._reads_hint:
            tensor = saved_tensor_in_head(head[:start]) if start else None
            self._set_payload(PayloadHint(tensor.dtype.name, tensor.storage_numel
                                          * tensor.dtype.itemsize) if tensor else None)
        if start is None or not self._layout:
            self._payload_left, start = 0, 0
        if start:
            self._add_bytes_block(memoryview(head)[:start])
        self._take(memoryview(head)[start:])
        return data[room:]

    def _take(self, data: memoryview) -> None:
        """Code every block data completes; keep the rest for the next piece."""
        while data:
            target = min(self._payload_left, MAX_BLOCK_BYTES) or MAX_BLOCK_BYTES
            if not self._pending and len(data) >= target:
                self._add_block(data[:target])
                data = data[target:]
                continue
            taken = min(target - len(self._pending), len(data))
            self._pending += data[:taken]
            data = data[taken:]
            if len(self._pending) == target:
                self._add_block(memoryview(self._pending))
                self._pending = bytearray()

    def _add_block(self, data: memoryview) -> None:
        if self._payload_left:
            self._add_floats_block(data)
            self._payload_left -= len(data)
        else:
            self._add_bytes_block(data)

    def _add_last_block(self, data: memoryview) -> None:
        """The item ended before a block was full, in the tensor's bytes (whole elements as
        floats, a torn element as bytes) or past them."""
        whole = len(data) - len(data) % self._layout.itemsize if self._payload_left else 0
        if whole:
            self._add_floats_block(data[:whole])
        if whole < len(data):
            self._add_bytes_block(data[whole:])

    def _add_bytes_block(self, data: memoryview) -> None:
        self._parts.append(bytes((BYTES_BLOCK,)))
        compressed = _compressor(self._level).compress(data)
        _add_stream(data, compressed if len(compressed) <= len(data) * (1 - MIN_CODING_GAIN)
                    else None, self._parts)

    def _add_floats_block(self, data: memoryview) -> None:
        layout = layout_for_block(self._layout, data)
        self._parts.append(FLOATS_HEADER.pack(FLOATS_BLOCK, layout.code,
                                              len(data) // layout.itemsize))
        compressor = plane_compressor()
        for plane in split_planes(layout, data):
            _add_stream(plane, compressor.compress(plane, MIN_CODING_GAIN), self._parts)


def _add_stream(data, compressed: bytes | None, parts: list) -> None:
    """A sub-stream of data: the zstd frame given, or data itself (raw) where there is none."""
    size = len(data)
    if compressed is None:
        parts += [STREAM_HEADER.pack(RAW_CODING, size, size), bytes(data)]
    else:
        parts += [STREAM_HEADER.pack(ZSTD_CODING, size, len(compressed)), compressed]

"""The floatsplit stream transform (`dcpctl.floatsplit/2`): float payloads coded plane by plane.

A tensor item is a torch.save archive: some framing, the tensor's raw bytes, more framing. The
encoder codes the framing with zstd and the framing dictionary (framing.py), and cuts the raw
bytes into blocks of whole elements (whole rows, where the tensor has rows). Each block is
coded the way a sample of it shows codes it smaller: against a prediction from its rows and
columns (prediction.py), or split into byte planes (planes.py) as in version 1. Either way its
byte planes are coded on their own (plane_zstd.py): as Huffman-coded zstd literals, which reach
a plane's order-0 entropy, each stored raw where coding does not pay. Blocks are independent
and small, so both directions stream with bounded memory. The byte layout is documented in
docs/floatsplit.md and stream_format.py; decoding (decoder.py) needs nothing but the stream.

Blocks are cut where the item's bytes say, never where the pieces it arrives in happen to end:
the head (up to the tensor's bytes), then the tensor's bytes in blocks of at most
MAX_BLOCK_BYTES (whole rows of it where a row fits), then the rest in blocks of
MAX_BLOCK_BYTES. So one item encodes to the same stream whether `dcpctl compress` reads it in
pieces or torch.save writes it through the DCP extension, and a piece of gigabytes is coded
where it lies, never copied whole.
"""

from __future__ import annotations

import numpy

from dcpctl.format.codecs.base import PayloadHint, row_length_of
from dcpctl.format.codecs.floatsplit.framing import framing_compressor, tail_block
from dcpctl.format.codecs.floatsplit.plane_zstd import plane_compressor
from dcpctl.format.codecs.floatsplit.planes import (FloatLayout, layout_for_block,
                                                    layout_for_dtype, split_planes)
from dcpctl.format.codecs.floatsplit.prediction import (MIN_ROWS, PREDICTED_LAYOUTS,
                                                        predict, split_predicted)
from dcpctl.format.codecs.floatsplit.stream_format import (BYTES_BLOCK, DICTIONARY_CODING,
                                                           END_BLOCK, END_HEADER, FLOATS_BLOCK,
                                                           FLOATS_HEADER, MAGIC_V2,
                                                           MAX_BLOCK_BYTES, MAX_HEAD_BYTES,
                                                           PREDICTED_BLOCK,
                                                           PREDICTED_HEADER, RAW_CODING,
                                                           STREAM_HEADER, ZSTD_CODING)
from dcpctl.format.torch_save.layout import (SavedTensor, find_payload_start,
                                             saved_tensor_in_head)
from dcpctl.format.torch_save.zip_records import LOCAL_SIGNATURE

# A stream is stored coded only if that saves this fraction of it: decoding a nearly random
# mantissa plane costs as much time as decoding the exponent plane, for a fraction of a percent.
MIN_CODING_GAIN = 0.03
# Tensors of fewer bytes go whole into one zstd frame, framing and all. Any larger float tensor
# is split, small ones too: its framing then costs a dictionary-coded head and a TAIL block,
# some hundred bytes less than in one frame, which is more than a small tensor's data. At the
# fast level, only tensors large enough for their planes to pay for splitting them.
_MIN_SPLIT_BYTES, _FAST_MIN_SPLIT_BYTES = 64, 16 << 10


class FloatSplitEncoder:
    """Encodes one item given piece by piece, its tensor bytes (if it is a tensor's archive) into
    planes. The payload hint says the tensor's dtype and size where the caller knows them; with
    none, the encoder reads them from the archive's data.pkl as the item's head goes by. level
    is that of the plain zstd parts; without `predicts`, the encoder codes for speed: no
    PREDICTED blocks, and small tensors whole."""

    def __init__(self, level: int, payload: PayloadHint | None, predicts: bool) -> None:
        self._level = level
        self._predicts = predicts
        self._min_split_bytes = _MIN_SPLIT_BYTES if self._predicts else _FAST_MIN_SPLIT_BYTES
        self._layout: FloatLayout | None = None
        self._payload_left = 0
        self._row_length = 0
        self._block_bytes = MAX_BLOCK_BYTES
        self._set_payload(payload)
        # The item's first bytes, kept until they show where its tensor's bytes start; None once
        # they have, or where there is no tensor to find.
        self._head: bytearray | None = bytearray() if payload is None or self._layout else None
        self._reads_hint = payload is None
        # A block's bytes that came in pieces, gathered: _pending[:_pending_bytes]
        self._pending = numpy.empty(0, dtype=numpy.uint8)
        self._pending_bytes = 0
        self._decoded_bytes = 0
        self._archive_head: bytes | None = None  # a tensor archive's records before its bytes
        self._parts: list = [MAGIC_V2]

    def _set_payload(self, payload: PayloadHint | None) -> None:
        if payload is None or payload.payload_bytes < self._min_split_bytes:
            self._layout, self._payload_left = None, 0
            return
        self._layout = layout_for_dtype(payload.dtype_name)
        self._payload_left = (payload.payload_bytes - payload.payload_bytes % self._layout.itemsize
                              if self._layout else 0)
        row_bytes = payload.row_length * self._layout.itemsize if self._layout else 0
        if (self._layout and self._layout.code in PREDICTED_LAYOUTS
                and payload.dtype_name == self._layout.name and row_bytes
                and self._payload_left % row_bytes == 0
                and MAX_BLOCK_BYTES // row_bytes >= MIN_ROWS):
            self._row_length = payload.row_length
            self._block_bytes = MAX_BLOCK_BYTES - MAX_BLOCK_BYTES % row_bytes

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
        if self._pending_bytes:
            rest = memoryview(self._pending[:self._pending_bytes])
            tail = self._tail_block(bytes(rest))
            if tail is not None:
                self._parts.append(tail)
            else:
                self._add_last_block(rest)
            self._pending_bytes = 0
        self._parts.append(END_HEADER.pack(END_BLOCK, self._decoded_bytes))
        return self._flush()

    def _flush(self) -> bytes:
        parts, self._parts = self._parts, []
        return b"".join(parts)

    def _take_head(self, data: memoryview, final: bool) -> memoryview:
        """Keep data in the head until it shows where the tensor's bytes start, then code the
        head as a block of its own; returns what of data lies past the head."""
        kept = len(self._head)  # from earlier pieces
        self._head += data[:MAX_HEAD_BYTES - kept]
        head = bytes(self._head)
        start = find_payload_start(head)
        if (start is None and not final and len(head) < MAX_HEAD_BYTES
                and head[:len(LOCAL_SIGNATURE)] == LOCAL_SIGNATURE[:len(head)]):
            return data[len(data):]
        self._head = None
        if self._reads_hint:
            tensor = saved_tensor_in_head(head[:start]) if start else None
            self._set_payload(_payload_of(tensor) if tensor else None)
        if start is None or not self._layout:
            self._payload_left, start = 0, 0
        if start:
            self._archive_head = head[:start]
            self._add_bytes_block(memoryview(head)[:start])
        # What lies past the head is taken where it lies: this piece's part of it, often a
        # tensor's bytes whole, is not copied with the head.
        if start < kept:
            self._take(memoryview(head)[start:kept])
        return data[max(0, start - kept):]

    def _tail_block(self, rest: bytes) -> bytes | None:
        """A TAIL block for the bytes after the tensor's, where they are all torch.save's
        framing as it writes it; None otherwise (and for items that are no tensor archive)."""
        if self._archive_head is None or self._payload_left:
            return None
        payload_bytes = self._decoded_bytes - len(self._archive_head) - len(rest)
        return tail_block(self._archive_head, payload_bytes, rest)

    def _take(self, data: memoryview) -> None:
        """Code every block data completes; keep the rest for the next piece. Bytes are
        gathered with numpy, which copies without holding the GIL: the other threads of a save
        go on meanwhile."""
        while data:
            target = min(self._payload_left, self._block_bytes) or MAX_BLOCK_BYTES
            if not self._pending_bytes and len(data) >= target:
                self._add_block(data[:target])
                data = data[target:]
                continue
            if len(self._pending) < target:  # only while nothing is pending
                self._pending = numpy.empty(target, dtype=numpy.uint8)
            start = self._pending_bytes
            taken = min(target - start, len(data))
            self._pending[start:start + taken] = numpy.frombuffer(data[:taken], dtype=numpy.uint8)
            self._pending_bytes += taken
            data = data[taken:]
            if self._pending_bytes == target:
                self._pending_bytes = 0
                self._add_block(memoryview(self._pending[:target]))

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
        compressed = framing_compressor(self._level).compress(data)
        _add_stream(data, compressed if len(compressed) <= len(data) * (1 - MIN_CODING_GAIN)
                    else None, self._parts, DICTIONARY_CODING)

    def _add_floats_block(self, data: memoryview) -> None:
        """A block of whole elements: predicted from its rows and columns where a sample says
        that codes it smaller than its planes alone (version 1's split), else split."""
        row_bytes = self._layout.itemsize * self._row_length
        if (self._predicts and row_bytes and len(data) % row_bytes == 0
                and len(data) // row_bytes >= MIN_ROWS and self._add_predicted_block(data)):
            return
        layout = layout_for_block(self._layout, data)
        planes = split_planes(layout, data)
        self._parts.append(FLOATS_HEADER.pack(FLOATS_BLOCK, layout.code,
                                              len(data) // layout.itemsize))
        compressor = plane_compressor()
        for plane in planes:
            _add_stream(plane, compressor.compress(plane, MIN_CODING_GAIN), self._parts)

    def _add_predicted_block(self, data: memoryview) -> bool:
        """A PREDICTED block of data, where its parts store smaller than its planes alone;
        False where they do not. Judged by the bytes the residuals save over what they stand
        for (Prediction.saving), against the predictions and escaped elements as stored: what
        the prediction costs. The rest codes the same either way: the sign and the bits below
        q, which version 1's split puts in planes of the same entropy. A prediction that cannot
        pay is refused before the block is split."""
        prediction = predict(self._layout, data, self._row_length)
        if prediction.saving <= 0:
            return False
        side = framing_compressor(self._level)
        predictions = prediction.streams()
        coded = [_smaller(side.compress(stream), stream) for stream in predictions]
        side_bytes = sum(len(frame) if frame is not None else len(stream)
                         for frame, stream in zip(coded, predictions))
        if side_bytes >= prediction.saving:
            return False
        parts = split_predicted(self._layout, data, self._row_length, prediction)
        if side_bytes + parts.escaped.nbytes >= prediction.saving:
            return False
        self._parts.append(PREDICTED_HEADER.pack(
            PREDICTED_BLOCK, self._layout.code, len(parts.residuals), self._row_length,
            len(parts.escaped)))
        for stream, frame in zip(predictions, coded):
            _add_stream(stream, frame, self._parts, DICTIONARY_CODING)
        compressor = plane_compressor()
        for stream in parts.streams():
            _add_stream(stream, compressor.compress(stream, MIN_CODING_GAIN) if len(stream)
                        else None, self._parts)
        return True


def _payload_of(tensor: SavedTensor) -> PayloadHint:
    """The payload of a tensor read from an archive's data.pkl: its storage's bytes, in rows
    where the tensor is the whole storage in C order (as DCP saves every chunk)."""
    whole = (tensor.storage_offset == 0 and tensor.numel == tensor.storage_numel
             and tensor.is_contiguous)
    return PayloadHint(tensor.dtype.name, tensor.storage_numel * tensor.dtype.itemsize,
                       row_length_of(tensor.shape) if whole else 0)


def _smaller(compressed: bytes, data) -> bytes | None:
    return compressed if len(compressed) < len(data) else None


def _add_stream(data, compressed: bytes | numpy.ndarray | None, parts: list,
                coding: int = ZSTD_CODING) -> None:
    """A sub-stream of data: the zstd frame given (made with the dictionary for
    DICTIONARY_CODING), or data itself (raw) where there is none."""
    size = len(data)
    if compressed is None:
        # a copy (data may be scratch memory), made by numpy without holding the GIL
        parts += [STREAM_HEADER.pack(RAW_CODING, size, size),
                  numpy.frombuffer(data, dtype=numpy.uint8).copy()]
    else:
        parts += [STREAM_HEADER.pack(coding, size, len(compressed)), compressed]

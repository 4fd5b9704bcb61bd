"""Decode the floatsplit stream (docs/floatsplit.md) piece by piece, from its bytes alone.

Each `decode` call first finds the blocks its input completes, then hands out each decoded as
one piece: a block of bytes as zstd decodes it, a block of floats joined from its planes into
a buffer of its own (large zstd-coded planes are decompressed into scratch memory first, raw
planes are read where they lie). Pieces that end inside a block wait, unjoined, until the
block is complete. Anything that does not add up raises DataError naming the byte offset in the
stream.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass, field
from typing import Iterator

import numpy
import zstandard

from dcpctl.errors import DataError
from dcpctl.format.codecs.base import past_the_item_error
from dcpctl.format.codecs.floatsplit.framing import (framing_decompressor, tail_block_size,
                                                     tail_of_block)
from dcpctl.format.codecs.floatsplit.planes import (LAYOUTS_BY_CODE, FloatLayout, join_planes,
                                                    scratch_plane)
from dcpctl.format.codecs.floatsplit.prediction import (PREDICTED_LAYOUTS, join_predicted,
                                                        stream_count)
from dcpctl.format.codecs.floatsplit.stream_format import (BYTES_BLOCK, CODINGS_BY_VERSION,
                                                           DICTIONARY_CODING, END_BLOCK,
                                                           END_HEADER, FLOATS_BLOCK,
                                                           FLOATS_HEADER, KINDS_BY_VERSION,
                                                           MAGICS, MAX_HEAD_BYTES,
                                                           MAX_STREAM_BYTES,
                                                           PREDICTED_BLOCK, PREDICTED_HEADER,
                                                           RAW_CODING, STREAM_HEADER,
                                                           TAIL_HEADER)
from dcpctl.format.codecs.per_thread import PerThread

_SMALL_STREAM_BYTES = 64 << 10
# This thread's zstd decompressor, reused from stream to stream.
_decompressors: PerThread[zstandard.ZstdDecompressor] = PerThread(zstandard.ZstdDecompressor)


@dataclass
class _Stream:
    coding: int
    decoded_bytes: int
    stored: memoryview
    position: int


@dataclass
class _Block:
    decoded_bytes: int
    layout: FloatLayout | None = None  # None for a block of plain bytes
    streams: list[_Stream] = field(default_factory=list)
    row_length: int = 0  # for a PREDICTED block: its elements' row length, else 0
    decoded: bytes | None = None  # where scanning decoded it already: a head, a TAIL block
    payload_crc: int | None = None  # for a TAIL block: the CRC-32 it gives the payload
    is_head: bool = False


class FloatSplitDecoder:
    """Decodes one item given piece by piece; `finish` raises if the item was cut short.

    With checks_payload, a tensor archive's payload is checked against the CRC-32 its TAIL
    block gives (DataError where they differ): for readers that check nothing else, as torch's
    load does not (dcpctl's own commands check every record of the archive decoded)."""

    def __init__(self, max_bytes: int | None = None, checks_payload: bool = False) -> None:
        self._checks_payload = checks_payload
        self._payload_crc = 0  # of the blocks decoded after the head so far
        self._max_bytes = max_bytes  # what the item can hold: a block past it is not decoded
        self._pending: list = []  # pieces that hold the start of a block not complete yet
        self._pending_bytes = 0
        self._wanted_bytes = 0  # how many pending bytes that block is known to need
        self._view_start = 0  # stream offset of the bytes being scanned, for messages
        self._started = False
        self._version = 0
        self._head: bytes | None = None  # the first block's bytes, where it is short
        self._ended = False
        self._decoded_bytes = 0

    def decode(self, piece: bytes) -> Iterator[bytes]:
        """The decoded bytes of every block that `piece` completes, one piece per block."""
        if self._ended:
            if piece:
                raise DataError("bytes follow the end of the floatsplit stream")
            return
        # Pieces wait here for the rest of their block: bytes cannot change meanwhile, other
        # buffers can, so those are copied.
        self._pending.append(piece if isinstance(piece, bytes) else bytes(piece))
        self._pending_bytes += len(piece)
        if self._pending_bytes < self._wanted_bytes:
            return  # joining the pieces before the block is complete would only copy them again
        view = memoryview(self._pending[0] if len(self._pending) == 1 else b"".join(self._pending))
        position = self._check_magic(view)
        blocks = []
        while not self._ended:
            block, block_end = self._scan_block(view, position)
            if block is None:
                self._wanted_bytes = block_end - position
                break
            blocks.append(block)
            position = block_end
        leftover = view[position:]
        self._pending, self._pending_bytes = [leftover] if leftover else [], len(leftover)
        self._view_start += position
        if self._ended and leftover:
            raise DataError("bytes follow the end of the floatsplit stream")
        for block in blocks:
            if block.decoded_bytes:
                decoded = self._decode_block(block)
                if self._checks_payload:
                    self._check_payload(block, decoded)
                yield decoded

    def _check_payload(self, block: _Block, decoded) -> None:
        if block.payload_crc is not None:
            if block.payload_crc and block.payload_crc != self._payload_crc:  # 0: none kept
                raise DataError(f"the tensor's bytes decode to CRC-32 {self._payload_crc:08x}, "
                                f"the stream says {block.payload_crc:08x}: damaged")
        elif not block.is_head:
            self._payload_crc = zlib.crc32(decoded, self._payload_crc)

    def finish(self) -> None:
        if not self._ended:
            raise DataError(f"floatsplit stream is cut short at byte "
                            f"{self._view_start + self._pending_bytes}")

    def _check_magic(self, view: memoryview) -> int:
        magic_bytes = len(next(iter(MAGICS)))
        if self._started or len(view) < magic_bytes:
            return 0
        self._version = MAGICS.get(bytes(view[:magic_bytes]), 0)
        if not self._version:
            raise DataError(f"not a floatsplit stream: it starts with "
                            f"{bytes(view[:magic_bytes])!r}, not one of {sorted(MAGICS)}")
        self._started = True
        return magic_bytes

    def _scan_block(self, view: memoryview, position: int) -> tuple[_Block | None, int]:
        """The block at position and where it ends; while it is incomplete, None and where the
        bytes it is known to need so far end."""
        if not self._started or position >= len(view):
            return None, position
        kind = view[position]
        if kind not in KINDS_BY_VERSION[self._version]:
            raise self._damage(position, f"unknown block kind {kind} in a version "
                                         f"{self._version} stream")
        if kind == END_BLOCK:
            return self._scan_end(view, position)
        if kind == BYTES_BLOCK:
            stream, end = self._scan_stream(view, position + 1)
            block = _Block(stream.decoded_bytes, streams=[stream]) if stream else None
            if block and self._decoded_bytes == 0 and block.decoded_bytes <= MAX_HEAD_BYTES:
                # the first block may be a tensor archive's head, which a TAIL block needs
                block.decoded = self._head = self._stream_bytes(stream)
                block.is_head = True
        elif kind == FLOATS_BLOCK:
            block, end = self._scan_floats(view, position)
        elif kind == PREDICTED_BLOCK:
            block, end = self._scan_predicted(view, position)
        else:
            block, end = self._scan_tail(view, position)
        if block is None:
            return None, end
        self._decoded_bytes += block.decoded_bytes
        if self._max_bytes is not None and self._decoded_bytes > self._max_bytes:
            raise past_the_item_error(self._max_bytes)
        return block, end

    def _scan_end(self, view: memoryview, position: int) -> tuple[_Block | None, int]:
        if position + END_HEADER.size > len(view):
            return None, position + END_HEADER.size
        _, total_bytes = END_HEADER.unpack_from(view, position)
        if total_bytes != self._decoded_bytes:
            raise self._damage(position, f"the end block counts {total_bytes} decoded bytes, "
                                         f"the blocks before it {self._decoded_bytes}")
        self._ended = True
        return _Block(0), position + END_HEADER.size

    def _scan_floats(self, view: memoryview, position: int) -> tuple[_Block | None, int]:
        if position + FLOATS_HEADER.size > len(view):
            return None, position + FLOATS_HEADER.size
        _, code, elements = FLOATS_HEADER.unpack_from(view, position)
        layout = LAYOUTS_BY_CODE.get(code)
        if layout is None:
            raise self._damage(position, f"unknown float layout {code}")
        block = _Block(elements * layout.itemsize, layout)
        end = position + FLOATS_HEADER.size
        for _ in range(layout.itemsize):
            stream, end = self._scan_stream(view, end)
            if stream is None:
                return None, end
            if stream.decoded_bytes != elements:
                raise self._damage_at(stream.position, f"a {layout.name} plane holds "
                                      f"{stream.decoded_bytes} bytes for {elements} elements")
            block.streams.append(stream)
        return block, end

    def _scan_tail(self, view: memoryview, position: int) -> tuple[_Block | None, int]:
        size = tail_block_size(view, position)
        if size is None or position + size > len(view):
            return None, position + (size or TAIL_HEADER.size)
        tail = None
        if self._head is not None:
            tail = tail_of_block(view[position:position + size], self._head,
                                 self._decoded_bytes - len(self._head))
        if tail is None:
            raise self._damage(position, "a tail block that follows no torch.save archive's "
                                         "head and payload it can end, or with a version "
                                         "record torch.save does not write")
        payload_crc = TAIL_HEADER.unpack_from(view, position)[1]
        return _Block(len(tail), decoded=tail, payload_crc=payload_crc), position + size

    def _scan_predicted(self, view: memoryview, position: int) -> tuple[_Block | None, int]:
        if position + PREDICTED_HEADER.size > len(view):
            return None, position + PREDICTED_HEADER.size
        _, code, elements, row_length, escaped = PREDICTED_HEADER.unpack_from(view, position)
        layout = PREDICTED_LAYOUTS.get(code)
        if layout is None:
            raise self._damage(position, f"unknown predicted float layout {code}")
        if not row_length or elements % row_length or escaped > elements:
            raise self._damage(position, f"a predicted block of {elements} elements has rows "
                                         f"of {row_length} and {escaped} escaped elements")
        lengths = [row_length, elements // row_length, elements, elements, 2 * escaped]
        lengths += [elements] * (stream_count(layout) - len(lengths))
        block = _Block(elements * layout.itemsize, layout, row_length=row_length)
        end = position + PREDICTED_HEADER.size
        for length in lengths:
            stream, end = self._scan_stream(view, end)
            if stream is None:
                return None, end
            if stream.decoded_bytes != length:
                raise self._damage_at(stream.position, f"a predicted {layout.name} block's "
                                      f"sub-stream holds {stream.decoded_bytes} bytes, not "
                                      f"{length}")
            block.streams.append(stream)
        return block, end

    def _scan_stream(self, view: memoryview, position: int) -> tuple[_Stream | None, int]:
        if position + STREAM_HEADER.size > len(view):
            return None, position + STREAM_HEADER.size
        coding, decoded_bytes, stored_bytes = STREAM_HEADER.unpack_from(view, position)
        if coding not in CODINGS_BY_VERSION[self._version]:
            raise self._damage(position, f"unknown stream coding {coding}")
        if decoded_bytes > MAX_STREAM_BYTES or stored_bytes > MAX_STREAM_BYTES:
            raise self._damage(position, f"a stream claims {max(decoded_bytes, stored_bytes)} "
                                         f"bytes, more than {MAX_STREAM_BYTES}")
        if coding == RAW_CODING and stored_bytes != decoded_bytes:
            raise self._damage(position, f"a raw stream stores {stored_bytes} bytes for "
                                         f"{decoded_bytes}")
        start = position + STREAM_HEADER.size
        if start + stored_bytes > len(view):
            return None, start + stored_bytes
        return (_Stream(coding, decoded_bytes, view[start:start + stored_bytes],
                        self._view_start + position), start + stored_bytes)

    def _decode_block(self, block: _Block):
        if block.decoded is not None:
            return block.decoded
        if block.layout is None:
            return self._stream_bytes(block.streams[0])
        # Every byte is written by the join: uninitialized memory spares zeroing it first.
        decoded = numpy.empty(block.decoded_bytes, dtype=numpy.uint8)
        planes = [self._plane(stream, index) for index, stream in enumerate(block.streams)]
        if block.row_length:
            join_predicted(block.layout, block.row_length, planes, decoded)
        else:
            join_planes(block.layout, planes, decoded)
        return memoryview(decoded)

    def _plane(self, stream: _Stream, index: int):
        """A plane's bytes: where they lie if raw, else decoded (large ones into scratch)."""
        if stream.coding == RAW_CODING:
            return stream.stored
        if stream.decoded_bytes <= _SMALL_STREAM_BYTES:
            return self._stream_bytes(stream)
        plane = scratch_plane(index, stream.decoded_bytes)
        try:
            filled, surplus = self._decompress_into(stream, plane)
        except zstandard.ZstdError as error:
            raise self._undecodable(stream, error) from None
        self._check_length(stream, filled, surplus)
        return plane

    def _stream_bytes(self, stream: _Stream) -> bytes:
        """The decoded bytes of a stream, as a new bytes object."""
        if stream.coding == RAW_CODING:
            return bytes(stream.stored)
        try:
            # zstd allocates what the frame says it holds: a claim the header denies is damage.
            claimed = zstandard.frame_content_size(stream.stored)
            if claimed not in (-1, stream.decoded_bytes):
                raise self._damage_at(stream.position, f"a zstd frame claims {claimed} bytes, "
                                                       f"its header {stream.decoded_bytes}")
            decoded = _decompressor(stream).decompress(stream.stored,
                                                       max_output_size=stream.decoded_bytes)
        except zstandard.ZstdError as error:
            raise self._undecodable(stream, error) from None
        self._check_length(stream, len(decoded), b"")
        return decoded

    def _undecodable(self, stream: _Stream, error: zstandard.ZstdError) -> DataError:
        return self._damage_at(stream.position, f"zstd frame does not decode ({error})")

    def _check_length(self, stream: _Stream, filled: int, surplus: bytes) -> None:
        if filled != stream.decoded_bytes or surplus:
            more = "more than " if surplus else ""
            raise self._damage_at(stream.position, f"a stream decodes to {more}{filled} bytes, "
                                  f"its header says {stream.decoded_bytes}")

    def _decompress_into(self, stream: _Stream, target) -> tuple[int, bytes]:
        """Decompress a stream's zstd frame into target; the bytes filled and any beyond it."""
        reader = _decompressor(stream).stream_reader(stream.stored)
        filled = 0
        with memoryview(target) as window:
            while filled < len(window):
                count = reader.readinto(window[filled:])
                if not count:
                    break
                filled += count
        return filled, reader.read(1)

    def _damage(self, position: int, what: str) -> DataError:
        """An error at `position` of the bytes being scanned."""
        return self._damage_at(self._view_start + position, what)

    @staticmethod
    def _damage_at(stream_offset: int, what: str) -> DataError:
        return DataError(f"floatsplit stream damaged at byte {stream_offset}: {what}")


def _decompressor(stream: _Stream) -> zstandard.ZstdDecompressor:
    """This thread's decompressor for a zstd-coded stream: with the framing dictionary or not."""
    return framing_decompressor() if stream.coding == DICTIONARY_CODING else _decompressors.get()

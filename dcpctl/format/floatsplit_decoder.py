"""Decode the floatsplit stream (docs/floatsplit.md) piece by piece, from its bytes alone.

Each `decode` call first finds the blocks its input completes, then decodes each into a buffer
of its own, handed out as one piece: float planes are joined straight into it, zstd-coded planes
are decompressed into scratch memory, raw planes are read where they lie. Anything that does
not add up raises DataError naming the byte offset in the stream.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Iterator

import zstandard

from dcpctl.errors import DataError
from dcpctl.format.float_planes import LAYOUTS_BY_CODE, FloatLayout, join_planes, scratch_plane
from dcpctl.format.floatsplit import BYTES_BLOCK, END_BLOCK, END_HEADER, FLOATS_BLOCK, \
    FLOATS_HEADER, MAGIC, MAX_STREAM_BYTES, RAW_CODING, STREAM_HEADER, ZSTD_CODING

_SMALL_STREAM_BYTES = 64 << 10
_decompressors = threading.local()


def _decompressor() -> zstandard.ZstdDecompressor:
    """This thread's zstd decompressor, reused from stream to stream."""
    decompressor = getattr(_decompressors, "decompressor", None)
    if decompressor is None:
        decompressor = _decompressors.decompressor = zstandard.ZstdDecompressor()
    return decompressor


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


class FloatSplitDecoder:
    """Decodes one item given piece by piece; `finish` raises if the item was cut short."""

    def __init__(self) -> None:
        self._pending = b""  # the start of a block the next piece completes
        self._view_start = 0  # stream offset of the bytes being scanned, for messages
        self._started = False
        self._ended = False
        self._decoded_bytes = 0

    def decode(self, piece: bytes) -> Iterator[bytes]:
        """The decoded bytes of every block that `piece` completes, one piece per block."""
        if self._ended:
            if piece:
                raise DataError("bytes follow the end of the floatsplit stream")
            return
        data = self._pending + piece if self._pending else piece
        view = memoryview(data)
        position = self._check_magic(view)
        blocks = []
        while not self._ended:
            block, block_end = self._scan_block(view, position)
            if block is None:
                break
            blocks.append(block)
            position = block_end
        self._pending = bytes(view[position:])
        self._view_start += position
        if self._ended and self._pending:
            raise DataError("bytes follow the end of the floatsplit stream")
        for block in blocks:
            if block.decoded_bytes:
                yield self._decode_block(block)

    def finish(self) -> None:
        if not self._ended:
            raise DataError(f"floatsplit stream is cut short at byte "
                            f"{self._view_start + len(self._pending)}")

    def _check_magic(self, view: memoryview) -> int:
        if self._started or len(view) < len(MAGIC):
            return 0
        if view[:len(MAGIC)] != MAGIC:
            raise DataError(f"not a floatsplit stream: it starts with "
                            f"{bytes(view[:len(MAGIC)])!r}, not {MAGIC!r}")
        self._started = True
        return len(MAGIC)

    def _scan_block(self, view: memoryview, position: int) -> tuple[_Block | None, int]:
        """The block at position and where it ends; (None, position) while incomplete."""
        if not self._started or position >= len(view):
            return None, position
        kind = view[position]
        if kind == END_BLOCK:
            return self._scan_end(view, position)
        if kind == BYTES_BLOCK:
            stream, end = self._scan_stream(view, position + 1)
            block = _Block(stream.decoded_bytes, streams=[stream]) if stream else None
        elif kind == FLOATS_BLOCK:
            block, end = self._scan_floats(view, position)
        else:
            raise self._damage(position, f"unknown block kind {kind}")
        if block is None:
            return None, position
        self._decoded_bytes += block.decoded_bytes
        return block, end

    def _scan_end(self, view: memoryview, position: int) -> tuple[_Block | None, int]:
        if position + END_HEADER.size > len(view):
            return None, position
        _, total_bytes = END_HEADER.unpack_from(view, position)
        if total_bytes != self._decoded_bytes:
            raise self._damage(position, f"the end block counts {total_bytes} decoded bytes, "
                                         f"the blocks before it {self._decoded_bytes}")
        self._ended = True
        return _Block(0), position + END_HEADER.size

    def _scan_floats(self, view: memoryview, position: int) -> tuple[_Block | None, int]:
        if position + FLOATS_HEADER.size > len(view):
            return None, position
        _, code, elements = FLOATS_HEADER.unpack_from(view, position)
        layout = LAYOUTS_BY_CODE.get(code)
        if layout is None:
            raise self._damage(position, f"unknown float layout {code}")
        block = _Block(elements * layout.itemsize, layout)
        end = position + FLOATS_HEADER.size
        for _ in range(layout.itemsize):
            stream, end = self._scan_stream(view, end)
            if stream is None:
                return None, position
            if stream.decoded_bytes != elements:
                raise self._damage_at(stream.position, f"a {layout.name} plane holds "
                                      f"{stream.decoded_bytes} bytes for {elements} elements")
            block.streams.append(stream)
        return block, end

    def _scan_stream(self, view: memoryview, position: int) -> tuple[_Stream | None, int]:
        if position + STREAM_HEADER.size > len(view):
            return None, position
        coding, decoded_bytes, stored_bytes = STREAM_HEADER.unpack_from(view, position)
        if coding not in (RAW_CODING, ZSTD_CODING):
            raise self._damage(position, f"unknown stream coding {coding}")
        if decoded_bytes > MAX_STREAM_BYTES or stored_bytes > MAX_STREAM_BYTES:
            raise self._damage(position, f"a stream claims {max(decoded_bytes, stored_bytes)} "
                                         f"bytes, more than {MAX_STREAM_BYTES}")
        if coding == RAW_CODING and stored_bytes != decoded_bytes:
            raise self._damage(position, f"a raw stream stores {stored_bytes} bytes for "
                                         f"{decoded_bytes}")
        start = position + STREAM_HEADER.size
        if start + stored_bytes > len(view):
            return None, position
        return (_Stream(coding, decoded_bytes, view[start:start + stored_bytes],
                        self._view_start + position), start + stored_bytes)

    def _decode_block(self, block: _Block) -> bytearray:
        decoded = bytearray(block.decoded_bytes)
        if block.layout is None:
            self._decode_stream(block.streams[0], decoded)
        else:
            planes = [self._plane(stream, index) for index, stream in enumerate(block.streams)]
            join_planes(block.layout, planes, decoded)
        return decoded

    def _plane(self, stream: _Stream, index: int):
        if stream.coding == RAW_CODING:
            return stream.stored
        plane = scratch_plane(index, stream.decoded_bytes)
        self._decode_stream(stream, plane)
        return plane

    def _decode_stream(self, stream: _Stream, target) -> None:
        """Decode a stream into target, which is exactly as long as it decodes to."""
        if stream.coding == RAW_CODING:
            memoryview(target).cast("B")[:] = stream.stored
            return
        try:
            if stream.decoded_bytes <= _SMALL_STREAM_BYTES:  # not worth a reader
                decoded = _decompressor().decompress(stream.stored,
                                                        max_output_size=stream.decoded_bytes)
                filled, surplus = len(decoded), b""
                if filled == stream.decoded_bytes:
                    memoryview(target).cast("B")[:] = decoded
            else:
                filled, surplus = self._decompress_into(stream.stored, target)
        except zstandard.ZstdError as error:
            raise self._damage_at(stream.position,
                                  f"zstd frame does not decode ({error})") from None
        if filled != stream.decoded_bytes or surplus:
            raise self._damage_at(stream.position, f"a stream decodes to "
                                                f"{'more than ' if surplus else ''}{filled} "
                                                f"bytes, its header says {stream.decoded_bytes}")

    def _decompress_into(self, stored: memoryview, target) -> tuple[int, bytes]:
        """Decompress a zstd frame into target; the bytes filled and any beyond it."""
        reader = _decompressor().stream_reader(stored)
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

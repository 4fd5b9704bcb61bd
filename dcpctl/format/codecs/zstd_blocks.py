"""Cut a zstd frame, as it streams in, at its block boundaries, without decoding it.

A zstd block decodes to at most 128 KiB, but one piece of stored bytes can hold thousands of
blocks (a gigabyte of zeros compresses to kilobytes). Handing a decoder one block at a time
keeps every decoded piece small. The walk also tells where the frame ends, so a frame cut short
or followed by stray bytes is caught. Layout: RFC 8878, sections 3.1.1.1 and 3.1.1.2.
"""

from __future__ import annotations

from typing import Iterator

from dcpctl.errors import DataError

ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
_DICTIONARY_ID_BYTES = (0, 1, 2, 4)
_CONTENT_SIZE_BYTES = (0, 2, 4, 8)
_RLE = 1


_HEADER, _BLOCKS, _CHECKSUM, _DONE = "header", "blocks", "checksum", "done"


class ZstdBlockSplitter:
    """Feed stored bytes in any pieces; get them back cut after the frame header and after
    each block, so that each cut holds at most one block."""

    def __init__(self) -> None:
        self._pending = b""
        self._state = _HEADER
        self._has_checksum = False

    def feed(self, piece: bytes) -> Iterator[bytes]:
        """The complete segments (header, blocks, checksum) now available."""
        pending = memoryview(self._pending + piece if self._pending else piece)
        start = 0
        while True:
            if self._state == _DONE:
                if start < len(pending):
                    raise DataError("bytes follow the end of the zstd frame")
                break
            step = self._next_segment(pending[start:start + 18])
            if step is None or start + step[0] > len(pending):
                break
            size, self._state = step
            yield pending[start:start + size]
            start += size
        self._pending = bytes(pending[start:])

    def finish(self) -> None:
        """Raise DataError unless the frame ended exactly where the stored bytes did."""
        if self._state != _DONE:
            raise DataError("zstd frame is cut short")

    def _next_segment(self, head: memoryview) -> tuple[int, str] | None:
        """The size of the next segment (which starts with head) and the state after it, once
        enough bytes show it."""
        if self._state == _HEADER:
            return self._header_size(head)
        if self._state == _CHECKSUM:
            return 4, _DONE
        if len(head) < 3:
            return None
        header = int.from_bytes(head[:3], "little")
        last, block_type, block_size = header & 1, (header >> 1) & 3, header >> 3
        if block_type == 3:
            raise DataError("zstd frame has a block of the reserved type")
        size = 3 + (1 if block_type == _RLE else block_size)
        if not last:
            return size, _BLOCKS
        return size, (_CHECKSUM if self._has_checksum else _DONE)

    def _header_size(self, head: memoryview) -> tuple[int, str] | None:
        if len(head) < 5:
            return None
        if bytes(head[:4]) != ZSTD_MAGIC:
            raise DataError("stored bytes do not start a zstd frame")
        descriptor = head[4]
        single_segment = bool(descriptor & 0x20)
        self._has_checksum = bool(descriptor & 0x04)
        content_size_bytes = _CONTENT_SIZE_BYTES[descriptor >> 6] or (1 if single_segment else 0)
        size = (5 + (0 if single_segment else 1) + _DICTIONARY_ID_BYTES[descriptor & 3]
                + content_size_bytes)
        return size, _BLOCKS

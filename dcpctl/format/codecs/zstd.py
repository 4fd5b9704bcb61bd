"""torch's own `stream.zstd/1` transform: one zstd frame over the item's bytes."""

from __future__ import annotations

from typing import Iterator

import zstandard

from dcpctl.errors import DataError
from dcpctl.format.codecs.per_thread import PerThread
from dcpctl.format.codecs.zstd_blocks import ZstdBlockSplitter

# This thread's compressors not in use, by (level, whether frames record their size).
_idle_compressors: PerThread[dict[tuple[int, bool], list]] = PerThread(dict)


class ZstdEncoder:
    """One zstd frame, carrying zstd's own checksum of its content (what torch or any zstd
    reader checks as it decodes), coded with a compressor borrowed from this thread's idle
    ones: making one per item would cost more than coding a small item, under the GIL. An item
    given whole in one piece is coded in one call, which spares zstd's streaming buffers."""

    def __init__(self, level: int, size_bytes: int | None) -> None:
        self._key = (level, size_bytes is not None)
        self._size_bytes = size_bytes
        idle = _idle_compressors.get().setdefault(self._key, [])
        self._compressor = idle.pop() if idle else zstandard.ZstdCompressor(
            level=level, write_content_size=size_bytes is not None, write_checksum=True)
        self._stream = None
        self._coded_whole = False

    def encode(self, piece: bytes) -> bytes:
        if self._stream is None:
            if not self._coded_whole and len(piece) == self._size_bytes:
                self._coded_whole = True
                return self._compressor.compress(piece)
            self._stream = self._new_stream()
        return self._stream.compress(piece)

    def finish(self) -> bytes:
        if self._coded_whole:  # no stream was started after the whole item
            ending = b""
        else:  # a stream ends its frame here; an empty item's frame is made here whole
            ending = (self._stream or self._new_stream()).flush()
        # only a finished frame frees its compressor; an abandoned one keeps it
        _idle_compressors.get().setdefault(self._key, []).append(self._compressor)
        return ending

    def _new_stream(self):
        if self._coded_whole:
            raise ValueError("zstd encoder given more bytes than the item's size")
        # a new compressobj starts a new frame, whatever the compressor did before
        return self._compressor.compressobj(
            size=self._size_bytes if self._size_bytes is not None else -1)


class ZstdDecoder:
    """Feeds the decompressor one block at a time, so no decoded piece passes 128 KiB however
    well the item compressed (a gigabyte of zeros is a few kilobytes of zstd)."""

    def __init__(self) -> None:
        self._stream = zstandard.ZstdDecompressor().decompressobj()
        self._blocks = ZstdBlockSplitter()

    def decode(self, piece: bytes) -> Iterator[bytes]:
        for segment in self._blocks.feed(piece):
            try:
                decoded = self._stream.decompress(segment)
            except zstandard.ZstdError as error:
                raise DataError(f"zstd frame does not decode ({error})") from None
            if decoded:
                yield decoded

    def finish(self) -> None:
        self._blocks.finish()
        if not self._stream.eof:
            raise DataError("zstd frame is cut short")

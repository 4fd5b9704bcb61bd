"""Stream codecs keyed by DCP transform descriptor: identity (no descriptor), torch's zstd and
dcpctl's own floatsplit."""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Iterable, Iterator, Protocol, Sequence

import zstandard

from dcpctl.errors import DataError, UnsupportedLayoutError
from dcpctl.format.codecs.names import (FLOATSPLIT, FLOATSPLIT_DESCRIPTOR, IDENTITY_NAME, ZSTD,
                                       ZSTD_DESCRIPTOR, codec_name_for_descriptors)
from dcpctl.format.codecs.zstd_blocks import ZstdBlockSplitter

DEFAULT_ZSTD_LEVEL = 3
_ZSTD_READ_BYTES = 1 << 20
# Small, so that one read decodes few floatsplit blocks (each at most 4 MiB as dcpctl writes them).
_FLOATSPLIT_READ_BYTES = 64 << 10


class Encoder(Protocol):
    """Encodes one item given piece by piece."""

    def encode(self, piece: bytes) -> bytes: ...

    def finish(self) -> bytes: ...


class Readable(Protocol):
    """A stream read with `read(size)`, which returns b"" at the end."""

    def read(self, size: int) -> bytes: ...


class Decoder(Protocol):
    """Decodes one item given piece by piece, each stored piece into decoded pieces of bounded
    size; `finish` raises if the item was cut short."""

    def decode(self, piece: bytes) -> Iterator[bytes]: ...

    def finish(self) -> None: ...


@dataclass(frozen=True)
class PayloadHint:
    """Where a tensor item's raw bytes are: what the encoder splits. The tensor's dtype (torch's
    name) and the byte count of its elements; decoding never needs it."""

    dtype_name: str
    payload_bytes: int


@dataclass(frozen=True)
class Codec:
    """A stream transform: its descriptor list as recorded in the metadata, and its coders."""

    name: str
    descriptors: tuple[str, ...]
    level: int | None = None

    def new_encoder(self, size_bytes: int | None = None,
                    payload: PayloadHint | None = None) -> Encoder:
        """An encoder for one item of `size_bytes` decoded bytes (None if unknown); codecs that
        split tensor payloads use the payload hint, the others ignore it."""
        if not self.descriptors:
            return _IdentityCoder()
        if self.name == FLOATSPLIT:
            from dcpctl.format.codecs.floatsplit.encoder import FloatSplitEncoder  # numpy loads only when used
            return FloatSplitEncoder(self.level or DEFAULT_ZSTD_LEVEL, payload)
        return _ZstdEncoder(self.level or DEFAULT_ZSTD_LEVEL, size_bytes)

    def new_decoder(self) -> Decoder:
        """A decoder for one item."""
        if not self.descriptors:
            return _IdentityCoder()
        if self.name == FLOATSPLIT:
            return _new_floatsplit_decoder()
        return _ZstdDecoder()

    def open_reader(self, stored: Readable) -> Readable:
        """The decoded bytes of an item, read from a stream of its stored bytes. Each read
        returns at most the bytes asked for, so memory stays bounded however well the item
        compressed (4 MiB of zstd can hold gigabytes of zeros)."""
        if not self.descriptors:
            return stored
        if self.name == FLOATSPLIT:
            return _DecodingReader(stored, _new_floatsplit_decoder(), _FLOATSPLIT_READ_BYTES)
        return _DecodingReader(stored, _ZstdDecoder(), _ZSTD_READ_BYTES)


def _new_floatsplit_decoder() -> Decoder:
    from dcpctl.format.codecs.floatsplit.decoder import FloatSplitDecoder  # numpy loads only when used
    return FloatSplitDecoder()


IDENTITY = Codec(IDENTITY_NAME, ())


def zstd_codec(level: int = DEFAULT_ZSTD_LEVEL) -> Codec:
    """torch's own `stream.zstd/1` transform at a given compression level."""
    return Codec(ZSTD, (ZSTD_DESCRIPTOR,), _checked_level(level))


def floatsplit_codec(level: int = DEFAULT_ZSTD_LEVEL) -> Codec:
    """dcpctl's `dcpctl.floatsplit/1` transform; level is that of its plain zstd parts."""
    return Codec(FLOATSPLIT, (FLOATSPLIT_DESCRIPTOR,), _checked_level(level))


_CODEC_MAKERS = {ZSTD: zstd_codec, FLOATSPLIT: floatsplit_codec}
CODEC_NAMES = tuple(_CODEC_MAKERS)


def codec_by_name(name: str, level: int = DEFAULT_ZSTD_LEVEL) -> Codec:
    """The codec a user names: `zstd` or `floatsplit`."""
    if name not in _CODEC_MAKERS:
        raise UnsupportedLayoutError(f"unknown codec {name!r}; dcpctl writes "
                                     f"{', '.join(CODEC_NAMES)}")
    return _CODEC_MAKERS[name](level)


def _checked_level(level: int) -> int:
    if not 1 <= level <= 22:
        raise UnsupportedLayoutError(f"zstd level {level} is outside 1..22")
    return level


def codec_for_descriptors(descriptors: Sequence[str] | None) -> Codec:
    """The codec that decodes an item stored with these transform descriptors."""
    name = codec_name_for_descriptors(descriptors)
    if name == IDENTITY.name:
        return IDENTITY
    if name is not None:
        return _CODEC_MAKERS[name]()
    raise UnsupportedLayoutError(
        f"unknown transform {list(descriptors)}; dcpctl reads items with no transform, "
        f"with {ZSTD_DESCRIPTOR!r} or with {FLOATSPLIT_DESCRIPTOR!r}"
    )


def iter_encoded(encoder: Encoder, pieces: Iterable[bytes]) -> Iterator[bytes]:
    """The encoded bytes of an item's pieces, its frame ended; empty outputs are left out."""
    for piece in pieces:
        encoded = encoder.encode(piece)
        if encoded:
            yield encoded
    ending = encoder.finish()
    if ending:
        yield ending


def iter_decoded(decoder: Decoder, pieces: Iterable[bytes]) -> Iterator[bytes]:
    """The decoded bytes of an item's stored pieces; raises DataError if they end too soon."""
    for piece in pieces:
        yield from decoder.decode(piece)
    decoder.finish()


class _IdentityCoder:
    def encode(self, piece: bytes) -> bytes:
        return piece

    def decode(self, piece: bytes) -> Iterator[bytes]:
        yield piece

    def finish(self) -> bytes:
        return b""


class _ZstdEncoder:
    """One zstd frame, coded with a compressor borrowed from this thread's idle ones: making
    one per item would cost more than coding a small item, under the GIL. An item given whole
    in one piece is coded in one call, which spares zstd's streaming buffers."""

    def __init__(self, level: int, size_bytes: int | None) -> None:
        self._key = (level, size_bytes is not None)
        self._size_bytes = size_bytes
        idle = _idle_compressors(self._key)
        self._compressor = idle.pop() if idle else zstandard.ZstdCompressor(
            level=level, write_content_size=size_bytes is not None)
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
        _idle_compressors(self._key).append(self._compressor)
        return ending

    def _new_stream(self):
        if self._coded_whole:
            raise ValueError("zstd encoder given more bytes than the item's size")
        # a new compressobj starts a new frame, whatever the compressor did before
        return self._compressor.compressobj(
            size=self._size_bytes if self._size_bytes is not None else -1)


_thread_compressors = threading.local()


def _idle_compressors(key: tuple[int, bool]) -> list[zstandard.ZstdCompressor]:
    """This thread's compressors for (level, whether frames record their size) not in use."""
    idle_by_key = getattr(_thread_compressors, "idle", None)
    if idle_by_key is None:
        idle_by_key = _thread_compressors.idle = {}
    return idle_by_key.setdefault(key, [])


class _ZstdDecoder:
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


class _DecodingReader:
    """An item's decoded bytes, read by feeding its stored bytes to a piece-wise decoder."""

    def __init__(self, stored: Readable, decoder: Decoder, read_bytes: int) -> None:
        self._pieces = iter_decoded(decoder, iter(lambda: stored.read(read_bytes), b""))
        self._piece: object = b""
        self._view = memoryview(b"")
        self._offset = 0

    def read(self, size: int = -1) -> bytes:
        if size < 0:
            return b"".join(iter(lambda: self.read(1 << 30), b""))
        while self._offset >= len(self._view):
            piece = next(self._pieces, None)
            if piece is None:
                return b""
            self._piece, self._view, self._offset = piece, memoryview(piece).cast("B"), 0
        if self._offset == 0 and size >= len(self._view) and type(self._piece) is bytes:
            self._offset = len(self._view)
            return self._piece  # a whole decoded piece goes out as it is, uncopied
        chunk = bytes(self._view[self._offset:self._offset + size])
        self._offset += len(chunk)
        return chunk

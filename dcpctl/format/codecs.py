"""Stream codecs keyed by DCP transform descriptor: identity (no descriptor) and torch's zstd."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Protocol, Sequence

import zstandard

from dcpctl.errors import DataError, UnsupportedLayoutError
from dcpctl.format.zstd_blocks import ZstdBlockSplitter

ZSTD_DESCRIPTOR = "stream.zstd/1"
DEFAULT_ZSTD_LEVEL = 3
_ZSTD_READ_BYTES = 1 << 20


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
class Codec:
    """A stream transform: its descriptor list as recorded in the metadata, and its coders."""

    name: str
    descriptors: tuple[str, ...]
    level: int | None = None

    def new_encoder(self, size_bytes: int | None = None) -> Encoder:
        """An encoder for one item of `size_bytes` decoded bytes (None if unknown)."""
        if not self.descriptors:
            return _IdentityCoder()
        return _ZstdEncoder(self.level or DEFAULT_ZSTD_LEVEL, size_bytes)

    def new_decoder(self) -> Decoder:
        """A decoder for one item."""
        if not self.descriptors:
            return _IdentityCoder()
        return _ZstdDecoder()

    def open_reader(self, stored: Readable) -> Readable:
        """The decoded bytes of an item, read from a stream of its stored bytes. Each read
        returns at most the bytes asked for, so memory stays bounded however well the item
        compressed (4 MiB of zstd can hold gigabytes of zeros)."""
        if not self.descriptors:
            return stored
        return _ZstdReader(stored)


IDENTITY = Codec("none", ())


def zstd_codec(level: int = DEFAULT_ZSTD_LEVEL) -> Codec:
    """torch's own `stream.zstd/1` transform at a given compression level."""
    if not 1 <= level <= 22:
        raise UnsupportedLayoutError(f"zstd level {level} is outside 1..22")
    return Codec("zstd", (ZSTD_DESCRIPTOR,), level)


def codec_for_descriptors(descriptors: Sequence[str] | None) -> Codec:
    """The codec that decodes an item stored with these transform descriptors."""
    if not descriptors:
        return IDENTITY
    if len(descriptors) == 1:
        name, _, version = descriptors[0].partition("/")
        if name == "stream.zstd" and version.partition(".")[0] == "1":
            return zstd_codec()
    raise UnsupportedLayoutError(
        f"unknown transform {list(descriptors)}; dcpctl reads items with no transform "
        f"or with {ZSTD_DESCRIPTOR!r}"
    )


def describe_codec(descriptors: Sequence[str] | None) -> str:
    """A short human name for an item's transforms: `none`, `zstd` or the raw descriptors."""
    try:
        return codec_for_descriptors(descriptors).name
    except UnsupportedLayoutError:
        return "+".join(descriptors or ())


class _IdentityCoder:
    def encode(self, piece: bytes) -> bytes:
        return piece

    def decode(self, piece: bytes) -> Iterator[bytes]:
        yield piece

    def finish(self) -> bytes:
        return b""


class _ZstdEncoder:
    def __init__(self, level: int, size_bytes: int | None) -> None:
        compressor = zstandard.ZstdCompressor(level=level, write_content_size=size_bytes is not None)
        self._stream = compressor.compressobj(size=size_bytes if size_bytes is not None else -1)

    def encode(self, piece: bytes) -> bytes:
        return self._stream.compress(piece)

    def finish(self) -> bytes:
        return self._stream.flush()


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


class _ZstdReader:
    def __init__(self, stored: Readable) -> None:
        self._stream = zstandard.ZstdDecompressor().stream_reader(
            stored, read_size=_ZSTD_READ_BYTES, read_across_frames=False, closefd=False)

    def read(self, size: int) -> bytes:
        try:
            return self._stream.read(size)
        except zstandard.ZstdError as error:
            raise DataError(f"zstd frame does not decode ({error})") from None

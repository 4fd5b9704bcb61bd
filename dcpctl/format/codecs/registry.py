"""The codecs dcpctl reads and writes, by the name a user gives and by the transform
descriptors an item records: the one place that knows them all."""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Sequence

from dcpctl.errors import InvalidOptionError, UnsupportedLayoutError
from dcpctl.format.codecs.base import Decoder, Encoder, IdentityCoder, PayloadHint
from dcpctl.format.codecs.names import (FLOATSPLIT, FLOATSPLIT_DESCRIPTOR,
                                        FLOATSPLIT_MAJOR_VERSIONS, FLOATSPLIT_NAME, IDENTITY_NAME,
                                        ZSTD, ZSTD_DESCRIPTOR, codec_name_for_descriptors)
from dcpctl.format.codecs.zstd import ZstdDecoder, ZstdEncoder

DEFAULT_ZSTD_LEVEL = 3
MIN_ZSTD_LEVEL, MAX_ZSTD_LEVEL = 1, 22
FLOATSPLIT_FAST_LEVEL = 1
"""floatsplit's level for speed, which a save writes by default: float blocks split into planes
alone, none predicted from their rows and columns, and tensors under 16 KiB coded whole. The
levels above it code for size: 1 to 5% fewer bytes, in 1.2 to 2.4 times the time
(bench/bench_floatsplit.py). All levels write the same stream format (docs/floatsplit.md)."""


@dataclass(frozen=True)
class Codec:
    """A stream transform: its name, its descriptor list as recorded in the metadata (empty for
    items stored as they are), the zstd level it writes with, and its coders."""

    name: str
    descriptors: tuple[str, ...]
    level: int | None = None

    def new_encoder(self, size_bytes: int | None = None,
                    payload: PayloadHint | None = None) -> Encoder:
        """An encoder for one item of `size_bytes` decoded bytes (None if unknown); codecs that
        split tensor payloads use the payload hint, the others ignore it."""
        if self.name == IDENTITY_NAME:
            return IdentityCoder()
        level = self.level or DEFAULT_ZSTD_LEVEL
        if self.name == FLOATSPLIT:
            # numpy loads only when a floatsplit item is coded
            from dcpctl.format.codecs.floatsplit.encoder import FloatSplitEncoder
            return FloatSplitEncoder(level, payload, predicts=level > FLOATSPLIT_FAST_LEVEL)
        return ZstdEncoder(level, size_bytes)

    def new_decoder(self, max_bytes: int | None = None, checks_payload: bool = False
                    ) -> Decoder:
        """A decoder for one item; one that knows its blocks' sizes before decoding them
        (floatsplit's) refuses a block that would take the item past max_bytes. With
        checks_payload, floatsplit's checks a tensor's bytes against the CRC-32 its stream
        keeps (zstd frames that dcpctl writes carry zstd's own checksum)."""
        if self.name == IDENTITY_NAME:
            return IdentityCoder()
        if self.name == FLOATSPLIT:
            from dcpctl.format.codecs.floatsplit.decoder import FloatSplitDecoder
            return FloatSplitDecoder(max_bytes, checks_payload)
        return ZstdDecoder()


IDENTITY = Codec(IDENTITY_NAME, ())


def zstd_codec(level: int = DEFAULT_ZSTD_LEVEL) -> Codec:
    """torch's own `stream.zstd/1` transform at a given compression level."""
    return Codec(ZSTD, (ZSTD_DESCRIPTOR,), _checked_level(level))


def floatsplit_codec(level: int = DEFAULT_ZSTD_LEVEL) -> Codec:
    """dcpctl's `dcpctl.floatsplit/2` transform; level is that of its plain zstd parts. Its
    decoder also reads version 1 streams."""
    return Codec(FLOATSPLIT, (FLOATSPLIT_DESCRIPTOR,), _checked_level(level))


def _identity_codec(level: int = DEFAULT_ZSTD_LEVEL) -> Codec:
    return IDENTITY


_CODEC_MAKERS = {IDENTITY_NAME: _identity_codec, ZSTD: zstd_codec, FLOATSPLIT: floatsplit_codec}
CODEC_NAMES = tuple(_CODEC_MAKERS)
"""Every codec a user can name: `none` (stored as they are), `zstd`, `floatsplit`."""
COMPRESSING_CODEC_NAMES = tuple(name for name in CODEC_NAMES if name != IDENTITY_NAME)


def codec_by_name(name: str, level: int = DEFAULT_ZSTD_LEVEL) -> Codec:
    """The codec a user names (one of CODEC_NAMES), at a zstd level."""
    if name not in _CODEC_MAKERS:
        raise InvalidOptionError(f"unknown codec {name!r}; dcpctl writes "
                                 f"{', '.join(CODEC_NAMES)}")
    return _CODEC_MAKERS[name](level)


def _checked_level(level: int) -> int:
    if isinstance(level, bool) or not isinstance(level, int):
        raise InvalidOptionError(f"level {level!r} is no whole number: give one of "
                                 f"{MIN_ZSTD_LEVEL}..{MAX_ZSTD_LEVEL}")
    if not MIN_ZSTD_LEVEL <= level <= MAX_ZSTD_LEVEL:
        raise InvalidOptionError(f"zstd level {level} is outside "
                                 f"{MIN_ZSTD_LEVEL}..{MAX_ZSTD_LEVEL}")
    return level


def codec_for_descriptors(descriptors: Sequence[str] | None) -> Codec:
    """The codec that decodes an item stored with these transform descriptors."""
    return _codec_for_descriptors(tuple(descriptors or ()))


@functools.lru_cache(maxsize=64)  # one lookup per item of a plan of millions
def _codec_for_descriptors(descriptors: tuple[str, ...]) -> Codec:
    name = codec_name_for_descriptors(descriptors)
    if name is None:
        raise UnsupportedLayoutError(
            f"unknown transform {list(descriptors)}; dcpctl reads items with no transform, "
            f"with {ZSTD_DESCRIPTOR!r} or with {FLOATSPLIT_NAME!r} versions "
            f"{', '.join(FLOATSPLIT_MAJOR_VERSIONS)}")
    # The item's own descriptors: a version 1 item is not taken for what dcpctl writes now.
    return dataclasses.replace(_CODEC_MAKERS[name](), descriptors=descriptors)

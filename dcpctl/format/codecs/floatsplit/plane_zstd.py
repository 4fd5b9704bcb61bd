"""Byte planes coded as zstd frames of Huffman-coded literals, with matches only where they pay.

Most float exponent planes hold no repeats worth finding: Huffman-coding their bytes reaches
their order-0 entropy, and looking for matches only costs time, about as much again to code a
plane and a fifth more to decode it. A few (runs of equal values, repeated rows) shrink by a
fifth or more with matches. So each plane is coded both ways on a sample spread over it, and
in full with matches only where they save that much on the sample. zstd skips match finding
with a large target length, but then also stops Huffman-coding literals unless a parameter
switches that back on, which python-zstandard's C backend does not expose; its cffi backend
reaches all of libzstd, so literal-only frames are made there when it loads, and otherwise
every plane is coded with matches by the C backend. Either way each plane becomes one standard
zstd frame that records its content size and no checksum.
"""

from __future__ import annotations

import numpy
import zstandard

from dcpctl.format.codecs.per_thread import PerThread

try:
    from zstandard.backend_cffi import ffi as _ffi
    from zstandard.backend_cffi import lib as _lib
except ImportError:  # cffi is not installed, or this zstandard was built without it
    _ffi = _lib = None

_WINDOW_LOG = 17  # 128 KiB blocks, each with a Huffman table fitted to it
_ZSTD_PS_ENABLE = 1  # ZSTD_ps_enable in zstd.h
_SKIP_MATCHES_TARGET_LENGTH = 1 << 17
# Matches are few and long: a coarse match finder keeps them from cutting literal runs short.
_MATCHING_PARAMETERS = zstandard.ZstdCompressionParameters(
    window_log=_WINDOW_LOG, hash_log=8, chain_log=6, search_log=1, min_match=7, target_length=0,
    strategy=zstandard.STRATEGY_FAST)
# A sample is 8 slices spread over the plane, each 1/256 of it within 1 to 4 KiB.
SAMPLE_SLICES, MIN_SLICE_BYTES, MAX_SLICE_BYTES = 8, 1 << 10, 4 << 10
_MIN_MATCH_SAVING = 0.20  # of the sample, for the whole plane to be coded with matches
# A sample that Huffman coding cannot shrink by 1% is nearly random: it has no runs either.
_RANDOM_SAMPLE_RATIO = 0.99


class _LiteralCompressor:
    """A libzstd context (through cffi) that Huffman-codes literals and looks for no matches."""

    def __init__(self) -> None:
        self._context = _ffi.gc(_lib.ZSTD_createCCtx(), _lib.ZSTD_freeCCtx)
        for parameter, value in ((_lib.ZSTD_c_strategy, zstandard.STRATEGY_FAST),
                                 (_lib.ZSTD_c_windowLog, _WINDOW_LOG), (_lib.ZSTD_c_hashLog, 6),
                                 (_lib.ZSTD_c_minMatch, 7),
                                 (_lib.ZSTD_c_targetLength, _SKIP_MATCHES_TARGET_LENGTH),
                                 (_lib.ZSTD_c_literalCompressionMode, _ZSTD_PS_ENABLE),
                                 (_lib.ZSTD_c_contentSizeFlag, 1), (_lib.ZSTD_c_checksumFlag, 0)):
            _check(_lib.ZSTD_CCtx_setParameter(self._context, parameter, value))

    def compress(self, data) -> numpy.ndarray:
        """data's zstd frame, in memory of its own (numpy's: made without holding the GIL,
        where copying the frame into bytes would hold it)."""
        size = len(data)
        bound = _lib.ZSTD_compressBound(size)
        output = numpy.empty(bound, dtype=numpy.uint8)
        written = _check(_lib.ZSTD_compress2(self._context, _ffi.from_buffer(output), bound,
                                             _ffi.from_buffer(data), size))
        return output[:written]


def _check(result: int) -> int:
    if _lib.ZSTD_isError(result):
        raise zstandard.ZstdError(_ffi.string(_lib.ZSTD_getErrorName(result)).decode())
    return result


def literal_coding_available() -> bool:
    """Whether planes can be coded without match finding (libzstd reachable through cffi)."""
    return _lib is not None and hasattr(_lib, "ZSTD_c_literalCompressionMode")


class PlaneCompressor:
    """Codes byte planes, each the way a sample of it shows codes it smaller. One per thread."""

    def __init__(self, literal_coding: bool) -> None:
        self._matching = zstandard.ZstdCompressor(compression_params=_MATCHING_PARAMETERS)
        self._literal = _LiteralCompressor() if literal_coding else None
        self._sample = numpy.empty(SAMPLE_SLICES * MAX_SLICE_BYTES, dtype=numpy.uint8)

    def compress(self, plane: numpy.ndarray,
                 min_saving: float) -> bytes | numpy.ndarray | None:
        """One zstd frame of the plane (bytes-like), or None where coding it would not save
        `min_saving` of its size (judged on the sample for large planes, where it saves under
        half that)."""
        size = len(plane)
        slice_bytes = min(max(size // 256, MIN_SLICE_BYTES), MAX_SLICE_BYTES)
        sample = (plane if size <= 2 * SAMPLE_SLICES * slice_bytes else
                  self._spread_sample(plane, slice_bytes))
        frame, coder = self._code_sample(sample)
        if len(sample) < size:
            if len(frame) > len(sample) * (1 - min_saving / 2):
                return None
            frame = coder.compress(plane)
        return frame if len(frame) <= size * (1 - min_saving) else None

    def _code_sample(self, sample: numpy.ndarray) -> tuple[bytes, object]:
        """The sample's frame and the coder that made it: literals only unless matches save."""
        if self._literal is None:
            return self._matching.compress(sample), self._matching
        literal = self._literal.compress(sample)
        if len(literal) >= len(sample) * _RANDOM_SAMPLE_RATIO:
            return literal, self._literal
        matched = self._matching.compress(sample)
        if len(matched) < len(literal) * (1 - _MIN_MATCH_SAVING):
            return matched, self._matching
        return literal, self._literal

    def _spread_sample(self, plane: numpy.ndarray, slice_bytes: int) -> numpy.ndarray:
        stride = (len(plane) - slice_bytes) // (SAMPLE_SLICES - 1)
        slices = self._sample[:SAMPLE_SLICES * slice_bytes].reshape(SAMPLE_SLICES, slice_bytes)
        # the slices of the plane as rows of one strided view, copied in one call
        spread = numpy.lib.stride_tricks.as_strided(plane, (SAMPLE_SLICES, slice_bytes),
                                                    (stride * plane.strides[0],
                                                     plane.strides[0]), writeable=False)
        numpy.copyto(slices, spread)
        return slices.reshape(-1)


_plane_compressors: PerThread[PlaneCompressor] = PerThread(
    lambda: PlaneCompressor(literal_coding_available()))


def plane_compressor() -> PlaneCompressor:
    """This thread's plane compressor, reused: making its contexts costs more than coding a
    small plane."""
    return _plane_compressors.get()

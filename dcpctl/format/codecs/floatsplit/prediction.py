"""Float elements coded against a prediction of their magnitude from their row and column: the
PREDICTED block of stream version 2.

Trained weights have rows and columns with scales of their own (an input feature's scale, an
output unit's gain, Adam's second moments following their parameter), so an element's exponent
is better told by its row and column than by the tensor as a whole. The top 16 bits of each
element (all of a bfloat16 or float16, the sign, exponent and top 7 mantissa bits of a float32)
are cut into:

- q, the magnitude's top 8 bits: the exponent of a bfloat16 or float32, the exponent and the
  first 3 mantissa bits of a float16 (a logarithm of the magnitude in eighth octaves);
- the sign and the 7 magnitude bits below q, which look random.

q is predicted as column[c] + row[r] (integers kept in the stream) and its residual coded in one
byte, so one Huffman table sees the residuals of every row and column alike, where order-0
coding of the exponent sees a mixture of every row's and column's scale. A residual past what a
byte holds (zeros and subnormals, mostly) is escaped: its byte is 0 and its top 16 bits follow
in a sub-stream of their own. A float32's 16 low bits stay in two byte planes as in version 1.

Every step is a whole-array numpy operation: decoding a block costs its planes' join of version
1 and a few passes more; see docs/floatsplit.md for the byte layout.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy

from dcpctl.errors import DataError
from dcpctl.format.codecs.floatsplit.planes import (BFLOAT16, FLOAT16, FLOAT32, FloatLayout,
                                                    join_planes, scratch_plane)

_U16 = numpy.dtype("<u2")
_SIGN_IN_LOW_BYTE = numpy.uint8(0x80)
_ESCAPE = 0
_RESIDUAL_BIAS = 128  # a residual r is stored as r + 128, in 1..255
MIN_ROWS = 16
"""Fewer rows than this tell too little about the columns for a prediction to pay."""
# Rows averaged for the column predictions, columns for the row offsets: enough to tell a mean
# to well within the rounding, at a small part of the cost of the whole block.
_SAMPLED_ROWS, _SAMPLED_COLUMNS = 512, 64
# How far a column's or row's mean q must lie from the others' for a prediction of its own
# (measured on the real weights: columns of trained matrices often differ by chance alone).
COLUMN_DEAD_ZONE, ROW_DEAD_ZONE = 0.75, 0.6
# Whether a prediction pays is judged on this many runs of this many elements spread over a
# block: the entropy of a few thousand bytes tells it, at a small part of the block's cost.
_SAMPLE_RUNS, _SAMPLE_RUN_BYTES = 8, 512
_TOP_SLOT, _Q_SLOT, _SIGN_SLOT, _PAIR_SLOT = 20, 21, 22, 23  # apart from planes.py's slots


PREDICTED_LAYOUTS = {layout.code: layout for layout in (BFLOAT16, FLOAT16, FLOAT32)}
"""The float formats a PREDICTED block holds, by layout code."""
_LOW_BITS = 7  # magnitude bits of the top 16 below q


@dataclass
class PredictedParts:
    """A block cut for coding into its sub-streams. The low part and planes may be the split's
    scratch memory: code them before the next split on this thread."""

    columns: numpy.ndarray  # u8 per column: its predicted q
    rows: numpy.ndarray  # i8 per row: added to every column's prediction
    residuals: numpy.ndarray  # u8 per element: q's residual + 128, or 0 for escaped elements
    low: numpy.ndarray  # u8 per element: the sign in bit 7, the 7 magnitude bits below q
    escaped: numpy.ndarray  # u16 per escaped element: its top 16 bits
    low_planes: list  # float32: the two low bytes' planes, most significant first
    predicted: numpy.ndarray  # u8 per element: q itself, what the residuals stand for

    def streams(self) -> list[numpy.ndarray]:
        """The sub-streams' bytes, in stream order."""
        return [part.view(numpy.uint8) for part in (
            self.columns, self.rows, self.residuals, self.low, self.escaped, *self.low_planes)]


def stream_count(layout: FloatLayout) -> int:
    """Sub-streams in a PREDICTED block of this layout."""
    return 5 + layout.itemsize - 2


def split_predicted(layout: FloatLayout, data, split_layout: FloatLayout, planes: list,
                    row_length: int) -> PredictedParts:
    """The parts of a block of whole rows of `row_length` elements each, of `layout`, from the
    planes split_planes split it into with split_layout (layout itself, or layout_for_block's
    choice of one as wide without the exchange): a block the prediction does not pay for is
    split anyway, and q and the low part are a few byte operations away from the planes.
    Residuals are worked out modulo 256; only a block whose range says some may not fit a byte
    is checked element by element."""
    high, second = planes[0], planes[1]
    rows = len(high) // row_length
    if split_layout.moves_sign:
        # high holds the exponent rotated right by one bit, second the sign and the rest
        q = numpy.add(high, high)  # a shift left by one, which numpy does slower
        q |= high >> numpy.uint8(7)
        low = second
    else:  # the top two bytes as they are: q straddles them, the sign heads the first
        q = numpy.add(high, high)
        q |= second >> numpy.uint8(_LOW_BITS)
        low = numpy.bitwise_and(second, numpy.uint8((1 << _LOW_BITS) - 1))
        low |= high & _SIGN_IN_LOW_BYTE
    q = q.reshape(rows, row_length)
    columns = _column_predictions(q)
    offsets = _row_offsets(q, columns)
    coded = q + (_RESIDUAL_BIAS - columns).astype(numpy.uint8)[None, :]
    if offsets.any():
        coded -= offsets.astype(numpy.uint8)[:, None]
    escaped_tops = numpy.empty(0, dtype=_U16)
    if not _all_fit(q, columns, offsets):
        residuals = q.astype(numpy.int16) - columns[None, :] - offsets[:, None]
        escaped = (residuals < 1 - _RESIDUAL_BIAS) | (residuals > 255 - _RESIDUAL_BIAS)
        coded[escaped] = _ESCAPE
        words = numpy.frombuffer(data, dtype=layout.word_type).reshape(rows, row_length)
        escaped_tops = (words[escaped] >> (8 * layout.itemsize - 16)).astype(_U16)
    return PredictedParts(columns.astype(numpy.uint8), offsets.astype(numpy.int8),
                          coded.reshape(-1), low, escaped_tops, list(planes[2:]), q.reshape(-1))


def estimated_saving(parts: PredictedParts) -> float:
    """About how many bytes the residuals code smaller than q itself, from the order-0 entropy
    (what Huffman coding reaches) of both on the same sample."""
    residuals, predicted = _sampled(parts.residuals), _sampled(parts.predicted)
    scale = len(parts.residuals) / len(residuals) / 8
    return (_order0_bits(predicted) - _order0_bits(residuals)) * scale


def _sampled(plane: numpy.ndarray) -> numpy.ndarray:
    """_SAMPLE_RUNS runs of bytes spread over a plane (all of it if short)."""
    if len(plane) <= _SAMPLE_RUNS * _SAMPLE_RUN_BYTES:
        return plane
    runs = plane[:len(plane) - len(plane) % _SAMPLE_RUNS].reshape(_SAMPLE_RUNS, -1)
    return runs[:, :_SAMPLE_RUN_BYTES].reshape(-1)


def _order0_bits(plane: numpy.ndarray) -> float:
    """The order-0 entropy of a plane's bytes, in bits."""
    counts = numpy.bincount(plane, minlength=256)
    counts = counts[counts > 0]
    return float(len(plane) * numpy.log2(len(plane)) - (counts * numpy.log2(counts)).sum())


def _all_fit(q: numpy.ndarray, columns: numpy.ndarray, offsets: numpy.ndarray) -> bool:
    """Whether every residual q - column - row surely lies in the bytes' range, judged from the
    block's least and greatest q against the least and greatest prediction."""
    lowest = int(q.min()) - int(columns.max()) - int(offsets.max())
    highest = int(q.max()) - int(columns.min()) - int(offsets.min())
    return lowest >= 1 - _RESIDUAL_BIAS and highest <= 255 - _RESIDUAL_BIAS


def _column_predictions(q: numpy.ndarray) -> numpy.ndarray:
    """Each column's predicted q: its mean over a sample of rows, snapped to the columns' common
    value where it lies within COLUMN_DEAD_ZONE of it. Sums are products with a vector of ones,
    exact in float32 (integers far below 2**24), which numpy does far faster than sums along
    an axis."""
    sample = q[::max(1, len(q) // _SAMPLED_ROWS)].astype(numpy.float32)
    means = numpy.ones(len(sample), dtype=numpy.float32) @ sample / len(sample)
    return _snapped(means, COLUMN_DEAD_ZONE).astype(numpy.int32)


def _row_offsets(q: numpy.ndarray, columns: numpy.ndarray) -> numpy.ndarray:
    """Each row's offset from the column predictions: its mean residual over its first
    columns, snapped to the rows' common offset where it lies within ROW_DEAD_ZONE of it."""
    values = q[:, :_SAMPLED_COLUMNS].astype(numpy.float32)
    width = values.shape[1]
    means = (values @ numpy.ones(width, dtype=numpy.float32)
             - float(columns[:width].sum())) / width
    return numpy.clip(_snapped(means, ROW_DEAD_ZONE), -128, 127).astype(numpy.int16)


def _snapped(means: numpy.ndarray, dead_zone: float) -> numpy.ndarray:
    """Means rounded, each relative to their common mean: those within dead_zone of it get
    its rounded value. Lines (rows, columns) that only look apart by chance then share one
    prediction, where rounding each alone would split them between two neighbouring values
    and mix two shifted copies of one distribution, which codes larger than either."""
    center = float(means.mean(dtype=numpy.float64))
    differences = means - center
    moved = numpy.where(numpy.abs(differences) >= dead_zone, numpy.rint(differences), 0)
    return moved + numpy.rint(center)


def join_predicted(layout: FloatLayout, row_length: int, streams: list, out) -> None:
    """Write into `out` the little-endian elements whose PREDICTED block these sub-streams
    (decoded, in stream order) are: the inverse of split_predicted."""
    words = numpy.frombuffer(out, dtype=layout.word_type)
    count, rows = len(words), len(words) // row_length
    columns = _bytes_of(streams[0])
    offsets = numpy.frombuffer(streams[1], dtype=numpy.int8)
    residuals = _bytes_of(streams[2]).reshape(rows, row_length)
    low = _bytes_of(streams[3]).reshape(rows, row_length)
    escaped = numpy.frombuffer(streams[4], dtype=_U16)
    top = words.reshape(rows, row_length) if layout.itemsize == 2 else \
        _scratch_array(_TOP_SLOT, count, _U16).reshape(rows, row_length)
    # q = residual - 128 + column + row, in bytes (q is 8 bits); then, with the sign s at bit 7
    # of the low byte: top = (q + 255 s) << 7 + low = s << 15 | q << 7 | low bits, modulo 2**16.
    # Byte arithmetic first and few passes over the 16-bit words: each costs a memory sweep.
    q = _scratch_array(_Q_SLOT, count, numpy.dtype(numpy.uint8)).reshape(rows, row_length)
    numpy.add(residuals, (columns - numpy.uint8(_RESIDUAL_BIAS))[None, :], out=q)
    if offsets.any():
        numpy.add(q, offsets.view(numpy.uint8)[:, None], out=q)
    signs = _scratch_array(_SIGN_SLOT, count, numpy.dtype(numpy.uint8)).reshape(rows, row_length)
    numpy.right_shift(low, numpy.uint8(7), out=signs)
    numpy.multiply(signs, numpy.uint16(255), out=top)
    numpy.add(top, q, out=top)
    numpy.multiply(top, numpy.uint16(1 << _LOW_BITS), out=top)
    numpy.add(top, low, out=top)
    if len(escaped):
        positions = numpy.flatnonzero(residuals == _ESCAPE)
        if len(positions) != len(escaped):
            raise DataError(f"a predicted block escapes {len(positions)} elements and holds "
                            f"{len(escaped)} of them")
        top.reshape(-1)[positions] = escaped
    if layout.itemsize == 4:
        low_words = _scratch_array(_PAIR_SLOT, count, _U16)
        join_planes(FLOAT16, [_bytes_of(streams[5]), _bytes_of(streams[6])], low_words)
        numpy.copyto(words, top.reshape(-1))
        numpy.multiply(words, numpy.uint32(1 << 16), out=words)
        numpy.bitwise_or(words, low_words, out=words)


def _bytes_of(stream) -> numpy.ndarray:
    return stream if isinstance(stream, numpy.ndarray) else numpy.frombuffer(stream,
                                                                             dtype=numpy.uint8)


def _scratch_array(slot: int, count: int, dtype: numpy.dtype) -> numpy.ndarray:
    return scratch_plane(slot, count * dtype.itemsize).view(dtype)

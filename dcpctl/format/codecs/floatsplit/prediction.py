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

import functools
from dataclasses import dataclass

import numpy

from dcpctl.errors import DataError
from dcpctl.format.codecs.floatsplit.planes import (BFLOAT16, FLOAT16, FLOAT32, FloatLayout,
                                                    join_planes, scratch_plane)

_U8, _U16 = numpy.dtype(numpy.uint8), numpy.dtype("<u2")
_SIGN_IN_LOW_BYTE = numpy.uint8(0x80)
_ESCAPE = 0
_RESIDUAL_BIAS = 128  # a residual r is stored as r + 128, in 1..255
_LEAST_RESIDUAL, _GREATEST_RESIDUAL = 1 - _RESIDUAL_BIAS, 255 - _RESIDUAL_BIAS  # else escaped
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
_COUNTS = numpy.arange(_SAMPLE_RUNS * _SAMPLE_RUN_BYTES + 1, dtype=numpy.float64)
_ENTROPY_TERMS = _COUNTS * numpy.log2(numpy.maximum(_COUNTS, 1))  # c log2 c for each count c
_TOP_SLOT, _Q_SLOT, _SIGN_SLOT, _PAIR_SLOT = 20, 21, 22, 23  # apart from planes.py's slots
_LOW_PART_SLOT, _SCRATCH_PART_SLOT, _Q_PART_SLOT = 24, 25, 26
_LOW_PLANE_SLOTS = (27, 28)
# Elements split at a time: their words and parts fit the processor's cache (measured: passes
# over 4 MiB blocks whole take a third longer)
_SLICE_ELEMENTS = 1 << 18


PREDICTED_LAYOUTS = {layout.code: layout for layout in (BFLOAT16, FLOAT16, FLOAT32)}
"""The float formats a PREDICTED block holds, by layout code."""
_LOW_BITS = 7  # magnitude bits of the top 16 below q


@dataclass
class Prediction:
    """A block's predictions, what a sample says they save, and the q of its elements (in this
    thread's scratch memory, as split_predicted's parts)."""

    columns: numpy.ndarray  # int32 per column: its predicted q
    offsets: numpy.ndarray  # int16 per row, in -128..127: added to every column's prediction
    saving: float  # about how many bytes the residuals code smaller than q itself
    q: numpy.ndarray  # u8 per element, in rows

    def streams(self) -> list[numpy.ndarray]:
        """The block's first two sub-streams: a byte per column, a signed byte per row."""
        return [self.columns.astype(numpy.uint8), self.offsets.astype(numpy.int8).view(numpy.uint8)]


@dataclass
class PredictedParts:
    """A block cut for coding into the sub-streams that follow its predictions', in this
    thread's scratch memory: code them before the next split on this thread."""

    residuals: numpy.ndarray  # u8 per element: q's residual + 128, or 0 for escaped elements
    low: numpy.ndarray  # u8 per element: the sign in bit 7, the 7 magnitude bits below q
    escaped: numpy.ndarray  # u16 per escaped element: its top 16 bits
    low_planes: list  # float32: the two low bytes' planes, most significant first

    def streams(self) -> list[numpy.ndarray]:
        """The sub-streams' bytes, in stream order."""
        return [part.view(numpy.uint8) for part in (
            self.residuals, self.low, self.escaped, *self.low_planes)]


def stream_count(layout: FloatLayout) -> int:
    """Sub-streams in a PREDICTED block of this layout."""
    return 5 + layout.itemsize - 2


def predict(layout: FloatLayout, data, row_length: int) -> Prediction:
    """The predictions for a block of whole rows of `row_length` elements each, of `layout`,
    and the saving they bring, judged from samples of its q."""
    words = numpy.frombuffer(data, dtype=layout.word_type)
    q = _q_of(layout, words, _scratch_array(_Q_PART_SLOT, len(words), _U8))
    q = q.reshape(-1, row_length)
    columns = _column_predictions(q[::max(1, len(q) // _SAMPLED_ROWS)])
    offsets = _row_offsets(q[:, :_SAMPLED_COLUMNS], columns)
    return Prediction(columns, offsets, _estimated_saving(q, columns, offsets), q)


def split_predicted(layout: FloatLayout, data, row_length: int,
                    prediction: Prediction) -> PredictedParts:
    """The parts of a block of whole rows of `row_length` elements each, of `layout`, coded
    against its prediction (the residuals in place of its q). Rows are split a slice at a time,
    small enough that the passes over it stay in the processor's cache; residuals are worked
    out modulo 256, and only a slice whose range says some may not fit a byte is checked
    element by element."""
    words = numpy.frombuffer(data, dtype=layout.word_type)
    count, rows = len(words), len(words) // row_length
    words = words.reshape(rows, row_length)
    low = _scratch_array(_LOW_PART_SLOT, count, _U8).reshape(rows, row_length)
    low_planes = [_scratch_array(slot, count, _U8).reshape(rows, row_length)
                  for slot in _LOW_PLANE_SLOTS[:layout.itemsize - 2]]
    slice_rows = max(1, _SLICE_ELEMENTS // row_length)
    magnitude = _scratch_array(_SCRATCH_PART_SLOT, slice_rows * row_length, _U8)
    escaped_tops = []
    for start in range(0, rows, slice_rows):
        rows_here = slice(start, start + slice_rows)
        escaped_tops += _split_rows(layout, words[rows_here], prediction.q[rows_here],
                                    prediction.columns, prediction.offsets[rows_here],
                                    low[rows_here], [plane[rows_here] for plane in low_planes],
                                    magnitude)
    escaped = numpy.concatenate(escaped_tops) if escaped_tops else numpy.empty(0, dtype=_U16)
    return PredictedParts(prediction.q.reshape(-1), low.reshape(-1), escaped,
                          [plane.reshape(-1) for plane in low_planes])


def _split_rows(layout: FloatLayout, words: numpy.ndarray, q: numpy.ndarray,
                columns: numpy.ndarray, offsets: numpy.ndarray, low: numpy.ndarray,
                low_planes: list, magnitude: numpy.ndarray) -> list[numpy.ndarray]:
    """Split these rows of words into their residuals (in place of their q), low part and low
    planes (given arrays of their shape); returns the top 16 bits of the elements escaped, if
    any. magnitude is scratch memory of at least as many bytes."""
    top_shift = 8 * layout.itemsize - 16  # where the top 16 bits start
    # Every residual surely fits a byte where the least and greatest q against the least and
    # greatest prediction say so; else each is checked.
    lowest = int(numpy.minimum.reduce(q, axis=None))
    highest = int(numpy.maximum.reduce(q, axis=None))
    fits = (lowest - int(columns.max()) - int(offsets.max()) >= _LEAST_RESIDUAL
            and highest - int(columns.min()) - int(offsets.min()) <= _GREATEST_RESIDUAL)
    escaped = None if fits else _escaped(
        q.astype(numpy.int16) - columns[None, :] - offsets[:, None])
    residuals = q
    numpy.add(q, (_RESIDUAL_BIAS - columns).astype(numpy.uint8)[None, :], out=residuals)
    if offsets.any():
        numpy.subtract(residuals, offsets.astype(numpy.uint8)[:, None], out=residuals)
    # the low part: the sign (the top byte's bit 7), and the second byte's 7 bits below q
    numpy.right_shift(words, top_shift + 8, out=low, casting="unsafe")
    numpy.bitwise_and(low, _SIGN_IN_LOW_BYTE, out=low)
    magnitude = magnitude[:words.size].reshape(words.shape)
    _low_byte_of(words, top_shift, magnitude)
    numpy.bitwise_and(magnitude, numpy.uint8((1 << _LOW_BITS) - 1), out=magnitude)
    numpy.bitwise_or(low, magnitude, out=low)
    for plane, shift in zip(low_planes, (8, 0)):  # a float32's two low bytes, as split_planes
        _low_byte_of(words, shift, plane)
    if escaped is None:
        return []
    residuals[escaped] = _ESCAPE
    return [(words[escaped] >> top_shift).astype(_U16)]


def _escaped(residuals: numpy.ndarray) -> numpy.ndarray:
    """Where residuals of q from its prediction do not fit a byte: those elements escape."""
    return (residuals < _LEAST_RESIDUAL) | (residuals > _GREATEST_RESIDUAL)


def _q_of(layout: FloatLayout, words: numpy.ndarray, out: numpy.ndarray) -> numpy.ndarray:
    """out = q of each of these words: bits 14..7 of their top 16."""
    return numpy.right_shift(words, 8 * layout.itemsize - 16 + _LOW_BITS, out=out,
                             casting="unsafe")


def _low_byte_of(words: numpy.ndarray, shift: int, out: numpy.ndarray) -> None:
    """out = the byte of each word from bit `shift` up."""
    if shift:
        numpy.right_shift(words, shift, out=out, casting="unsafe")
    else:
        numpy.copyto(out, words, casting="unsafe")


def _estimated_saving(q: numpy.ndarray, columns: numpy.ndarray,
                      offsets: numpy.ndarray) -> float:
    """About how many bytes the residuals code smaller than q itself, from the order-0 entropy
    (what Huffman coding reaches) of both on the same sample of the block's elements: the
    residuals as split_predicted stores them, escapes and all."""
    rows, row_length = q.shape
    sample = _Sample.of(rows * row_length, row_length)
    sampled = q.reshape(-1)[sample.positions]
    coded = sampled.astype(numpy.int32)
    coded -= columns[sample.columns]
    coded -= offsets[sample.rows]
    escaped = _escaped(coded)
    coded += _RESIDUAL_BIAS
    coded[escaped] = _ESCAPE
    scale = rows * row_length / len(sample.positions) / 8
    return (_order0_bits(sampled) - _order0_bits(coded)) * scale


@dataclass(frozen=True)
class _Sample:
    """The elements of a block that a saving is judged on: _SAMPLE_RUNS runs of
    _SAMPLE_RUN_BYTES elements spread over it (all of them if it is short), by position, and
    their columns and rows."""

    positions: numpy.ndarray
    columns: numpy.ndarray
    rows: numpy.ndarray

    @staticmethod
    @functools.lru_cache(maxsize=16)  # a tensor's blocks are mostly of one size
    def of(count: int, row_length: int) -> _Sample:
        if count <= _SAMPLE_RUNS * _SAMPLE_RUN_BYTES:
            positions = numpy.arange(count)
        else:
            positions = (numpy.arange(_SAMPLE_RUNS)[:, None] * (count // _SAMPLE_RUNS)
                         + numpy.arange(_SAMPLE_RUN_BYTES)[None, :]).reshape(-1)
        return _Sample(positions, positions % row_length, positions // row_length)


def _order0_bits(values: numpy.ndarray) -> float:
    """The order-0 entropy of these values (bytes), in bits."""
    counts = numpy.bincount(values, minlength=256)
    return float(len(values) * numpy.log2(len(values)) - _ENTROPY_TERMS[counts].sum())


def _column_predictions(sampled_rows: numpy.ndarray) -> numpy.ndarray:
    """Each column's predicted q: its mean over these rows' q, snapped to the columns' common
    value where it lies within COLUMN_DEAD_ZONE of it."""
    means = _sums(sampled_rows, axis=0) / len(sampled_rows)
    return _snapped(means, COLUMN_DEAD_ZONE).astype(numpy.int32)


def _row_offsets(first_columns: numpy.ndarray, columns: numpy.ndarray) -> numpy.ndarray:
    """Each row's offset from the column predictions: its mean residual over its first
    columns (their q given), snapped to the rows' common offset where it lies within
    ROW_DEAD_ZONE of it."""
    width = first_columns.shape[1]
    means = (_sums(first_columns, axis=1) - float(columns[:width].sum())) / width
    return numpy.clip(_snapped(means, ROW_DEAD_ZONE), -128, 127).astype(numpy.int16)


def _sums(values: numpy.ndarray, axis: int) -> numpy.ndarray:
    """Sums of bytes along an axis, exact, as float32. By numpy's reductions, which let other
    threads run meanwhile: einsum holds the GIL, and products with a vector of ones go to BLAS,
    whose threads wait spinning after each call and take the cores from a save's threads."""
    return numpy.add.reduce(values, axis=axis, dtype=numpy.uint32).astype(numpy.float32)


def _snapped(means: numpy.ndarray, dead_zone: float) -> numpy.ndarray:
    """Means rounded, each relative to their common mean: those within dead_zone of it get
    its rounded value. Lines (rows, columns) that only look apart by chance then share one
    prediction, where rounding each alone would split them between two neighbouring values
    and mix two shifted copies of one distribution, which codes larger than either."""
    center = float(numpy.add.reduce(means, dtype=numpy.float64)) / len(means)
    differences = means - center
    moved = numpy.rint(differences)
    moved[numpy.abs(differences) < dead_zone] = 0
    moved += round(center)  # to even, as numpy.rint
    return moved


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

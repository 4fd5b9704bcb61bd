"""Split little-endian floats into byte planes with the exponent in a plane of its own, and back.

A plane is one byte of every element, most significant byte first. For bfloat16, float32 and
float64, bit 7 of the first two planes is exchanged, so that the first plane holds eight
exponent bits and the sign moves into the second plane with the mantissa. Whole arrays are
processed with numpy, never element by element in Python, in per-thread scratch memory that is
reused from block to block: fresh multi-megabyte allocations would cost a page fault every 4 KiB.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy

from dcpctl.errors import DataError
from dcpctl.format.codecs.per_thread import PerThread

_BIT_7 = numpy.uint8(0x80)
_SHIFTED_SLOT, _EXCHANGED_SLOT, _PAIR_SLOTS = 8, 9, 10  # scratch slots 0..7 hold planes
_WORD_TYPES = {size: numpy.dtype(f"<u{size}") for size in (1, 2, 4, 8)}
# For words of each width: the word twice as wide, and the factor that shifts a word up by it.
_WIDENED = {size: (_WORD_TYPES[2 * size], _WORD_TYPES[2 * size].type(1 << (8 * size)))
            for size in (1, 2, 4)}
_SIGN_PROBE_ELEMENTS = 4096
# This thread's scratch buffers, by slot.
_scratch: PerThread[dict[int, numpy.ndarray]] = PerThread(dict)


@dataclass(frozen=True)
class FloatLayout:
    """How the elements of one float format are split: code in the stream, bytes per element,
    and whether the sign bit trades places with the top bit of the second plane."""

    code: int
    name: str
    itemsize: int
    moves_sign: bool

    @property
    def word_type(self) -> numpy.dtype:
        """The unsigned little-endian integer as wide as one element."""
        return _WORD_TYPES[self.itemsize]


BFLOAT16 = FloatLayout(1, "bfloat16", 2, True)
FLOAT16 = FloatLayout(2, "float16", 2, False)
FLOAT32 = FloatLayout(3, "float32", 4, True)
FLOAT64 = FloatLayout(4, "float64", 8, True)

LAYOUTS_BY_CODE = {layout.code: layout for layout in (BFLOAT16, FLOAT16, FLOAT32, FLOAT64)}
# A layout only says how bytes are split: float16's splits any 2-byte words without exchange.
_LAYOUTS_WITHOUT_EXCHANGE = {BFLOAT16.code: FLOAT16}
# Complex numbers are pairs of floats of the same format.
_LAYOUTS_BY_DTYPE_NAME = {
    "bfloat16": BFLOAT16, "float16": FLOAT16, "complex32": FLOAT16,
    "float32": FLOAT32, "complex64": FLOAT32, "float64": FLOAT64, "complex128": FLOAT64,
}


def layout_for_dtype(dtype_name: str) -> FloatLayout | None:
    """The layout that splits tensors of this torch dtype, or None for non-float dtypes."""
    return _LAYOUTS_BY_DTYPE_NAME.get(dtype_name)


def layout_for_block(layout: FloatLayout, data) -> FloatLayout:
    """The layout to split a block of `layout` elements with. Where they all have the same sign
    (an optimizer's second moments, say), the exchange would move a constant bit into the
    second plane, which then codes only that bit smaller: a layout as wide without the
    exchange, where the format has one, stores about as many bytes and spares the exchange
    and the Huffman coding of that plane, on both sides."""
    plain = _LAYOUTS_WITHOUT_EXCHANGE.get(layout.code)
    if plain is None:
        return layout
    words = numpy.frombuffer(data, dtype=layout.word_type)
    sign = words.dtype.type(1 << (8 * layout.itemsize - 1))
    # Most blocks show both signs in their first elements: only the others are read whole.
    for part in (words[:_SIGN_PROBE_ELEMENTS], words):
        if (numpy.maximum.reduce(part, axis=None) >= sign
                and numpy.minimum.reduce(part, axis=None) < sign):
            return layout
    return plain


def scratch_plane(index: int, size_bytes: int) -> numpy.ndarray:
    """This thread's reusable uint8 array for plane `index`, valid until the next split or
    scratch_plane call with the same index on this thread."""
    return _scratch_bytes(index, size_bytes)


def split_planes(layout: FloatLayout, data) -> list[numpy.ndarray]:
    """The planes of `data` (a whole number of elements), most significant first, in scratch
    memory: use them before the next split on this thread."""
    words = numpy.frombuffer(data, dtype=layout.word_type)
    count = len(words)
    shifted = _scratch_bytes(_SHIFTED_SLOT, count * layout.itemsize).view(layout.word_type)
    planes = []
    for index in range(layout.itemsize):
        bits = 8 * (layout.itemsize - 1 - index)
        source = numpy.right_shift(words, bits, out=shifted) if bits else words
        plane = _scratch_bytes(index, count)
        numpy.copyto(plane, source, casting="unsafe")  # keeps the low byte
        planes.append(plane)
    if layout.moves_sign:
        exchanged = _exchange_mask(planes[0], planes[1])
        planes[0] ^= exchanged
        planes[1] ^= exchanged
    return planes


def join_planes(layout: FloatLayout, planes: list, out) -> None:
    """Write into `out` (a writable buffer of one byte per element per plane) the little-endian
    elements whose planes these are: the inverse of split_planes. Planes given as writable
    arrays may be changed."""
    if len(planes) != layout.itemsize:
        raise DataError(f"{layout.name} block has {len(planes)} planes, not {layout.itemsize}")
    parts = [numpy.frombuffer(plane, dtype=numpy.uint8) if not isinstance(plane, numpy.ndarray)
             else plane for plane in planes]
    if layout.moves_sign:
        # Exchanging bit 7 on the one-byte planes is cheaper than on the joined words.
        exchanged = _exchange_mask(parts[0], parts[1])
        parts[0] = _xor_in_place_if_writable(parts[0], exchanged)
        parts[1] = numpy.bitwise_xor(exchanged, parts[1], out=exchanged)
    words = numpy.frombuffer(out, dtype=layout.word_type)
    # Neighbours are paired into words twice as wide until one word holds them all: numpy's
    # casts and same-width multiplies are fast, its left shifts and byte-strided copies slow.
    while len(parts) > 1:
        wide_type, shift_up = _WIDENED[parts[0].itemsize]
        slot = _PAIR_SLOTS + 4 * (parts[0].itemsize // 2)  # apart from the narrower parts' slots
        parts = [_pair(parts[index], parts[index + 1], shift_up, words if len(parts) == 2 else
                       _scratch_words(slot + index // 2, len(words), wide_type))
                 for index in range(0, len(parts), 2)]


def _pair(high: numpy.ndarray, low: numpy.ndarray, shift_up, out: numpy.ndarray) -> numpy.ndarray:
    """out = high shifted up by the width of low (`shift_up` = 2 ** that many bits), or low."""
    numpy.copyto(out, high)
    numpy.multiply(out, shift_up, out=out)
    numpy.bitwise_or(out, low, out=out)
    return out


def _xor_in_place_if_writable(plane: numpy.ndarray, mask: numpy.ndarray) -> numpy.ndarray:
    if plane.flags.writeable:
        plane ^= mask
        return plane
    return plane ^ mask


def _exchange_mask(first: numpy.ndarray, second: numpy.ndarray) -> numpy.ndarray:
    """Bit 7 where the two planes differ in it: xor-ing both with it exchanges their bit 7."""
    exchanged = numpy.bitwise_xor(first, second, out=_scratch_bytes(_EXCHANGED_SLOT, len(first)))
    exchanged &= _BIT_7
    return exchanged


def _scratch_words(slot: int, count: int, word_type: numpy.dtype) -> numpy.ndarray:
    return _scratch_bytes(slot, count * word_type.itemsize).view(word_type)


def _scratch_bytes(slot: int, size_bytes: int) -> numpy.ndarray:
    buffers = _scratch.get()
    buffer = buffers.get(slot)
    if buffer is None or len(buffer) < size_bytes:
        buffer = buffers[slot] = numpy.empty(size_bytes, dtype=numpy.uint8)
    return buffer[:size_bytes]

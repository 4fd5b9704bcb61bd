"""What every stream codec is: an encoder and a decoder of one item given piece by piece, the
loops that drive them, and the one file-like adapter over decoded pieces.

Decoding has one path, `iter_decoded`, and it takes the most bytes an item may decode to: a
few stored bytes can decode to terabytes, so every caller that knows the bound passes it.
"""

from __future__ import annotations

import io
import math
from dataclasses import dataclass
from typing import Iterable, Iterator, Protocol

from dcpctl.errors import DataError


class Encoder(Protocol):
    """Encodes one item given piece by piece."""

    def encode(self, piece: bytes) -> bytes: ...

    def finish(self) -> bytes: ...


class Decoder(Protocol):
    """Decodes one item given piece by piece, each stored piece into decoded pieces of bounded
    size; `finish` raises if the item was cut short."""

    def decode(self, piece: bytes) -> Iterator[bytes]: ...

    def finish(self) -> None: ...


MAX_EXPANSION = 1 << 15
"""No codec dcpctl reads decodes to more bytes than this per stored byte: zstd's densest block,
run-length, is 4 bytes for 128 KiB (floatsplit's sub-streams are zstd frames or raw)."""
_EXPANSION_SLACK_BYTES = 1 << 20


def max_decoded_bytes(stored_bytes: int) -> int:
    """The most bytes an item of stored_bytes under any codec can honestly decode to."""
    return stored_bytes * MAX_EXPANSION + _EXPANSION_SLACK_BYTES


@dataclass(slots=True)
class PayloadHint:
    """Where a tensor item's raw bytes are: what the encoder splits. The tensor's dtype (torch's
    name) and the byte count of its elements; decoding never needs it."""

    dtype_name: str
    payload_bytes: int
    row_length: int = 0
    """Elements in each row (the last dim) of a tensor of two or more dims laid out in C order;
    0 where the elements have no rows (one dim) or their layout is unknown."""

    @classmethod
    def of_contiguous(cls, dtype_name: str, itemsize: int, sizes) -> "PayloadHint":
        """The payload of a tensor of these sizes whose elements lie in C order, as every chunk
        a checkpoint stores does."""
        return cls(dtype_name, itemsize * math.prod(sizes), row_length_of(sizes))


def row_length_of(sizes) -> int:
    """The row length of a tensor of these sizes stored in C order (0 for under two dims)."""
    return sizes[-1] if len(sizes) >= 2 else 0


class IdentityCoder:
    """The codec of items stored as they are: bytes in, the same bytes out."""

    def encode(self, piece: bytes) -> bytes:
        return piece

    def decode(self, piece: bytes) -> Iterator[bytes]:
        yield piece

    def finish(self) -> bytes:
        return b""


def iter_encoded(encoder: Encoder, pieces: Iterable[bytes]) -> Iterator[bytes]:
    """The encoded bytes of an item's pieces, its frame ended; empty outputs are left out."""
    for piece in pieces:
        encoded = encoder.encode(piece)
        if encoded:
            yield encoded
    ending = encoder.finish()
    if ending:
        yield ending


def iter_decoded(decoder: Decoder, pieces: Iterable[bytes],
                 max_bytes: int | None = None) -> Iterator[bytes]:
    """The decoded bytes of an item's stored pieces; raises DataError if they end too soon or
    pass max_bytes."""
    decoded = 0
    for piece in pieces:
        for out in decoder.decode(piece):
            decoded += len(out)
            if max_bytes is not None and decoded > max_bytes:
                raise past_the_item_error(max_bytes)
            yield out
    decoder.finish()


def past_the_item_error(max_bytes: int) -> DataError:
    """The error of an item that decodes (or declares it would) past max_bytes."""
    return DataError(f"decodes to more than {max_bytes} bytes, more than the item can hold")


class PieceStream(io.RawIOBase):
    """A readable file object over an iterator of byte pieces (decoded ones, say)."""

    def __init__(self, pieces: Iterable[bytes]) -> None:
        self._pieces = iter(pieces)
        self._piece = memoryview(b"")

    def readable(self) -> bool:
        return True

    def readinto(self, target) -> int:
        while not self._piece:
            piece = next(self._pieces, None)
            if piece is None:
                return 0
            self._piece = memoryview(piece).cast("B")
        count = min(len(target), len(self._piece))
        target[:count] = self._piece[:count]
        self._piece = self._piece[count:]
        return count

    def readall(self) -> bytes:
        return b"".join([bytes(self._piece), *self._pieces])

    def iter_pieces(self) -> Iterator[bytes]:
        """What is left to read, piece by piece as the pieces come: no copy."""
        if self._piece:
            piece, self._piece = self._piece, memoryview(b"")
            yield piece
        yield from self._pieces

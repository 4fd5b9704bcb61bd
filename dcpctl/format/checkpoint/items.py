"""Read one stored item: its raw byte range, decoded through its transforms, piece by piece,
and checked as it goes.

Every decode of an item goes through `iter_decoded_item`, which stops a tensor item under a
codec once it decodes past what its chunk can hold (a few stored bytes can decode to
terabytes) and names the file, item and byte range in whatever error it meets; every command
reads items through `decode_stored_pieces` or `iter_checked_stored_pieces`, which also check
what the bytes form (item_check.py).
"""

from __future__ import annotations

from typing import Iterable, Iterator

from dcpctl.errors import DataError, DcpctlError, missing_file_error, truncated_error
from dcpctl.format.checkpoint.item_check import ItemCheck
from dcpctl.format.checkpoint.locations import ItemLocation
from dcpctl.format.codecs.base import iter_decoded
from dcpctl.storage.paths import StoragePath, open_ranged

DEFAULT_PIECE_BYTES = 4 << 20
MAX_ITEM_IN_MEMORY_BYTES = 256 << 20


class StoredSpan:
    """The stored bytes of neighbouring items of one file, read with one read: small items
    cost a system call and a Python round trip each otherwise."""

    def __init__(self, path: StoragePath, start: int, end: int, first_fqn: str) -> None:
        self.path = path
        self.start = start
        try:
            with open_ranged(path) as reader:
                self._data = memoryview(reader.read(start, end - start))
        except FileNotFoundError:
            raise missing_file_error(path, first_fqn) from None

    def stored_bytes(self, location: ItemLocation) -> memoryview:
        """The item's stored bytes, which must lie in the span."""
        offset = location.start - self.start
        if offset < 0 or location.path != self.path:
            raise ValueError(f"item {location.fqn!r} is not in this span")
        stored = self._data[offset:offset + location.length]
        if len(stored) < location.length:
            raise truncated_error(location.path, location.fqn, location.start, location.end,
                                  location.start + len(stored))
        return stored


def iter_stored_pieces(location: ItemLocation, piece_bytes: int = DEFAULT_PIECE_BYTES,
                       span: StoredSpan | None = None) -> Iterator[bytes]:
    """The item's stored (still encoded) bytes, in pieces of at most piece_bytes; from the span
    when it holds them, in one piece."""
    if span is not None:
        yield span.stored_bytes(location)
        return
    try:
        with open_ranged(location.path) as reader:
            position = location.start
            for piece in reader.iter_pieces(location.start, location.end, piece_bytes):
                position += len(piece)
                yield piece
            if position < location.end:
                raise truncated_error(location.path, location.fqn, location.start,
                                      location.end, position)
    except FileNotFoundError:
        raise missing_file_error(location.path, location.fqn) from None


def iter_decoded_item(location: ItemLocation, stored_pieces: Iterable[bytes]) -> Iterator[bytes]:
    """The item's decoded bytes from its stored bytes, however they were read, stopped once
    they pass what the item can hold; a DcpctlError they raise names the item. The one path
    by which an item is decoded: decode_stored_pieces checks what it gives, verify reports it."""
    try:
        yield from iter_decoded(location.codec.new_decoder(location.max_decoded_bytes),
                                stored_pieces, location.max_decoded_bytes)
    except DcpctlError as error:
        raise error.located(**location.place) from None


def decode_stored_pieces(location: ItemLocation, stored_pieces: Iterable[bytes]
                         ) -> Iterator[bytes]:
    """The item's decoded bytes (iter_decoded_item), checked as they go by (item_check.py):
    once the last is out, raises DataError naming the item if they are not what it must hold
    (a record that fails its CRC-32, another dtype or shape than its chunk's)."""
    check = ItemCheck(location)
    for piece in iter_decoded_item(location, stored_pieces):
        check.feed(piece)
        yield piece
    check.raise_problems(lambda: iter_decoded_item(location, iter_stored_pieces(location)))


def iter_checked_stored_pieces(location: ItemLocation, stored_pieces: Iterable[bytes]
                               ) -> Iterator[bytes]:
    """The item's stored bytes, passed on as they are (an item copied unchanged), while they
    are decoded and checked alongside as decode_stored_pieces checks them."""
    waiting: list = []

    def remembered() -> Iterator[bytes]:
        for piece in stored_pieces:
            waiting.append(piece)
            yield piece

    for _ in decode_stored_pieces(location, remembered()):
        yield from _drained(waiting)
    yield from _drained(waiting)


def _drained(waiting: list) -> Iterator[bytes]:
    while waiting:
        yield waiting.pop(0)


def iter_item_pieces(location: ItemLocation, piece_bytes: int = DEFAULT_PIECE_BYTES,
                     span: StoredSpan | None = None) -> Iterator[bytes]:
    """The item's decoded bytes, in pieces (see decode_stored_pieces)."""
    return decode_stored_pieces(location, iter_stored_pieces(location, piece_bytes, span))


def read_item(location: ItemLocation) -> bytes:
    """The whole decoded item, for small items such as pickled objects: one that decodes past
    MAX_ITEM_IN_MEMORY_BYTES is refused (a few KiB of zstd can decode to gigabytes)."""
    pieces, held = [], 0
    for piece in iter_item_pieces(location):
        held += len(piece)
        if held > MAX_ITEM_IN_MEMORY_BYTES:
            raise DataError(f"decodes to more than {MAX_ITEM_IN_MEMORY_BYTES} bytes, more than "
                            "dcpctl holds in memory for one item", **location.place)
        pieces.append(piece)
    return b"".join(pieces)

"""Write the `torch.save` archive of one dense tensor, streaming its payload, without torch.

The archive has torch's own records, in torch's order: `data.pkl` (which names
`torch._utils._rebuild_tensor_v2`, the storage type of the dtype and the shape), the small
format records, `data/0` (the payload, 64-byte aligned as torch aligns it), `version` and
`.data/serialization_id`. Records are stored (not compressed) with data descriptors after each
record, as torch writes them, so the payload streams through in pieces and its CRC-32 is
computed on the way; a zip64 end record is always written, and zip64 sizes where needed.
`torch.load(..., weights_only=True)` reads the result.
"""

from __future__ import annotations

import functools
import struct
import zlib
from typing import Iterable, Iterator

from dcpctl.errors import UnsupportedLayoutError
from dcpctl.format.dtypes import LEGACY_STORAGE_TYPES, DType

ARCHIVE_PREFIX = "archive/"
_ALIGNMENT = 64
_ZIP64_LIMIT = 0xFFFFFFFF
_FLAGS = 0x0808  # sizes in a data descriptor; UTF-8 names


def _global(module: str, name: str) -> bytes:
    return b"c" + module.encode() + b"\n" + name.encode() + b"\n"


def _unicode(text: str) -> bytes:
    data = text.encode()
    return b"X" + struct.pack("<I", len(data)) + data


def _integer(value: int) -> bytes:
    if 0 <= value < 256:
        return b"K" + bytes([value])
    if 0 <= value < 65536:
        return b"M" + struct.pack("<H", value)
    if -2**31 <= value < 2**31:
        return b"J" + struct.pack("<i", value)
    data = value.to_bytes((value.bit_length() + 8) // 8, "little", signed=True)
    return b"\x8a" + bytes([len(data)]) + data


def _int_tuple(values: tuple[int, ...]) -> bytes:
    return b"(" + b"".join(_integer(v) for v in values) + b"t"


def tensor_pickle(dtype: DType, shape: tuple[int, ...]) -> bytes:
    """The `data.pkl` torch writes for a contiguous tensor of this dtype and shape."""
    storage_type = LEGACY_STORAGE_TYPES.get(dtype.name)
    if storage_type is None:
        raise UnsupportedLayoutError(f"cannot write torch.save archives of dtype {dtype!r}")
    numel = 1
    stride = []
    for size in reversed(shape):
        stride.append(numel)
        numel *= size
    persistent_id = (b"(" + _unicode("storage") + _global("torch", storage_type) + _unicode("0")
                     + _unicode("cpu") + _integer(numel) + b"tQ")
    return (b"\x80\x02" + _global("torch._utils", "_rebuild_tensor_v2") + b"(" + persistent_id
            + _integer(0) + _int_tuple(shape) + _int_tuple(tuple(reversed(stride))) + b"\x89"
            + _global("collections", "OrderedDict") + b")Rt" + b"R.")


class ZipStreamWriter:
    """Lays out stored zip records one after another, as torch.save does (64-byte aligned data,
    data descriptors), tracking offsets for the directory."""

    def __init__(self) -> None:
        self.position = 0
        self._entries: list[tuple[bytes, int, int, int]] = []  # name, crc, size, offset

    def copy(self) -> "ZipStreamWriter":
        """An independent writer in the same state."""
        twin = ZipStreamWriter()
        twin.position = self.position
        twin._entries = list(self._entries)
        return twin

    def local_header(self, name: str) -> bytes:
        """The header that starts record `name`; its data follows, 64-byte aligned."""
        encoded = name.encode()
        start = self.position + 30 + len(encoded) + 4
        padding = (-start) % _ALIGNMENT
        extra = struct.pack("<HH", 0x4246, padding) + b"Z" * padding  # "FB" padding field
        header = struct.pack("<IHHHHHIIIHH", 0x04034B50, 0, _FLAGS, 0, 0, 0, 0, 0, 0,
                             len(encoded), len(extra)) + encoded + extra
        self._entries.append((encoded, 0, 0, self.position))
        self.position += len(header)
        return header

    def data_descriptor(self, crc: int, size: int) -> bytes:
        """What ends the record begun last: its CRC-32 and size."""
        name, _, _, offset = self._entries[-1]
        self._entries[-1] = (name, crc, size, offset)
        if size >= _ZIP64_LIMIT:
            descriptor = struct.pack("<IIQQ", 0x08074B50, crc, size, size)
        else:
            descriptor = struct.pack("<IIII", 0x08074B50, crc, size, size)
        self.position += len(descriptor)
        return descriptor

    def record(self, name: str, data: bytes) -> bytes:
        """A whole record holding data."""
        header = self.local_header(name)
        self.position += len(data)
        return header + data + self.data_descriptor(zlib.crc32(data), len(data))

    def directory(self) -> bytes:
        """The central directory and end records that close the archive."""
        start = self.position
        parts = []
        for name, crc, size, offset in self._entries:
            zip64 = b""
            if size >= _ZIP64_LIMIT or offset >= _ZIP64_LIMIT:
                zip64 = struct.pack("<HHQQQ", 0x0001, 24, size, size, offset)
            parts.append(struct.pack(
                "<IHHHHHHIIIHHHHHII", 0x02014B50, 0x1E03 if zip64 else 0, 45 if zip64 else 0,
                _FLAGS, 0, 0, 0, crc, min(size, _ZIP64_LIMIT), min(size, _ZIP64_LIMIT),
                len(name), len(zip64), 0, 0, 0, 0, min(offset, _ZIP64_LIMIT)) + name + zip64)
        directory = b"".join(parts)
        count = len(self._entries)
        end64 = self.position + len(directory)
        tail = (struct.pack("<IQHHIIQQQQ", 0x06064B50, 44, 0x1E03, 45, 0, 0, count, count,
                            len(directory), start)
                + struct.pack("<IIQI", 0x07064B50, 0, end64, 1)
                + struct.pack("<IHHHHIIH", 0x06054B50, 0, 0, count, count, len(directory),
                              min(start, _ZIP64_LIMIT), 0))
        return directory + tail


@functools.lru_cache(maxsize=256)
def _archive_prefix(dtype: DType, shape: tuple[int, ...]) -> tuple[bytes, ZipStreamWriter]:
    """Everything before the payload, which depends on dtype and shape alone (checkpoints
    repeat shapes layer after layer), and the zip state after it."""
    zip_writer = ZipStreamWriter()
    prefix = b"".join([
        zip_writer.record(ARCHIVE_PREFIX + "data.pkl", tensor_pickle(dtype, shape)),
        zip_writer.record(ARCHIVE_PREFIX + ".format_version", b"1"),
        zip_writer.record(ARCHIVE_PREFIX + ".storage_alignment", b"64"),
        zip_writer.record(ARCHIVE_PREFIX + "byteorder", b"little"),
        zip_writer.local_header(ARCHIVE_PREFIX + "data/0"),
    ])
    return prefix, zip_writer


def iter_torch_save_archive(dtype: DType, shape: tuple[int, ...],
                            payload_pieces: Iterable[bytes]) -> Iterator[bytes]:
    """The bytes of `torch.save(tensor)` for a contiguous tensor whose row-major bytes come in
    payload_pieces, in pieces."""
    prefix, cached_writer = _archive_prefix(dtype, shape)
    zip_writer = cached_writer.copy()
    yield prefix
    crc, size = 0, 0
    for piece in payload_pieces:
        crc = zlib.crc32(piece, crc)
        size += len(piece)
        zip_writer.position += len(piece)
        yield piece
    expected = dtype.itemsize
    for dimension in shape:
        expected *= dimension
    if size != expected:
        raise ValueError(f"payload of {size} bytes for a {dtype!r} tensor of shape {shape}")
    yield zip_writer.data_descriptor(crc, size)
    yield zip_writer.record(ARCHIVE_PREFIX + "version", b"3\n")
    # torch draws a random id here; a value derived from the payload keeps output reproducible.
    yield zip_writer.record(ARCHIVE_PREFIX + ".data/serialization_id", f"{crc:040d}".encode())
    yield zip_writer.directory()

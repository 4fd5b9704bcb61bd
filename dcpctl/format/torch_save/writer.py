"""Write the `torch.save` archive of one dense tensor, streaming its payload, without torch.

The archive has torch's own records, in torch's order: `data.pkl` (which names torch's
rebuild function, the storage, the dtype and the shape, as torch.save writes them), the small
format records, `data/0` (the payload, 64-byte aligned as torch aligns it), `version` and
`.data/serialization_id`. Records are stored (not compressed) with data descriptors after each
record, as torch writes them, so the payload streams through in pieces and its CRC-32 is
computed on the way; a zip64 end record is always written, and zip64 sizes where needed.
`torch.load(..., weights_only=True)` reads the result.
"""

from __future__ import annotations

import functools
import math
import struct
import zlib
from typing import Callable, Iterable, Iterator, NamedTuple

import numpy

from dcpctl.errors import DataError
from dcpctl.format.dtypes import LEGACY_STORAGE_TYPES, DType
from dcpctl.format.torch_save.zip_records import (CENTRAL_SIGNATURE, DATA_DESCRIPTOR_SIGNATURE,
                                                  END_SIGNATURE, LOCAL_SIGNATURE,
                                                  ZIP64_END_SIGNATURE, ZIP64_EXTRA_ID,
                                                  ZIP64_LOCATOR_SIGNATURE, local_record_in,
                                                  whole_record_in)

ARCHIVE_PREFIX = "archive/"
_ALIGNMENT = 64
_ZIP64_LIMIT = 0xFFFFFFFF
_FLAGS = 0x0808  # sizes in a data descriptor; UTF-8 names
_EMPTY_RECORD_FLAGS = 0x0800  # UTF-8 names; no data descriptor: its zero sizes are the header's
_MADE_BY_UNIX = 0x031E  # "version made by" of the zip64 end record: Unix, zip 3.0, as miniz writes
_ENTRY_CRC_OFFSET = 16
_DESCRIPTOR_CRC_OFFSET = 4
_PACK_CRC = struct.Struct("<I").pack
_SERIALIZATION_ID_BYTES = 40


def data_descriptor(crc: int, size: int) -> bytes:
    """The data descriptor that ends a record of size bytes whose CRC-32 is crc: none for an
    empty record, which torch.save's writer (miniz) ends with its header."""
    if size == 0:
        return b""
    if size >= _ZIP64_LIMIT:
        return struct.pack("<4sIQQ", DATA_DESCRIPTOR_SIGNATURE, crc, size, size)
    return struct.pack("<4sIII", DATA_DESCRIPTOR_SIGNATURE, crc, size, size)


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
    """The `data.pkl` torch writes for a contiguous tensor of this dtype and shape: the legacy
    typed storage and `_rebuild_tensor_v2` where the dtype has one, else (float8, uint16..64,
    complex32, float4) an untyped storage of bytes and `_rebuild_tensor_v3` naming the dtype."""
    numel = 1
    stride = []
    for size in reversed(shape):
        stride.append(numel)
        numel *= size
    storage_type = LEGACY_STORAGE_TYPES.get(dtype.name)
    if storage_type is not None:
        rebuild, storage, storage_size, dtype_argument = (
            "_rebuild_tensor_v2", _global("torch", storage_type), numel, b"")
    else:
        rebuild, storage, storage_size, dtype_argument = (
            "_rebuild_tensor_v3", _global("torch.storage", "UntypedStorage"),
            numel * dtype.itemsize, _global("torch", dtype.name))
    persistent_id = (b"(" + _unicode("storage") + storage + _unicode("0") + _unicode("cpu")
                     + _integer(storage_size) + b"tQ")
    return (b"\x80\x02" + _global("torch._utils", rebuild) + b"(" + persistent_id
            + _integer(0) + _int_tuple(shape) + _int_tuple(tuple(reversed(stride))) + b"\x89"
            + _global("collections", "OrderedDict") + b")R" + dtype_argument + b"tR.")


class ZipStreamWriter:
    """Lays out stored zip records one after another, as torch.save does (64-byte aligned data,
    data descriptors but after empty records), tracking offsets for the directory."""

    def __init__(self) -> None:
        self.position = 0
        self._entries: list[tuple[bytes, int, int, int]] = []  # name, crc, size, offset

    def local_header(self, name: str, size: int) -> bytes:
        """The header that starts record `name` of size bytes; its data follows, 64-byte
        aligned."""
        encoded = name.encode()
        start = self.position + 30 + len(encoded) + 4
        padding = (-start) % _ALIGNMENT
        extra = struct.pack("<HH", 0x4246, padding) + b"Z" * padding  # "FB" padding field
        header = struct.pack("<4sHHHHHIIIHH", LOCAL_SIGNATURE, 0, _record_flags(size), 0, 0, 0,
                             0, 0, 0, len(encoded), len(extra)) + encoded + extra
        self._entries.append((encoded, 0, 0, self.position))
        self.position += len(header)
        return header

    def data_descriptor(self, crc: int, size: int) -> bytes:
        """What ends the record begun last: its CRC-32 and size."""
        name, _, _, offset = self._entries[-1]
        self._entries[-1] = (name, crc, size, offset)
        descriptor = data_descriptor(crc, size)
        self.position += len(descriptor)
        return descriptor

    def record_count(self) -> int:
        """How many records were begun; record i is the i-th local_header."""
        return len(self._entries)

    def set_crc(self, record: int, crc: int) -> None:
        """Give record (an index, see record_count) the CRC-32 its directory entry carries, for a
        record whose data descriptor was laid out before its data was written."""
        name, _, size, offset = self._entries[record]
        self._entries[record] = (name, crc, size, offset)

    def record(self, name: str, data: bytes) -> bytes:
        """A whole record holding data."""
        header = self.local_header(name, len(data))
        self.position += len(data)
        return header + data + self.data_descriptor(zlib.crc32(data), len(data))

    def directory(self) -> bytes:
        """The central directory and end records that close the archive."""
        entries, end = self.directory_parts()
        return b"".join(entries) + end

    def directory_parts(self) -> tuple[list[bytes], bytes]:
        """The central directory's entries, one per record (each with its CRC-32 at byte
        _ENTRY_CRC_OFFSET), and the end records after them."""
        start = self.position
        entries = []
        for name, crc, size, offset in self._entries:
            zip64 = b""
            if size >= _ZIP64_LIMIT or offset >= _ZIP64_LIMIT:
                zip64 = struct.pack("<HHQQQ", ZIP64_EXTRA_ID, 24, size, size, offset)
            entries.append(struct.pack(
                "<4sHHHHHHIIIHHHHHII", CENTRAL_SIGNATURE, 0x1E03 if zip64 else 0,
                45 if zip64 else 0, _record_flags(size), 0, 0, 0, crc, min(size, _ZIP64_LIMIT),
                min(size, _ZIP64_LIMIT), len(name), len(zip64), 0, 0, 0, 0,
                min(offset, _ZIP64_LIMIT)) + name + zip64)
        directory_bytes = sum(map(len, entries))
        count = len(self._entries)
        end64 = self.position + directory_bytes
        end = (struct.pack("<4sQHHIIQQQQ", ZIP64_END_SIGNATURE, 44, _MADE_BY_UNIX, 45, 0, 0,
                           count, count, directory_bytes, start)
               + struct.pack("<4sIQI", ZIP64_LOCATOR_SIGNATURE, 0, end64, 1)
               + struct.pack("<4sHHHHIIH", END_SIGNATURE, 0, 0, count, count, directory_bytes,
                             min(start, _ZIP64_LIMIT), 0))
        return entries, end


class _ArchiveTemplate:
    """A tensor archive's bytes around its payload, for one dtype and shape (checkpoints repeat
    shapes layer after layer): everything but the fields that depend on the payload's CRC-32."""

    def __init__(self, dtype: DType, shape: tuple[int, ...]) -> None:
        self.nbytes = dtype.itemsize * math.prod(shape)
        zip_writer = ZipStreamWriter()
        self.prefix = b"".join([
            zip_writer.record(ARCHIVE_PREFIX + "data.pkl", tensor_pickle(dtype, shape)),
            zip_writer.record(ARCHIVE_PREFIX + ".format_version", b"1"),
            zip_writer.record(ARCHIVE_PREFIX + ".storage_alignment", b"64"),
            zip_writer.record(ARCHIVE_PREFIX + "byteorder", b"little"),
            zip_writer.local_header(ARCHIVE_PREFIX + "data/0", self.nbytes),
        ])
        zip_writer.position += self.nbytes
        self._payload_descriptor = zip_writer.data_descriptor(0, self.nbytes)
        self._version_record = zip_writer.record(ARCHIVE_PREFIX + "version", b"3\n")
        self._id_header = zip_writer.local_header(ARCHIVE_PREFIX + ".data/serialization_id",
                                                  _SERIALIZATION_ID_BYTES)
        zip_writer.position += _SERIALIZATION_ID_BYTES
        self._id_descriptor = zip_writer.data_descriptor(0, _SERIALIZATION_ID_BYTES)
        entries, self._directory_end = zip_writer.directory_parts()
        self._directory_head = b"".join(entries[:4])
        self._payload_entry, self._version_entry, self._id_entry = entries[4:]
        self.suffix_bytes = len(self.suffix(0))

    def suffix(self, crc: int) -> bytes:
        """Everything after a payload whose CRC-32 is crc."""
        # torch draws a random id; one derived from the payload keeps output reproducible
        serialization_id = f"{crc:0{_SERIALIZATION_ID_BYTES}d}".encode()
        id_crc = _PACK_CRC(zlib.crc32(serialization_id))
        crc_bytes = _PACK_CRC(crc)
        return b"".join((
            _with_crc(self._payload_descriptor, _DESCRIPTOR_CRC_OFFSET, crc_bytes)
            if self._payload_descriptor else b"",
            self._version_record, self._id_header, serialization_id,
            _with_crc(self._id_descriptor, _DESCRIPTOR_CRC_OFFSET, id_crc),
            self._directory_head, _with_crc(self._payload_entry, _ENTRY_CRC_OFFSET, crc_bytes),
            self._version_entry, _with_crc(self._id_entry, _ENTRY_CRC_OFFSET, id_crc),
            self._directory_end))


def _record_flags(size: int) -> int:
    return _EMPTY_RECORD_FLAGS if size == 0 else _FLAGS


def _with_crc(record: bytes, offset: int, crc_bytes: bytes) -> bytes:
    return record[:offset] + crc_bytes + record[offset + 4:]


@functools.lru_cache(maxsize=256)
def _archive_template(dtype: DType, shape: tuple[int, ...]) -> _ArchiveTemplate:
    return _ArchiveTemplate(dtype, shape)


def iter_torch_save_archive(dtype: DType, shape: tuple[int, ...],
                            payload_pieces: Iterable[bytes],
                            payload_crc: Callable[[], int] | None = None) -> Iterator[bytes]:
    """The bytes of `torch.save(tensor)` for a contiguous tensor whose row-major bytes come in
    payload_pieces, in pieces. payload_crc, where given, gives the payload's CRC-32 once its
    last piece is out (whoever made the pieces worked it out); else it is worked out here."""
    template = _archive_template(dtype, shape)
    yield template.prefix
    crc, size = 0, 0
    for piece in payload_pieces:
        if payload_crc is None:
            crc = zlib.crc32(piece, crc)
        size += len(piece)
        yield piece
    if size != template.nbytes:
        raise ValueError(f"payload of {size} bytes for a {dtype!r} tensor of shape {shape}")
    yield template.suffix(crc if payload_crc is None else payload_crc())


def torch_save_archive(dtype: DType, shape: tuple[int, ...],
                       fill_payload: Callable[[memoryview], int | None]) -> memoryview:
    """The bytes of `torch.save(tensor)` for a contiguous tensor, in one buffer whose payload
    fill_payload writes in place (the row-major bytes): no piece of it is copied twice.
    fill_payload returns the payload's CRC-32 where filling it worked that out, else None."""
    template = _archive_template(dtype, shape)
    payload_start = len(template.prefix)
    payload_end = payload_start + template.nbytes
    archive = memoryview(numpy.empty(payload_end + template.suffix_bytes, dtype=numpy.uint8))
    archive[:payload_start] = template.prefix
    payload = archive[payload_start:payload_end]
    crc = fill_payload(payload)
    archive[payload_end:] = template.suffix(zlib.crc32(payload) if crc is None else crc)
    return archive


class ArchiveTail(NamedTuple):
    """What varies in the bytes torch.save writes after a tensor's payload, once its head and
    payload are known: the payload's CRC-32, the `version` record's data and the serialization
    id."""

    payload_crc: int
    version: bytes
    serialization_id: bytes


def rebuilt_tail(head: bytes, payload_bytes: int, fields: ArchiveTail) -> bytes | None:
    """The bytes torch.save writes after the payload of an archive that starts with `head` (its
    records up to the payload's local header, inclusive) and whose payload holds payload_bytes:
    the payload's data descriptor, the `version` and `.data/serialization_id` records, the
    central directory and the end records, laid out as ZipStreamWriter lays them out. None when
    the head is not laid out that way, so that nothing after it can be rebuilt."""
    template = _tail_template(head, payload_bytes, len(fields.version),
                              len(fields.serialization_id))
    if template is None:
        return None
    tail = bytearray(template.tail)
    version_at, id_at = template.version_at, template.id_at
    tail[version_at:version_at + len(fields.version)] = fields.version
    tail[id_at:id_at + len(fields.serialization_id)] = fields.serialization_id
    for places, crc in ((template.payload_crc_at, fields.payload_crc),
                        (template.version_crc_at, zlib.crc32(fields.version)),
                        (template.id_crc_at, zlib.crc32(fields.serialization_id))):
        for at in places:
            tail[at:at + 4] = _PACK_CRC(crc)
    return bytes(tail)


class _TailTemplate(NamedTuple):
    """A tail laid out with zeros where the fields go, and where they go."""

    tail: bytes
    version_at: int
    id_at: int
    payload_crc_at: tuple[int, ...]
    version_crc_at: tuple[int, ...]
    id_crc_at: tuple[int, ...]


@functools.lru_cache(maxsize=256)
def _tail_template(head: bytes, payload_bytes: int, version_bytes: int,
                   id_bytes: int) -> _TailTemplate | None:
    """The tail for this head and payload length, as ZipStreamWriter writes it, with every CRC
    and field zero and their places noted (checkpoints repeat heads chunk after chunk)."""
    writer = ZipStreamWriter()
    try:
        name = _replay_head(writer, head, payload_bytes)
    except DataError:  # no zip records there at all
        return None
    if name is None or not name.endswith("/data/0"):
        return None
    prefix = name[:-len("data/0")]
    writer.position += payload_bytes
    base = writer.position
    parts = [writer.data_descriptor(0, payload_bytes)]
    records_at = []
    for record_name, size in (("version", version_bytes), (".data/serialization_id", id_bytes)):
        records_at.append(writer.position - base)
        header = writer.local_header(prefix + record_name, size)
        writer.position += size
        parts += [header, bytes(size), writer.data_descriptor(0, size)]
    directory_at = writer.position - base
    entries, end = writer.directory_parts()
    parts += [*entries, end]
    tail = b"".join(parts)
    version_header, id_header = records_at
    entry_at = [directory_at + sum(len(entry) for entry in entries[:index])
                for index in range(len(entries))]
    version_at = version_header + len(parts[1])
    id_at = id_header + len(parts[4])
    return _TailTemplate(
        tail, version_at, id_at,
        ((_DESCRIPTOR_CRC_OFFSET,) if parts[0] else ()) + (entry_at[-3] + _ENTRY_CRC_OFFSET,),
        (version_at + version_bytes + _DESCRIPTOR_CRC_OFFSET, entry_at[-2] + _ENTRY_CRC_OFFSET),
        (id_at + id_bytes + _DESCRIPTOR_CRC_OFFSET, entry_at[-1] + _ENTRY_CRC_OFFSET))


def _replay_head(writer: ZipStreamWriter, head: bytes, payload_bytes: int) -> str | None:
    """Lay out head's records again with writer: whole records, then the local header of the
    payload's record (of payload_bytes), whose name it returns; None where that does not give
    head back."""
    replayed, position = [], 0
    while position < len(head):
        found = local_record_in(head, position)
        if found is not None and found[1] == len(head):  # the payload's: its data follows head
            replayed.append(writer.local_header(found[0], payload_bytes))
            return found[0] if b"".join(replayed) == head else None
        record = whole_record_in(head, position)
        if record is None:
            return None
        replayed.append(writer.record(*record))
        position += len(replayed[-1])
    return None


def tail_fields(head: bytes, payload_bytes: int, tail: bytes) -> ArchiveTail | None:
    """What rebuilt_tail needs to give back `tail` exactly, where it can; else None."""
    descriptor = data_descriptor(0, payload_bytes)
    if len(tail) < len(descriptor) or not tail.startswith(descriptor[:4]):
        return None
    payload_crc = struct.unpack_from("<I", tail, _DESCRIPTOR_CRC_OFFSET)[0] if descriptor else 0
    try:
        version = whole_record_in(tail, len(descriptor))
        id_header = tail.index(LOCAL_SIGNATURE, len(descriptor) + len(LOCAL_SIGNATURE))
        id_record = local_record_in(tail, id_header)
        if version is None or id_record is None:
            return None
        # the last record: its data ends where its data descriptor starts
        serialization_id = tail[id_record[1]:tail.index(DATA_DESCRIPTOR_SIGNATURE, id_record[1])]
    except (DataError, ValueError):
        return None
    fields = ArchiveTail(payload_crc, version[1], serialization_id)
    return fields if rebuilt_tail(head, payload_bytes, fields) == tail else None

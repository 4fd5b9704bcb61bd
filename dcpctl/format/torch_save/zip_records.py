"""Zip archives as torch.save writes them, read from their end: each record and where its data lies.

torch.save sets flag bit 3 in every local header and leaves the sizes and CRC-32 there zero
(they follow the data in a data descriptor), so records cannot be walked from the front. The
end of central directory record, in its zip64 form when present (torch always writes one),
locates the central directory; each of its entries gives a record's name, size, CRC-32 and
local header offset, and the local header gives where the data starts. Offsets are relative to
the start of the archive, so an archive stored inside a larger file reads through a
`read_range(start, length)` over its own byte range.

No CRC-32 covers these structures, so each field torch's reader (miniz) acts on is held to what
torch.save writes, and an archive torch would refuse is refused here too: one disk, as many
entries as the directory says and room for them, no encryption, no compression (stored sizes
equal), names that are UTF-8, every local header where its entry says.
"""

from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass
from typing import Callable, Iterable, NamedTuple

from dcpctl.errors import DataError

ReadRange = Callable[[int, int], bytes]
"""read_range(start, length) -> exactly `length` bytes of the archive from `start`."""

STORED = 0
# The signatures that start each kind of zip record (APPNOTE.TXT, section 4.3).
LOCAL_SIGNATURE = b"PK\x03\x04"
DATA_DESCRIPTOR_SIGNATURE = b"PK\x07\x08"
CENTRAL_SIGNATURE = b"PK\x01\x02"
ZIP64_END_SIGNATURE = b"PK\x06\x06"
ZIP64_LOCATOR_SIGNATURE = b"PK\x06\x07"
END_SIGNATURE = b"PK\x05\x06"
ZIP64_EXTRA_ID = 0x0001
_END = struct.Struct("<4s4H2IH")
_ZIP64_LOCATOR = struct.Struct("<4sIQI")
_ZIP64_END = struct.Struct("<4sQ2H2I4Q")
_CENTRAL = struct.Struct("<4s6H3I5H2I")
_LOCAL_HEADER = struct.Struct("<4s5H3I2H")
LOCAL_HEADER_BYTES = _LOCAL_HEADER.size
# After a record whose local header has flag bit 3: signature, CRC-32 and the two sizes, in 32
# or (zip64) 64 bits.
_DATA_DESCRIPTORS = (struct.Struct("<4s3I"), struct.Struct("<4sI2Q"))
_SIZES_FOLLOW_FLAG = 0x0008
_MAX_COMMENT_BYTES = 0xFFFF
_FIRST_TAIL_BYTES = 1024
# General purpose flags torch's reader refuses: encrypted, patched data, strongly encrypted,
# masked headers.
_UNSUPPORTED_FLAGS = 0x0001 | 0x0020 | 0x0040 | 0x2000
_UNSET_32 = 0xFFFFFFFF  # "see the zip64 record"
_DOS_DIRECTORY_ATTRIBUTE = 0x10  # in an entry's external attributes: it is a directory
MAX_ARCHIVE_RECORDS = 1 << 20
"""The most records of an archive dcpctl reads: torch.save writes one for each storage and
four more, and a million storages in one file is past any state dict saved whole; each record
read costs a few hundred bytes of memory."""
_MAX_DIRECTORY_BYTES = 128 << 20


class CentralEntry(NamedTuple):
    """A record as the central directory describes it."""

    name: str
    header_offset: int
    size_bytes: int
    crc32: int


@dataclass(slots=True)
class ZipRecord:
    """One record of an archive: its data lies at [data_offset, data_offset + size_bytes)."""

    name: str
    data_offset: int
    size_bytes: int
    crc32: int
    header_offset: int

    @property
    def data_end(self) -> int:
        """Offset one past the record's last data byte."""
        return self.data_offset + self.size_bytes

    def check_crc(self, data) -> None:
        """Raise DataError unless data, the record's bytes, match its CRC-32 (one of 0 was
        written with CRC-32s turned off, and says nothing)."""
        if self.crc32 and zlib.crc32(data) != self.crc32:
            raise DataError(f"record {self.name!r} does not match its CRC-32")


def read_zip_records(read_range: ReadRange, archive_length: int) -> list[ZipRecord]:
    """Every record of the archive, in central directory order, with its data offset; refused
    where two share bytes."""
    directory = read_central_directory(read_range, archive_length)
    records = [locate_record(read_range, entry, directory.offset) for entry in directory.entries]
    _refuse_shared_bytes(records)
    return records


def _refuse_shared_bytes(records: list[ZipRecord]) -> None:
    """torch.save writes each record (local header, data, data descriptor) past the one before,
    so no two share a byte. Records that do are no archive of its: a few KiB of directory can
    name one large record thousands of times, each checked at the cost of reading it whole."""
    ordered = sorted(records, key=lambda record: record.header_offset)
    for before, after in zip(ordered, ordered[1:]):
        if before.data_end > after.header_offset:
            raise DataError(f"zip records {before.name!r} and {after.name!r} share bytes "
                            f"{after.header_offset}..{min(before.data_end, after.data_end)}: "
                            "not an archive torch.save writes")


class CentralDirectory(NamedTuple):
    """An archive's central directory: where it starts, its entries, and what its reading
    looked at."""

    offset: int
    entries: list[CentralEntry]
    crc_field_offsets: tuple[int, ...]
    """Where in the archive each entry's CRC-32 field lies."""
    structure_start: int
    """The first byte read to find and parse the directory: what it says follows from the
    archive's length and its bytes from here to the end alone."""


def read_central_directory(read_range: ReadRange, archive_length: int) -> CentralDirectory:
    """The central directory, found through the (zip64) end of central directory record."""
    end_offset, end = _find_end_record(read_range, archive_length)
    _, disk, directory_disk, count_here, count, size_bytes, offset, _ = _END.unpack(end)
    directory_end = structure_start = end_offset
    if end_offset >= _ZIP64_LOCATOR.size:
        structure_start = end_offset - _ZIP64_LOCATOR.size
        locator = _read_exactly(read_range, structure_start, _ZIP64_LOCATOR.size,
                                "zip64 end locator")
        if locator.startswith(ZIP64_LOCATOR_SIGNATURE):
            directory_end, disk, directory_disk, count_here, count, size_bytes, offset = \
                _read_zip64_end(read_range, locator, end_offset)
            structure_start = directory_end
    if disk != 0 or directory_disk != 0 or count_here != count:
        raise DataError(f"zip end record says disk {disk}, central directory on disk "
                        f"{directory_disk}, {count_here} of {count} entries on this disk: not "
                        "the one-disk archive torch.save writes")
    if count > MAX_ARCHIVE_RECORDS or size_bytes > _MAX_DIRECTORY_BYTES:
        raise DataError(f"zip central directory of {count} entries in {size_bytes} bytes: past "
                        f"the {MAX_ARCHIVE_RECORDS} entries or {_MAX_DIRECTORY_BYTES >> 20} MiB "
                        "dcpctl reads (torch.save writes an entry of about 60 bytes per "
                        "storage, more with a long archive name)")
    if size_bytes < count * _CENTRAL.size or offset + size_bytes > directory_end:
        raise DataError(f"zip central directory of {count} entries at bytes {offset}.."
                        f"{offset + size_bytes} cannot hold them before byte {directory_end}")
    data = _read_exactly(read_range, offset, size_bytes, "zip central directory")
    entries, crc_positions = _central_entries(data, count, offset, archive_length)
    return CentralDirectory(offset, entries, tuple(offset + position for position in crc_positions),
                            min(offset, structure_start))


def holds_storages(directory: CentralDirectory) -> bool:
    """Whether a torch.save archive holds tensor storages: `<archive>/data/<key>` records."""
    return any(len(parts) == 3 and parts[1] == "data"
               for parts in (entry.name.split("/") for entry in directory.entries))


class _DirectoryTemplate(NamedTuple):
    """A central directory parsed before, its CRC-32 fields zeroed at crc_positions."""

    masked_data: bytes
    crc_positions: tuple[int, ...]
    entries: tuple[CentralEntry, ...]


# The items of a checkpoint are mostly archives of a few layouts (a chunk shape and dtype
# each) whose central directories differ only in their CRC-32s, which no check reads: an archive
# whose directory is a template's but for them has the template's entries with its own CRC-32s.
_directory_templates: dict[tuple[int, int, int, int], _DirectoryTemplate] = {}
_MAX_DIRECTORY_TEMPLATES = 1024
_MAX_TEMPLATE_ENTRIES = 64
_CRC_FIELD = struct.Struct("<I")
_CRC_FIELD_OFFSET = 16  # in a central directory entry (_CENTRAL)


def _central_entries(data: bytes, count: int, directory_offset: int, archive_length: int
                     ) -> tuple[list[CentralEntry], tuple[int, ...]]:
    """The entries of a central directory and where in data each one's CRC-32 field lies
    (_parse_central_entries), from a template where one fits."""
    key = (len(data), count, directory_offset, archive_length)
    template = _directory_templates.get(key)
    if (template is not None
            and with_fields_zeroed(data, template.crc_positions) == template.masked_data):
        return [CentralEntry(entry.name, entry.header_offset, entry.size_bytes,
                             crc_field_at(data, position))
                for entry, position in zip(template.entries, template.crc_positions)
                ], template.crc_positions
    entries, starts = _parse_central_entries(data, count, directory_offset, archive_length)
    crc_positions = tuple(start + _CRC_FIELD_OFFSET for start in starts)
    if count <= _MAX_TEMPLATE_ENTRIES:  # an item's few records, not a whole state dict's
        if len(_directory_templates) >= _MAX_DIRECTORY_TEMPLATES:
            _directory_templates.clear()
        _directory_templates[key] = _DirectoryTemplate(
            with_fields_zeroed(data, crc_positions), crc_positions, tuple(entries))
    return entries, crc_positions


def with_fields_zeroed(data: bytes, positions: Iterable[int]) -> bytes:
    """data with the 4-byte fields (CRC-32s) at positions zeroed."""
    masked = bytearray(data)
    for position in positions:
        masked[position:position + 4] = bytes(4)
    return bytes(masked)


def crc_field_at(data: bytes, position: int) -> int:
    """The CRC-32 field at position of data (a central directory entry's, say)."""
    return _CRC_FIELD.unpack_from(data, position)[0]


def _read_exactly(read_range: ReadRange, start: int, count: int, what: str) -> bytes:
    data = read_range(start, count)
    if len(data) != count:
        raise DataError(f"{what} at bytes {start}..{start + count} lies past the archive's end")
    return data


def _find_end_record(read_range: ReadRange, archive_length: int) -> tuple[int, bytes]:
    """The end of central directory record: last in the archive, after an optional comment."""
    longest_tail = min(archive_length, _END.size + _MAX_COMMENT_BYTES)
    for tail_length in sorted({min(_FIRST_TAIL_BYTES, longest_tail), longest_tail}):
        tail_start = archive_length - tail_length
        tail = read_range(tail_start, tail_length)
        position = tail.rfind(END_SIGNATURE, 0, tail_length - _END.size + 4)
        while position >= 0:
            (comment_length,) = struct.unpack_from("<H", tail, position + _END.size - 2)
            if position + _END.size + comment_length == tail_length:
                return tail_start + position, tail[position:position + _END.size]
            position = tail.rfind(END_SIGNATURE, 0, position)
    raise DataError(f"no zip end of central directory record in the last {longest_tail} bytes "
                    "(not a torch.save archive, or cut short)")


def _read_zip64_end(read_range: ReadRange, locator: bytes, end_offset: int) -> tuple[int, ...]:
    """Where the zip64 end record starts, then its disk, central directory disk, entries on
    this disk, entries, central directory size and offset."""
    _, _, zip64_end_offset, disks = _ZIP64_LOCATOR.unpack(locator)
    if disks != 1:
        raise DataError(f"zip64 end locator says {disks} disks, not the one torch.save writes")
    if zip64_end_offset + _ZIP64_END.size > end_offset - _ZIP64_LOCATOR.size:
        raise DataError(f"zip64 end record offset {zip64_end_offset} lies past its locator")
    (signature, record_size, _, _, disk, directory_disk, count_here, count, size_bytes,
     offset) = _ZIP64_END.unpack(read_range(zip64_end_offset, _ZIP64_END.size))
    if signature != ZIP64_END_SIGNATURE or record_size < _ZIP64_END.size - 12:
        raise DataError(f"no zip64 end of central directory record at byte {zip64_end_offset}")
    if count > _UNSET_32:
        raise DataError(f"zip64 end record claims {count} entries")
    return zip64_end_offset, disk, directory_disk, count_here, count, size_bytes, offset


def _parse_central_entries(data: bytes, count: int, directory_offset: int,
                           archive_length: int) -> tuple[list[CentralEntry], list[int]]:
    """The entries of a central directory, and where in data each starts."""
    entries, starts = [], []
    position = 0
    for _ in range(count):
        starts.append(position)
        where = directory_offset + position
        if position + _CENTRAL.size > len(data):
            raise DataError(f"zip central directory is cut short at byte {where}")
        fields = _CENTRAL.unpack_from(data, position)
        signature, flags, method, disk, attributes, header_offset = (
            fields[0], fields[3], fields[4], fields[13], fields[15], fields[16])
        crc32, size_bytes, uncompressed_bytes, name_length, extra_length, comment_length = \
            fields[7:13]
        if signature != CENTRAL_SIGNATURE:
            raise DataError(f"no zip central directory entry at byte {where}")
        name_start = position + _CENTRAL.size
        extra_start = name_start + name_length
        position = extra_start + extra_length + comment_length
        if position > len(data):
            raise DataError(f"zip central directory entry at byte {where} is cut short")
        try:
            name = data[name_start:extra_start].decode("utf-8")
        except UnicodeDecodeError:
            raise DataError(f"zip central directory entry at byte {where} has a name that is "
                            f"not UTF-8: {data[name_start:extra_start]!r:.80}") from None
        if _UNSET_32 in (uncompressed_bytes, size_bytes, header_offset):
            uncompressed_bytes, size_bytes, header_offset = _apply_zip64_extra(
                data[extra_start:extra_start + extra_length], uncompressed_bytes, size_bytes,
                header_offset, name)
        _check_entry(name, flags, method, disk, attributes, size_bytes, uncompressed_bytes,
                     header_offset, archive_length)
        entries.append(CentralEntry(name, header_offset, size_bytes, crc32))
    if position != len(data):
        raise DataError(f"zip central directory holds {len(data) - position} bytes past its "
                        f"{count} entries")
    return entries, starts


def _check_entry(name: str, flags: int, method: int, disk: int, attributes: int,
                 size_bytes: int, uncompressed_bytes: int, header_offset: int,
                 archive_length: int) -> None:
    """Refuse what torch.save never writes in a central directory entry."""
    if "\x00" in name:  # torch's reader takes names as C strings: it would look up another
        raise DataError(f"zip record name {name!r} holds a NUL, which torch's reader cannot "
                        "take")
    if attributes & _DOS_DIRECTORY_ATTRIBUTE or name.endswith("/"):
        raise DataError(f"zip record {name!r} is marked as a directory")
    if flags & _UNSUPPORTED_FLAGS:
        raise DataError(f"zip record {name!r} has flags {flags:#06x}: encrypted or patched, "
                        "which torch.save never writes")
    if method != STORED or size_bytes != uncompressed_bytes:
        raise DataError(f"zip record {name!r} is compressed (method {method}, {size_bytes} "
                        f"bytes for {uncompressed_bytes}), which torch.save never does")
    if disk != 0:
        raise DataError(f"zip record {name!r} starts on disk {disk}, not the one disk")
    if header_offset + _LOCAL_HEADER.size + size_bytes > archive_length:
        raise DataError(f"zip record {name!r} at byte {header_offset} of {size_bytes} bytes "
                        f"runs past the archive's {archive_length} bytes")


def _apply_zip64_extra(extra: bytes, uncompressed_bytes: int, size_bytes: int,
                       header_offset: int, name: str) -> tuple[int, int, int]:
    """Sizes and offsets too large for 32 bits are 0xFFFFFFFF, the real values in the zip64
    extra field, in the order: uncompressed size, compressed size, local header offset."""
    wanted = [value == 0xFFFFFFFF for value in (uncompressed_bytes, size_bytes, header_offset)]
    values = [uncompressed_bytes, size_bytes, header_offset]
    position = 0
    while position + 4 <= len(extra):
        field_id, field_length = struct.unpack_from("<HH", extra, position)
        body = extra[position + 4:position + 4 + field_length]
        position += 4 + field_length
        if field_id != ZIP64_EXTRA_ID:
            continue
        numbers = iter(struct.unpack_from(f"<{len(body) // 8}Q", body))
        for index, needed in enumerate(wanted):
            if needed:
                values[index] = next(numbers, None)
        if None not in values:
            return values[0], values[1], values[2]
    raise DataError(f"zip record {name!r} lacks the zip64 extra field its sizes call for")


def local_record_in(head: bytes, position: int) -> tuple[str, int] | None:
    """The name and data offset of the local header at `position` of head (the first bytes of
    an archive), or None when head ends before the name and extra field do."""
    if position + _LOCAL_HEADER.size > len(head):
        return None
    signature, _, _, _, _, _, _, _, _, name_length, extra_length = _LOCAL_HEADER.unpack_from(
        head, position)
    if signature != LOCAL_SIGNATURE:
        raise DataError(f"no zip local header at byte {position}")
    name_start = position + _LOCAL_HEADER.size
    data_offset = name_start + name_length + extra_length
    if data_offset > len(head):
        return None
    return head[name_start:name_start + name_length].decode("utf-8", "replace"), data_offset


def whole_record_in(head: bytes, position: int) -> tuple[str, bytes] | None:
    """The name and data of the stored record whose local header is at `position` of head,
    read front to back, when head holds it whole: up to the next local header, its size and
    CRC-32 checked against the data descriptor before that header (or against the local header,
    where that carries them; a CRC-32 of 0 is none, as torch.save writes with its CRC-32s
    turned off). None when head ends too soon or the record does not check out."""
    record = local_record_in(head, position)
    if record is None:
        return None
    name, data_offset = record
    _, _, flags, method, _, _, crc32, size_bytes, _, _, _ = _LOCAL_HEADER.unpack_from(
        head, position)
    if method != STORED:
        return None
    if not flags & _SIZES_FOLLOW_FLAG:
        data = head[data_offset:data_offset + size_bytes]
        return (name, data) if len(data) == size_bytes and _crc_holds(data, crc32) else None
    next_header = head.find(LOCAL_SIGNATURE, data_offset)
    for descriptor in _DATA_DESCRIPTORS if next_header >= 0 else ():
        data = head[data_offset:next_header - descriptor.size]
        if len(data) + descriptor.size != next_header - data_offset:
            continue
        signature, crc32, size_bytes, uncompressed_bytes = descriptor.unpack_from(
            head, next_header - descriptor.size)
        if (signature == DATA_DESCRIPTOR_SIGNATURE and size_bytes == uncompressed_bytes == len(data)
                and _crc_holds(data, crc32)):
            return name, data
    return None


def _crc_holds(data: bytes, crc32: int) -> bool:
    return crc32 == 0 or zlib.crc32(data) == crc32


def locate_record(read_range: ReadRange, entry: CentralEntry, data_limit: int) -> ZipRecord:
    """The record of a central directory entry, its data start read from its local header;
    its data must end by data_limit (where the central directory starts)."""
    header = read_range(entry.header_offset, _LOCAL_HEADER.size)
    if len(header) != _LOCAL_HEADER.size or not header.startswith(LOCAL_SIGNATURE):
        raise DataError(f"no zip local header for record {entry.name!r} at byte "
                        f"{entry.header_offset}")
    _, _, _, _, _, _, _, _, _, name_length, extra_length = _LOCAL_HEADER.unpack(header)
    data_offset = entry.header_offset + _LOCAL_HEADER.size + name_length + extra_length
    record = ZipRecord(entry.name, data_offset, entry.size_bytes, entry.crc32,
                       entry.header_offset)
    if record.data_end > data_limit:
        raise DataError(f"zip record {entry.name!r} at bytes {data_offset}..{record.data_end} "
                        f"runs past byte {data_limit}, where the central directory starts")
    return record

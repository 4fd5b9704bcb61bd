"""Where each record of a stored (uncompressed) zip file keeps its data and its CRC-32s, so that
data filled in after the archive was written can be given the right checksums."""

from __future__ import annotations

import struct
import zipfile
from dataclasses import dataclass
from pathlib import Path

from dcpctl.errors import DataError

_LOCAL_HEADER = struct.Struct("<4s22xHH")
_CENTRAL_HEADER = struct.Struct("<4s24xHHH12x")
_DATA_DESCRIPTOR_SIGNATURE = b"PK\x07\x08"
_HAS_DATA_DESCRIPTOR = 0x08


@dataclass(frozen=True)
class ZipRecord:
    """One record: its data's byte range and the file offsets of the CRC-32 fields naming it."""

    name: str
    data_offset: int
    size: int
    crc_offsets: tuple[int, ...]


def read_zip_records(path: Path) -> list[ZipRecord]:
    """Every record of the zip file at path, in central directory order."""
    try:
        archive = zipfile.ZipFile(path)
    except zipfile.BadZipFile as error:
        raise DataError(f"{path}: not a zip archive ({error})") from None
    with archive, open(path, "rb") as stream:
        central_offset = archive.start_dir
        records = []
        for info in archive.infolist():
            if info.compress_type != zipfile.ZIP_STORED:
                raise DataError(f"{path}: record {info.filename} is compressed")
            stream.seek(central_offset)
            signature, *lengths = _CENTRAL_HEADER.unpack(stream.read(_CENTRAL_HEADER.size))
            if signature != b"PK\x01\x02":
                raise DataError(f"{path}: damaged central directory at byte {central_offset}")
            crc_offsets = [central_offset + 16]
            central_offset += _CENTRAL_HEADER.size + sum(lengths)
            data_offset = _data_offset(path, stream, info)
            crc_offsets.append(_local_crc_offset(stream, info, data_offset))
            records.append(ZipRecord(info.filename, data_offset, info.file_size,
                                     tuple(crc_offsets)))
    return records


def _data_offset(path: Path, stream, info: zipfile.ZipInfo) -> int:
    stream.seek(info.header_offset)
    signature, name_length, extra_length = _LOCAL_HEADER.unpack(stream.read(_LOCAL_HEADER.size))
    if signature != b"PK\x03\x04":
        raise DataError(f"{path}: no local header for {info.filename} at byte "
                        f"{info.header_offset}")
    return info.header_offset + _LOCAL_HEADER.size + name_length + extra_length


def _local_crc_offset(stream, info: zipfile.ZipInfo, data_offset: int) -> int:
    """The local copy of the CRC: in the data descriptor after the data when there is one
    (its signature is optional), else in the local header."""
    if not info.flag_bits & _HAS_DATA_DESCRIPTOR:
        return info.header_offset + 14
    descriptor = data_offset + info.compress_size
    stream.seek(descriptor)
    has_signature = stream.read(4) == _DATA_DESCRIPTOR_SIGNATURE
    return descriptor + 4 if has_signature else descriptor


def write_record_crc(stream, record: ZipRecord, crc: int) -> None:
    """Store crc in every CRC-32 field of the record (stream open for update)."""
    packed = struct.pack("<I", crc)
    for offset in record.crc_offsets:
        stream.seek(offset)
        stream.write(packed)

"""Reading zip records from the end of an archive agrees with Python's zipfile."""

from __future__ import annotations

import io
import random
import zipfile

import pytest
from conftest import FIXTURE_NAMES, fixture_path

from dcpctl.errors import DataError
from dcpctl.format.checkpoint.view import open_checkpoint
from dcpctl.format.torch_save.zip_records import ZipRecord, read_zip_records


def fixture_archives():
    """(label, bytes) of every plain stored item of the fixtures that is a zip archive."""
    for name in FIXTURE_NAMES:
        checkpoint = open_checkpoint(fixture_path(name))
        for key, info in checkpoint.metadata.storage_data.items():
            if info.transform_descriptors:
                continue
            with open(checkpoint.path / info.relative_path, "rb") as stream:
                stream.seek(info.offset)
                data = stream.read(info.length)
            if data.startswith(b"PK\x03\x04"):
                yield f"{name}:{key.fqn}:{key.offset}", data


def reader_of(data: bytes):
    def read_range(start: int, count: int) -> bytes:
        assert 0 <= start and start + count <= len(data), (start, count)
        return data[start:start + count]
    return read_range


def assert_agrees_with_zipfile(data: bytes, records: list[ZipRecord]) -> None:
    """records are every record of the archive, as zipfile lists them."""
    with zipfile.ZipFile(io.BytesIO(data)) as archive:
        assert [record.name for record in records] == [info.filename for info in
                                                       archive.infolist()]
    for record in records:
        assert_record_agrees_with_zipfile(data, record)


def assert_record_agrees_with_zipfile(data: bytes, record: ZipRecord) -> None:
    with zipfile.ZipFile(io.BytesIO(data)) as archive:
        info = archive.getinfo(record.name)
        assert info.compress_type == zipfile.ZIP_STORED
        assert (record.crc32, record.size_bytes, record.header_offset) == (
            info.CRC, info.compress_size, info.header_offset)
        assert data[record.data_offset:record.data_end] == archive.read(info.filename)


def test_every_fixture_archive_matches_zipfile():
    archives = list(fixture_archives())
    assert len(archives) > 100
    for label, data in archives:
        assert_agrees_with_zipfile(data, read_zip_records(reader_of(data), len(data)))


def _zip_bytes(members: dict[str, bytes], comment: bytes = b"", **options) -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", **options) as archive:
        for name, body in members.items():
            archive.writestr(name, body)
        archive.comment = comment
    return buffer.getvalue()


MEMBERS = {"a/data.pkl": b"pickle bytes", "a/data/0": bytes(range(256)) * 40, "a/empty": b""}


def test_zip64_extra_fields_and_end_records(monkeypatch):
    """With the zip64 limit forced down, zipfile writes 0xFFFFFFFF sizes and offsets with the
    real values in zip64 extra fields, and a zip64 end record: the layout of a >4 GiB item."""
    monkeypatch.setattr(zipfile, "ZIP64_LIMIT", 100)
    monkeypatch.setattr(zipfile, "ZIP_FILECOUNT_LIMIT", 2)
    data = _zip_bytes(MEMBERS)
    assert b"PK\x06\x06" in data and b"\xff\xff\xff\xff" in data
    monkeypatch.undo()
    records = read_zip_records(reader_of(data), len(data))
    assert_agrees_with_zipfile(data, records)
    assert [r.size_bytes for r in records] == [len(body) for body in MEMBERS.values()]


def test_end_record_after_a_comment_and_inside_a_larger_file():
    data = _zip_bytes(MEMBERS, comment=b"a long archive comment " * 100)
    assert_agrees_with_zipfile(data, read_zip_records(reader_of(data), len(data)))
    # A comment holding the end record's signature (zipfile itself trips over this one).
    tricky = _zip_bytes(MEMBERS, comment=b"PK\x05\x06 is not the end record here" * 100)
    assert read_zip_records(reader_of(tricky), len(tricky)) == read_zip_records(
        reader_of(data), len(data))
    padded = b"x" * 1000 + data + b"y" * 1000  # an item inside a data file

    def read_item(start: int, count: int) -> bytes:
        return padded[1000 + start:1000 + start + count]

    assert read_zip_records(read_item, len(data)) == read_zip_records(reader_of(data), len(data))


def test_deflated_records_are_refused():
    """torch.save never compresses; a deflated record read as stored would be wrong bytes."""
    data = _zip_bytes(MEMBERS, compression=zipfile.ZIP_DEFLATED)
    with pytest.raises(DataError, match="is compressed"):
        read_zip_records(reader_of(data), len(data))


@pytest.mark.parametrize("damage, message", [
    (lambda d: d[:-30], "no zip end of central directory record"),
    (lambda d: b"", "no zip end of central directory record"),
    (lambda d: d.replace(b"PK\x01\x02", b"PK\x01\x03", 1), "no zip central directory entry"),
    (lambda d: b"QQ" + d[2:], "no zip local header"),
])
def test_damaged_archives_are_refused(damage, message):
    data = damage(_zip_bytes(MEMBERS))
    with pytest.raises(DataError, match=message):
        read_zip_records(reader_of(data), len(data))


def test_record_running_into_the_central_directory_is_refused():
    data = bytearray(_zip_bytes({"a": b"12345"}))
    central = data.index(b"PK\x01\x02")
    data[central + 20:central + 28] = (10_000).to_bytes(4, "little") * 2  # both sizes
    with pytest.raises(DataError, match="runs past"):
        read_zip_records(reader_of(bytes(data)), len(data))


def _same_layout(payload: bytes) -> bytes:
    return _zip_bytes({"a/data.pkl": b"pickle bytes", "a/data/0": payload})


def test_archives_of_one_layout_each_get_their_own_crcs():
    """Items of one shape share a central directory but for the CRC-32s: each archive's records
    carry its own, whichever was read first."""
    first, second = _same_layout(bytes(4096)), _same_layout(bytes(range(256)) * 16)
    assert len(first) == len(second) and first != second
    for data in (first, second, first, second):
        assert_agrees_with_zipfile(data, read_zip_records(reader_of(data), len(data)))
    assert (read_zip_records(reader_of(first), len(first))[1].crc32
            != read_zip_records(reader_of(second), len(second))[1].crc32)


@pytest.mark.parametrize("field, value, message", [
    (10, 8, "is compressed"),  # the compression method
    (8, 0x0001, "encrypted or patched"),  # the flags
    (0, 0x03014B50, "no zip central directory entry"),  # the signature
])
def test_a_directory_that_differs_from_one_read_before_beyond_its_crcs_is_checked_anew(
        field, value, message):
    good = _same_layout(bytes(4096))
    read_zip_records(reader_of(good), len(good))  # its layout is now known
    damaged = bytearray(good)
    entry = damaged.index(b"PK\x01\x02")
    width = 4 if field == 0 else 2
    damaged[entry + field:entry + field + width] = value.to_bytes(width, "little")
    with pytest.raises(DataError, match=message):
        read_zip_records(reader_of(bytes(damaged)), len(damaged))


def test_a_template_reads_any_damaged_directory_as_a_fresh_parse_does():
    """Random byte edits anywhere in a torch.save archive's central directory and end records,
    read once the undamaged archive's layout is known: the records, or the refusal, are those
    of a parse that knows no layout."""
    from dcpctl.format.torch_save import zip_records

    _, good = next(fixture_archives())
    directory = good.index(b"PK\x01\x02")
    generator = random.Random(7)

    def outcome(data: bytes):
        try:
            return read_zip_records(reader_of(data), len(data))
        except DataError as error:
            return str(error)

    for _ in range(300):
        damaged = bytearray(good)
        position = generator.randrange(directory, len(good))
        damaged[position] = generator.choice([value for value in range(256)
                                              if value != good[position]])
        zip_records._directory_templates.clear()
        outcome(good)  # the good archive's layout is now known
        with_template = outcome(bytes(damaged))
        zip_records._directory_templates.clear()
        assert with_template == outcome(bytes(damaged)), position


def test_a_record_name_holding_a_nul_is_refused():
    """One flip in a zstd frame's back-reference wrote `arch7\\x00x/` into every name of an
    item: the names still shared one directory, but torch's reader takes them as C strings,
    finds no `version` record and refuses the checkpoint."""
    _, good = next(fixture_archives())
    prefix = good[30:good.index(b"/", 30) + 1]  # the first local header's directory
    damaged = good.replace(prefix, prefix[:4] + b"\x00" + prefix[5:])
    with pytest.raises(DataError, match="holds a NUL, which torch's reader cannot take"):
        read_zip_records(reader_of(damaged), len(damaged))


def _with_second_entry_at_first_header(data: bytes) -> bytes:
    """The archive with its second central directory entry pointing at the first record's
    local header (both names of one length, so that header names the second as well)."""
    damaged = bytearray(data)
    second = damaged.index(b"PK\x01\x02", damaged.index(b"PK\x01\x02") + 4)
    damaged[second + 42:second + 46] = (0).to_bytes(4, "little")  # local header offset
    return bytes(damaged)


def test_records_that_share_bytes_are_refused():
    """A directory naming one large record thousands of times had every command that checks
    an archive's CRC-32s read it again for each (a meta.pt of 268 MB: about a terabyte)."""
    data = _with_second_entry_at_first_header(_zip_bytes({"a/x": b"1" * 100, "a/y": b"2"}))
    with pytest.raises(DataError, match="zip records 'a/x' and 'a/y' share bytes 0..34: not "
                                        "an archive"):
        read_zip_records(reader_of(data), len(data))


def test_a_central_directory_past_what_dcpctl_reads_is_refused_before_it_is_read(monkeypatch):
    """A 1.5 GB meta.pt whose end record called all of it the central directory was read
    into memory whole; 3 million empty records took 1.4 GB to check."""
    from dcpctl.format.torch_save import zip_records

    data = _zip_bytes(MEMBERS)
    reads = []

    def read_range(start: int, count: int) -> bytes:
        reads.append(count)
        return data[start:start + count]

    monkeypatch.setattr(zip_records, "MAX_ARCHIVE_RECORDS", 2)
    with pytest.raises(DataError, match="zip central directory of 3 entries in [0-9]+ bytes: "
                                        "past the 2 entries or 128 MiB dcpctl reads"):
        read_zip_records(read_range, len(data))
    assert max(reads) <= 1024  # the end records only
    monkeypatch.setattr(zip_records, "MAX_ARCHIVE_RECORDS", 3)
    monkeypatch.setattr(zip_records, "_MAX_DIRECTORY_BYTES", 100)
    with pytest.raises(DataError, match="past the 3 entries or 0 MiB"):
        read_zip_records(reader_of(data), len(data))

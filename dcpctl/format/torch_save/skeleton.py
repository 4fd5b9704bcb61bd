"""torch.save files opened without their tensor data: the structure, and where each tensor's
bytes lie in the file, so that they can be read or written a piece at a time."""

from __future__ import annotations

import re
import warnings
from pathlib import Path
from typing import Any, Iterator

import torch

from dcpctl.errors import DataError, UnsupportedLayoutError, name_and_message
from dcpctl.format.torch_save.archive_check import check_archive
from dcpctl.format.torch_save.storage_references import referenced_storage_keys
from dcpctl.format.torch_save.zip_records import ZipRecord
from dcpctl.storage.local import open_for_reading
from dcpctl.storage.planned_from import note_planned_from


def open_torch_save(path: Path) -> tuple[Any, dict[int, ZipRecord]]:
    """The file's contents with every tensor on the meta device (no tensor bytes are read),
    unpickled with torch's weights_only loader so that no code from the file runs, and the
    storage record (`<prefix>/data/<key>`) of each storage, by the offset torch's loader gave
    the storage (storage_file_offset)."""
    note_planned_from(path, whole=False)
    with open_for_reading(path) as stream:
        def read_range(start: int, length: int) -> bytes:
            stream.seek(start)
            return stream.read(length)

        try:
            checked = check_archive(read_range, path.stat().st_size, expect_tensor=False)
        except DataError as error:
            raise UnsupportedLayoutError(f"not a torch.save zip archive ({error}; the legacy "
                                         "format of torch < 1.6 is not supported)",
                                         path=path) from None
        records = checked.records
        byteorder = next((r for r in records if r.name.endswith("/byteorder")), None)
        if byteorder and read_range(byteorder.data_offset, byteorder.size_bytes) != b"little":
            raise UnsupportedLayoutError("saved on a big-endian machine", path=path)
        if checked.crc_mismatches:  # torch's reader does not check them: damage would pass
            raise DataError(f"record {checked.crc_mismatches[0][0].name!r} does not match its "
                            "CRC-32", path=path)
        pickle_record = next(r for r in records  # check_archive found it
                             if r.name.endswith("/data.pkl") and r.name.count("/") == 1)
        pickle_bytes = read_range(pickle_record.data_offset, pickle_record.size_bytes)
        prefix = pickle_record.name.partition("/")[0]
        version = next((r for r in records if r.name == f"{prefix}/.format_version"), None)
        offsets_worked_out = version is not None and read_range(
            version.data_offset, version.size_bytes) >= b"1"  # as torch's loader decides
    try:
        with warnings.catch_warnings():  # torch's own (TypedStorage is deprecated...)
            warnings.simplefilter("ignore")
            skeleton = torch.load(path, map_location="meta", weights_only=True)
    except Exception as error:  # the weights_only loader refuses in many ways
        if "Quantized" in str(error):  # torch cannot place one on the meta device
            raise UnsupportedLayoutError("holds a quantized tensor, which dcpctl does not "
                                         "convert (save its dequantize() or int_repr() "
                                         "instead)", path=path) from None
        raise UnsupportedLayoutError(
            f"cannot be loaded with weights_only=True ({weights_only_refusal(error)})",
            path=path) from None
    storage_records = _storage_records(path, prefix, records)
    if not offsets_worked_out:  # torch looked each record up by its name
        return skeleton, {record.data_offset: record for record in storage_records.values()}
    return skeleton, _by_worked_out_offset(path, skeleton, pickle_bytes, prefix,
                                           storage_records)


def _storage_records(path: Path, prefix: str, records: tuple[ZipRecord, ...]
                     ) -> dict[str, ZipRecord]:
    """The storage records by name, refused where two share one (which of them torch reads is
    up to its zip reader)."""
    by_name: dict[str, ZipRecord] = {}
    for record in records:
        if record.name.startswith(f"{prefix}/data/"):
            if record.name in by_name:
                raise DataError(f"holds two zip records named {record.name!r}", path=path)
            by_name[record.name] = record
    return by_name


def _by_worked_out_offset(path: Path, skeleton: Any, pickle_bytes: bytes, prefix: str,
                          storage_records: dict[str, ZipRecord]) -> dict[int, ZipRecord]:
    """The record of each storage by the offset torch's loader gave it. torch (2.6 and later,
    for a file with `.format_version` 1) does not look a storage's record up by its name: it
    works the offset out from where its own writer would have put it, each storage right after
    the one before in the order the pickle first names them. The offsets it gives therefore
    rise in that order, which is the order of the storage keys in data.pkl: the n-th lowest is
    that of the n-th key, whose record is `<prefix>/data/<key>` wherever it lies (a file zipped
    again by another tool, or whose records were renamed). Refused where the plain tensors
    reached do not account for every storage (a sparse tensor's, a bare storage)."""
    try:
        keys = referenced_storage_keys(pickle_bytes)
    except Exception as error:  # noqa: BLE001 - torch's own (Python) unpickler took it
        raise UnsupportedLayoutError(f"its data.pkl does not read as torch's loader read it "
                                     f"({name_and_message(error)})", path=path) from None
    offsets = sorted({getattr(tensor.untyped_storage(), "_checkpoint_offset", None)
                      for tensor in find_tensors(skeleton) if tensor.layout == torch.strided}
                     - {None})
    if len(offsets) != len(keys):
        name, what = _first_not_plain(skeleton)
        raise UnsupportedLayoutError(f"{name!r} is {what}: dcpctl converts state dicts of "
                                     "plain (strided) tensors", path=path)
    placed = {offset: storage_records.get(f"{prefix}/data/{key}")
              for offset, key in zip(offsets, keys)}
    return {offset: record for offset, record in placed.items() if record is not None}


def _first_not_plain(value: Any) -> tuple[str, str]:
    """The dotted name of the first tensor or storage inside value that is not a plain
    tensor, and what it is."""
    for name, holder in _named_storage_holders(value):
        if not isinstance(holder, torch.Tensor):
            return name, "a storage, not a tensor"
        if holder.layout != torch.strided:
            return name, f"a {holder.layout} tensor"
    return "", "a storage no plain tensor holds"


_ANSI_SEQUENCE = re.compile(r"\x1b\[[0-9;]*m")


def weights_only_refusal(error: Exception) -> str:
    """Why torch's weights_only loader refused, in a line: its unpickler's own reason where it
    gives one (the first lines of its message are advice on loading unsafely)."""
    text = _ANSI_SEQUENCE.sub("", str(error))
    reason = next((line.strip() for line in text.splitlines()
                   if line.strip().startswith("WeightsUnpickler error:")), None)
    if reason is None:
        return text.strip().splitlines()[0] if text.strip() else type(error).__name__
    return reason.removeprefix("WeightsUnpickler error:").strip().split(". Please use")[0]


def storage_file_offset(path: Path, name: str, placeholder: torch.Tensor,
                        records: dict[int, ZipRecord]) -> int:
    """Where in the file the storage of the tensor called name, a placeholder of
    open_torch_save, starts: its record, of the storage's size, as open_torch_save found it."""
    offset = getattr(placeholder.untyped_storage(), "_checkpoint_offset", None)
    if offset is None:
        raise UnsupportedLayoutError(f"{name!r} has no storage record in the file (a tensor "
                                     "saved from the meta device has none)", path=path)
    needed = placeholder.untyped_storage().nbytes()
    record = records.get(offset)
    if record is None or record.size_bytes != needed:
        raise UnsupportedLayoutError(f"cannot tell where the bytes of {name!r} lie (no storage "
                                     f"record of {needed} bytes is where torch's loader puts "
                                     "it)", path=path)
    return record.data_offset


def find_tensors(value: Any) -> Iterator[torch.Tensor]:
    """Every tensor inside value's dicts, lists and tuples."""
    return (found for _, found in _named_storage_holders(value)
            if isinstance(found, torch.Tensor))


def _named_storage_holders(value: Any, name: str = "") -> Iterator[tuple[str, Any]]:
    """Every tensor and bare storage inside value's dicts, lists and tuples, with its dotted
    name there."""
    if isinstance(value, (torch.Tensor, torch.UntypedStorage, torch.TypedStorage)):
        yield name, value
    elif isinstance(value, (dict, list, tuple)):
        members = value.items() if isinstance(value, dict) else enumerate(value)
        for key, member in members:
            yield from _named_storage_holders(member, f"{name}.{key}" if name else str(key))


def refuse_tensors_in_object(path: Path, fqn: str, value: Any) -> None:
    """Objects are carried as pickles; one holding tensors is refused, as its tensors would
    come out empty."""
    if next(find_tensors(value), None) is not None:
        raise UnsupportedLayoutError(f"{fqn!r} is an object holding tensors, which "
                                     "dcpctl does not carry inside objects", path=path)

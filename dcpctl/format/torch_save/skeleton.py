"""torch.save files opened without their tensor data: the structure, and where each tensor's
bytes lie in the file, so that they can be read or written a piece at a time."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Iterator

import torch

from dcpctl.errors import DataError, UnsupportedLayoutError
from dcpctl.format.torch_save.archive_check import check_archive
from dcpctl.storage.local import open_for_reading


def open_torch_save(path: Path) -> tuple[Any, dict[int, int]]:
    """The file's contents with every tensor on the meta device (no tensor bytes are read),
    unpickled with torch's weights_only loader so that no code from the file runs, and the data
    offset -> size of each of its storage records (`<prefix>/data/<key>`)."""
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
    try:
        skeleton = torch.load(path, map_location="meta", weights_only=True)
    except Exception as error:  # the weights_only loader refuses in many ways
        raise UnsupportedLayoutError(
            f"cannot be loaded with weights_only=True ({weights_only_refusal(error)})",
            path=path) from None
    storages = {record.data_offset: record.size_bytes for record in records
                if record.name.partition("/")[2].startswith("data/")}
    return skeleton, storages


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


def storage_file_offset(path: Path, placeholder: torch.Tensor, records: dict[int, int]) -> int:
    """Where in the file the storage of a tensor from load_skeleton starts. torch works it out
    from the conventions of its own writer; it is checked against the archive's records."""
    offset = getattr(placeholder.untyped_storage(), "_checkpoint_offset", None)
    needed = placeholder.untyped_storage().nbytes()
    if offset is None or records.get(offset, -1) != needed:
        raise UnsupportedLayoutError(f"cannot tell where a tensor's bytes lie (torch "
                                     f"points at byte {offset}, where no storage record of "
                                     f"{needed} bytes starts)", path=path)
    return offset


def find_tensors(value: Any) -> Iterator[torch.Tensor]:
    """Every tensor inside value's dicts, lists and tuples."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, dict):
        for item in value.values():
            yield from find_tensors(item)
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from find_tensors(item)


def refuse_tensors_in_object(path: Path, fqn: str, value: Any) -> None:
    """Objects are carried as pickles; one holding tensors is refused, as its tensors would
    come out empty."""
    if next(find_tensors(value), None) is not None:
        raise UnsupportedLayoutError(f"{fqn!r} is an object holding tensors, which "
                                     "dcpctl does not carry inside objects", path=path)

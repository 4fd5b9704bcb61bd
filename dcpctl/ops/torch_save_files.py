"""torch.save files opened without their tensor data: the structure, and where each tensor's
bytes lie in the file, so that they can be read or written a piece at a time."""

from __future__ import annotations

import zipfile
from pathlib import Path
from typing import Any, Iterator

import torch

from dcpctl.errors import UnsupportedLayoutError


def load_skeleton(path: Path) -> Any:
    """The file's contents with every tensor on the meta device (no tensor bytes are read),
    unpickled with torch's weights_only loader, so no code from the file runs."""
    if not zipfile.is_zipfile(path):
        raise UnsupportedLayoutError(f"{path}: not a torch.save zip archive (files in the legacy "
                                     "format of torch < 1.6 are not supported)")
    with zipfile.ZipFile(path) as archive:
        byteorder = [name for name in archive.namelist() if name.endswith("/byteorder")]
        if byteorder and archive.read(byteorder[0]) != b"little":
            raise UnsupportedLayoutError(f"{path}: saved on a big-endian machine")
    try:
        return torch.load(path, map_location="meta", weights_only=True)
    except Exception as error:  # the weights_only loader refuses in many ways
        raise UnsupportedLayoutError(
            f"{path}: cannot be loaded with weights_only=True "
            f"({str(error).splitlines()[0]})") from None


def storage_file_offset(placeholder: torch.Tensor) -> int:
    """Where in the file the storage of a tensor from load_skeleton starts."""
    offset = getattr(placeholder.untyped_storage(), "_checkpoint_offset", None)
    if offset is None:
        raise UnsupportedLayoutError(f"torch {torch.__version__} does not report where a "
                                     "torch.save file keeps a tensor's bytes")
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
        raise UnsupportedLayoutError(f"{path}: {fqn!r} is an object holding tensors, which "
                                     "dcpctl does not carry inside objects")

"""Hugging Face style safetensors files: headers computed before any data, shard plans, the
`model.safetensors.index.json` index, and reading the tensors a file or index holds."""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from pathlib import Path

from dcpctl.errors import DataError, UnsupportedLayoutError
from dcpctl.format.checkpoint.view import HF_INDEX_FILE_NAME
from dcpctl.format.dtypes import DTYPES_BY_SAFETENSORS_CODE, DType
from dcpctl.format.checkpoint.items import read_safetensors_header

SINGLE_FILE_NAME = "model.safetensors"
DEFAULT_MAX_SHARD_BYTES = 5 * 10**9
_FILE_METADATA = {"format": "pt"}
_HEADER_ALIGNMENT = 8


@dataclass(frozen=True)
class SafetensorsTensor:
    """A tensor in a safetensors file: name, dtype, shape and its byte range in the file."""

    name: str
    dtype: DType
    shape: tuple[int, ...]
    start: int = 0
    nbytes: int = 0


def shard_file_name(number: int, count: int) -> str:
    """`model-00001-of-00003.safetensors`, or `model.safetensors` when there is one file."""
    if count == 1:
        return SINGLE_FILE_NAME
    return f"model-{number:05d}-of-{count:05d}.safetensors"


def plan_shards(sizes: list[int], max_shard_bytes: int) -> list[list[int]]:
    """Split tensors (by index, in order) into shards of at most max_shard_bytes of data, as
    huggingface_hub does: a tensor larger than the limit gets a shard of its own."""
    shards: list[list[int]] = [[]]
    shard_bytes = 0
    for index, size in enumerate(sizes):
        if shards[-1] and shard_bytes + size > max_shard_bytes:
            shards.append([])
            shard_bytes = 0
        shards[-1].append(index)
        shard_bytes += size
    return shards if shards[0] else []


def encode_header(tensors: list[SafetensorsTensor]) -> bytes:
    """The header of a file holding these tensors' data back to back in this order: 8-byte
    length, then JSON padded with spaces so that the data starts 8-byte aligned."""
    entries: dict = {"__metadata__": _FILE_METADATA}
    offset = 0
    for tensor in tensors:
        if tensor.dtype.safetensors_code is None:
            raise UnsupportedLayoutError(
                f"tensor {tensor.name!r} has dtype torch.{tensor.dtype.name}, which safetensors "
                "cannot store (cast it with --dtype, or leave it out with --exclude)")
        entries[tensor.name] = {"dtype": tensor.dtype.safetensors_code,
                                "shape": list(tensor.shape),
                                "data_offsets": [offset, offset + tensor.nbytes]}
        offset += tensor.nbytes
    text = json.dumps(entries, separators=(",", ":")).encode()
    text += b" " * (-(len(text) + 8) % _HEADER_ALIGNMENT)
    return struct.pack("<Q", len(text)) + text


def encode_index(total_size: int, weight_map: dict[str, str]) -> bytes:
    """`model.safetensors.index.json` as transformers writes it."""
    index = {"metadata": {"total_size": total_size}, "weight_map": weight_map}
    return (json.dumps(index, indent=2, sort_keys=True) + "\n").encode()


def read_safetensors_file(path: Path) -> list[SafetensorsTensor]:
    """The tensors a safetensors file holds, checked against the file's size."""
    header, data_start = read_safetensors_header(path, 0)
    file_bytes = path.stat().st_size
    tensors = []
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        tensors.append(_parse_entry(path, name, entry, data_start, file_bytes))
    return tensors


def _parse_entry(path: Path, name: str, entry, data_start: int,
                 file_bytes: int) -> SafetensorsTensor:
    try:
        code, shape, (begin, end) = entry["dtype"], entry["shape"], entry["data_offsets"]
        if not all(type(value) is int and value >= 0 for value in [*shape, begin, end]):
            raise TypeError
    except (TypeError, KeyError, ValueError):
        raise DataError(f"{path}: safetensors header entry {name!r} is not a valid tensor "
                        "entry (dtype, shape, data_offsets)") from None
    dtype = DTYPES_BY_SAFETENSORS_CODE.get(code)
    if dtype is None:
        raise UnsupportedLayoutError(f"{path}: tensor {name!r} has safetensors dtype {code!r}, "
                                     "which dcpctl does not know")
    nbytes = math.prod(shape) * dtype.itemsize
    if end - begin != nbytes or data_start + end > file_bytes:
        raise DataError(f"{path}: tensor {name!r} claims bytes {begin}..{end} of the data, "
                        f"which do not hold {nbytes} bytes inside the file")
    return SafetensorsTensor(name, dtype, tuple(shape), data_start + begin, nbytes)


def read_safetensors_model(source: Path) -> list[tuple[Path, SafetensorsTensor]]:
    """Every tensor of a safetensors model and its file: a single file, a directory with an
    index (each tensor must be in the file the index names), or a directory's
    `model.safetensors`."""
    files, weight_map = _model_files(source)
    tensors, file_of = [], {}
    for path in files:
        for tensor in read_safetensors_file(path):
            if tensor.name in file_of:
                raise DataError(f"{path}: tensor {tensor.name!r} is also in "
                                f"{file_of[tensor.name].name}")
            file_of[tensor.name] = path
            tensors.append((path, tensor))
    for name, file_name in (weight_map or {}).items():
        if name not in file_of or file_of[name].name != file_name:
            raise DataError(f"{source / HF_INDEX_FILE_NAME}: weight_map puts {name!r} in "
                            f"{file_name}, which does not hold it")
    return tensors


def _model_files(source: Path) -> tuple[list[Path], dict | None]:
    if source.is_file():
        return [source], None
    index_path = source / HF_INDEX_FILE_NAME
    if index_path.is_file():
        try:
            weight_map = json.loads(index_path.read_text())["weight_map"]
            names = list(dict.fromkeys(weight_map.values()))
        except (ValueError, KeyError, TypeError, AttributeError):
            raise DataError(f"{index_path}: not a safetensors index (no weight_map)") from None
        return [_file_named_by_index(source, index_path, name) for name in names], weight_map
    if (source / SINGLE_FILE_NAME).is_file():
        return [source / SINGLE_FILE_NAME], None
    raise DataError(f"{source}: holds neither {HF_INDEX_FILE_NAME} nor {SINGLE_FILE_NAME}")


def _file_named_by_index(directory: Path, index_path: Path, name) -> Path:
    if not isinstance(name, str) or "/" in name or "\\" in name or name in ("", ".", ".."):
        raise DataError(f"{index_path}: weight_map names file {name!r}, which is not a file "
                        "name inside the directory")
    path = directory / name
    if not path.is_file():
        raise DataError(f"{path}: missing, though {index_path.name} names it")
    return path

"""Hugging Face style safetensors files: headers computed before any data, shard plans, the
`model.safetensors.index.json` index, and reading the tensors a file or index holds."""

from __future__ import annotations

import functools
import json
import math
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

from dcpctl.errors import DataError, UnsupportedLayoutError, missing_file_error
from dcpctl.format.dtypes import DTYPES_BY_SAFETENSORS_CODE, DType, fits_in_torch
from dcpctl.format.file_names import HF_INDEX_FILE_NAME, METADATA_FILE_NAME
from dcpctl.storage.paths import open_ranged, read_whole
from dcpctl.storage.planned_from import note_planned_from
from dcpctl.wording import counted, listed

SINGLE_FILE_NAME = "model.safetensors"
DEFAULT_MAX_SHARD_BYTES = 5 * 10**9
METADATA_KEY = "__metadata__"
_FILE_METADATA = {"format": "pt"}
_HEADER_ALIGNMENT = 8
_MAX_HEADER_BYTES = 100_000_000  # the safetensors library refuses a longer header


@dataclass(frozen=True)
class SafetensorsTensor:
    """A tensor in a safetensors file: name, dtype, shape and its byte range in the file."""

    name: str
    dtype: DType
    shape: tuple[int, ...]
    start: int = 0
    nbytes: int = 0


def parse_json(data: bytes | str):
    """A JSON document read from a file (a header, an index): ValueError where it is not one
    as JSON (and the safetensors library) defines it: a byte order mark first, NaN or
    Infinity, a string that is no Unicode (a lone surrogate such as "\\ud800"); or where it
    nests deeper than Python's parser can follow (RecursionError otherwise); or bytes that are
    not UTF-8 (Python's parser would take UTF-16 and UTF-32 too)."""
    if data[:3] == b"\xef\xbb\xbf" or data[:1] == "\ufeff":
        raise ValueError("starts with a byte order mark")
    if isinstance(data, bytes):
        data = data.decode("utf-8")  # a UnicodeDecodeError is a ValueError
    try:
        document = json.loads(data, parse_constant=_refuse_constant)
        json.dumps(document, ensure_ascii=False).encode()  # a lone surrogate cannot be
    except RecursionError:
        raise ValueError("nested deeper than any real one") from None
    except UnicodeEncodeError:
        raise ValueError("holds a string that is not Unicode (a lone surrogate)") from None
    return document


def _refuse_constant(name: str):
    raise ValueError(f"holds {name}, which is not JSON")


def read_safetensors_header(path: Path, blob_offset: int = 0) -> tuple[dict, int]:
    """The JSON header of the safetensors blob at blob_offset of a file (a whole safetensors
    file, or one of a SAFETENSORS-serialized DCP checkpoint), and where its data starts; read
    once per version of the file (a file rewritten since is read again)."""
    try:
        stat = path.stat()
    except FileNotFoundError:
        raise missing_file_error(path) from None
    version = tuple(getattr(stat, field, None)
                    for field in ("st_size", "st_ino", "st_mtime_ns", "st_ctime_ns"))
    return _read_safetensors_header(path, blob_offset, version)


@functools.lru_cache(maxsize=64)
def _read_safetensors_header(path: Path, blob_offset: int, version: tuple) -> tuple[dict, int]:
    where = f"safetensors header at byte {blob_offset}"
    try:
        with open_ranged(path) as reader:
            prefix = reader.read(blob_offset, 8)
            if len(prefix) < 8:
                raise DataError(f"truncated {where}", path=path)
            (header_bytes,) = struct.unpack("<Q", prefix)
            if header_bytes > _MAX_HEADER_BYTES:
                raise DataError(f"{where} claims {header_bytes} bytes, more than the "
                                f"safetensors library reads ({_MAX_HEADER_BYTES})", path=path)
            text = reader.read(blob_offset + 8, header_bytes)
            if len(text) < header_bytes:
                raise DataError(f"{where} claims {header_bytes} bytes; the file ends "
                                f"{len(text)} bytes after its length", path=path)
            header = parse_json(text)
    except (ValueError, UnicodeDecodeError) as error:
        raise DataError(f"{where} is not JSON ({error})", path=path) from None
    except FileNotFoundError:
        raise missing_file_error(path) from None
    if not isinstance(header, dict):
        raise DataError(f"{where} is not an object", path=path)
    metadata = header.get(METADATA_KEY) or {}  # null, as the library reads it: none
    if not (isinstance(metadata, dict) and all(type(value) is str for value in metadata.values())):
        raise DataError(f"{where} has a {METADATA_KEY} that is not a map of strings", path=path)
    return header, blob_offset + 8 + header_bytes


def safetensors_tensor_range(path: Path, blob_offset: int, name: str) -> tuple[int, int]:
    """Where in the file the bytes of tensor `name` of the blob at blob_offset start, and how
    many there are."""
    header, data_start = read_safetensors_header(path, blob_offset)
    entry = header.get(name)
    try:
        begin, end = entry["data_offsets"]
        if not (isinstance(begin, int) and isinstance(end, int) and 0 <= begin <= end):
            raise TypeError
    except (TypeError, KeyError, ValueError):
        raise DataError("the safetensors header has no valid entry for this tensor",
                        path=path, fqn=name) from None
    return data_start + begin, end - begin


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


def check_tensor_name(name: str) -> None:
    """Refuse a name a safetensors file cannot hold and give back: not UTF-8 (a lone surrogate),
    or the header's own `__metadata__` key."""
    if name == METADATA_KEY:
        raise UnsupportedLayoutError(f"a tensor cannot be called {METADATA_KEY!r} in a "
                                     "safetensors file (rename it with --rename)")
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:
        raise UnsupportedLayoutError(f"tensor name {name!r} is not valid UTF-8, which a "
                                     "safetensors header must be (rename it with --rename, or "
                                     "leave it out with --exclude)") from None


_NAMES_SHOWN = 10


def refuse_what_it_cannot_store(tensors: Iterable[tuple[str, DType, tuple[int, ...]]]) -> None:
    """Refuse, all named in one message, the tensors (name, dtype, sizes) whose dtype
    safetensors has no code for, with the remedy (--dtype casts floating-point tensors only);
    and a 0-d tensor of packed values, which a safetensors shape cannot count."""
    tensors = list(tensors)
    for name, dtype, sizes in tensors:
        if dtype.safetensors_code and dtype.safetensors_shape(sizes) is None:
            raise UnsupportedLayoutError(
                f"tensor {name!r} is a 0-d torch.{dtype.name}, whose {dtype.packed_values} "
                "packed values a safetensors shape cannot count (leave it out with --exclude)")
    refused = [(name, dtype) for name, dtype, _ in tensors if dtype.safetensors_code is None]
    if not refused:
        return
    floating = sum(dtype.is_floating_point for _, dtype in refused)
    if len(refused) == 1:
        (name, dtype), = refused
        remedy = ("cast it with --dtype, or leave it out with --exclude" if floating
                  else "leave it out with --exclude")
        raise UnsupportedLayoutError(f"tensor {name!r} has dtype torch.{dtype.name}, which "
                                     f"safetensors cannot store ({remedy})")
    if floating == len(refused):
        remedy = "cast them with --dtype, or leave them out with --exclude"
    elif floating:
        remedy = "cast the floating-point ones with --dtype; leave the others out with --exclude"
    else:
        remedy = "leave them out with --exclude"
    shown = listed([f"{name!r} (torch.{dtype.name})" for name, dtype in refused], _NAMES_SHOWN)
    raise UnsupportedLayoutError(f"{counted(len(refused), 'tensor')} have dtypes safetensors "
                                 f"cannot store: {shown} ({remedy})")


def encode_header(tensors: list[SafetensorsTensor]) -> bytes:
    """The header of a file holding these tensors' data back to back in this order: 8-byte
    length, then JSON padded with spaces so that the data starts 8-byte aligned."""
    entries: dict = {METADATA_KEY: _FILE_METADATA}
    offset = 0
    refuse_what_it_cannot_store((tensor.name, tensor.dtype, tensor.shape) for tensor in tensors)
    for tensor in tensors:
        check_tensor_name(tensor.name)
        entries[tensor.name] = {"dtype": tensor.dtype.safetensors_code,
                                "shape": list(tensor.dtype.safetensors_shape(tensor.shape)),
                                "data_offsets": [offset, offset + tensor.nbytes]}
        offset += tensor.nbytes
    text = json.dumps(entries, separators=(",", ":")).encode()
    text += b" " * (-(len(text) + 8) % _HEADER_ALIGNMENT)
    return struct.pack("<Q", len(text)) + text


def encode_index(total_size: int, weight_map: dict[str, str]) -> bytes:
    """`model.safetensors.index.json` as transformers writes it."""
    index = {"metadata": {"total_size": total_size}, "weight_map": weight_map}
    return (json.dumps(index, indent=2, sort_keys=True) + "\n").encode()


SHARDING_INFO_KEY = "DCP_SHARDING_INFO"
"""What torch's HuggingFaceStorageWriter puts in the header of a file holding one rank's
chunks (format/checkpoint/hf_storage.py)."""


def read_safetensors_file(path: Path) -> list[SafetensorsTensor]:
    """The tensors a safetensors file holds, checked against the file's size. A file of one
    rank's chunks is refused: its tensors are not whole."""
    header, data_start = read_safetensors_header(path, 0)
    if isinstance(header.get(METADATA_KEY), dict) and SHARDING_INFO_KEY in header[METADATA_KEY]:
        raise UnsupportedLayoutError(
            f"holds one rank's chunks of a checkpoint torch's HuggingFaceStorageWriter wrote "
            f"({SHARDING_INFO_KEY}), not whole tensors; give the directory of all the ranks' "
            "files", path=path)
    file_bytes = path.stat().st_size
    tensors = []
    for name, entry in header.items():
        if name == METADATA_KEY:
            continue
        tensors.append(parse_entry(path, name, entry, data_start, file_bytes))
    check_back_to_back(path, tensors, data_start, file_bytes)
    return tensors


def parse_entry(path: Path, name: str, entry, data_start: int,
                file_bytes: int) -> SafetensorsTensor:
    """One tensor entry of a header, checked: a known dtype, a shape torch can hold, and
    exactly its bytes inside the file (file_bytes long, its data from data_start)."""
    try:
        code, shape, (begin, end) = entry["dtype"], entry["shape"], entry["data_offsets"]
        if type(code) is not str or not all(type(value) is int and value >= 0
                                            for value in [*shape, begin, end]):
            raise TypeError
    except (TypeError, KeyError, ValueError):
        raise DataError(f"safetensors header entry {name!r} is not a valid tensor entry "
                        "(dtype, shape, data_offsets)", path=path) from None
    dtype = DTYPES_BY_SAFETENSORS_CODE.get(code)
    if dtype is None:
        raise UnsupportedLayoutError(f"tensor {name!r} has safetensors dtype {code!r}, "
                                     "which dcpctl does not know", path=path)
    sizes = dtype.sizes_of_safetensors_shape(shape)
    if sizes is None:
        raise DataError(f"tensor {name!r} has safetensors dtype {code} and shape {shape}, whose "
                        f"last size is no whole number of torch.{dtype.name} elements (each "
                        f"packs {dtype.packed_values} values)", path=path)
    if not fits_in_torch(sizes, dtype.itemsize):
        raise DataError(f"tensor {name!r} has a shape past what torch can hold (sizes, "
                        "elements and bytes below 2**63)", path=path)
    nbytes = math.prod(sizes) * dtype.itemsize
    if end - begin != nbytes or data_start + end > file_bytes:
        raise DataError(f"tensor {name!r} claims bytes {begin}..{end} of the data, which do "
                        f"not hold {nbytes} bytes inside the file", path=path)
    return SafetensorsTensor(name, dtype, sizes, data_start + begin, nbytes)


def check_back_to_back(path: Path, tensors: list[SafetensorsTensor], data_start: int,
                       file_bytes: int) -> None:
    """Refuse a file whose tensors' bytes overlap, leave gaps, or end before the file does: a
    safetensors file holds them back to back from the end of its header to its own end, and
    the safetensors library refuses any other."""
    position = data_start
    for tensor in sorted(tensors, key=lambda tensor: (tensor.start, tensor.nbytes)):
        if tensor.start != position:
            raise DataError(
                f"tensor {tensor.name!r} starts at byte {tensor.start}, where the tensors "
                f"before it end at byte {position}: a safetensors file holds its tensors back "
                "to back, without overlaps or gaps", path=path)
        position += tensor.nbytes
    if position != file_bytes:
        raise DataError(f"the tensors end at byte {position}, the file at byte {file_bytes}: a "
                        "safetensors file ends with its last tensor", path=path)


def read_safetensors_model(source: Path) -> list[tuple[Path, SafetensorsTensor]]:
    """Every tensor of a safetensors model and its file: a single file, a directory with an
    index (each tensor it names must be in the file it names; a file it names may hold
    more, which are taken too, as transformers loads every tensor of such a file), or a
    directory's `model.safetensors`."""
    files, weight_map = _model_files(source)
    if weight_map is not None:
        note_planned_from(source / HF_INDEX_FILE_NAME, whole=True)
    tensors, file_of = [], {}
    for path in files:
        note_planned_from(path, whole=False)
        for tensor in read_safetensors_file(path):
            if tensor.name in file_of:
                raise DataError(f"tensor {tensor.name!r} is also in "
                                f"{file_of[tensor.name].name}", path=path)
            file_of[tensor.name] = path
            tensors.append((path, tensor))
    for name, file_name in (weight_map or {}).items():
        if name not in file_of or file_of[name].name != file_name:
            raise DataError(f"weight_map puts {name!r} in {file_name}, which does not hold it",
                            path=source / HF_INDEX_FILE_NAME)
    return tensors


MAX_INDEX_BYTES = 128 << 20
"""An index names each tensor once in a few dozen bytes: the largest models' take a few MiB."""


def read_weight_map(index_path: Path) -> dict:
    """The weight_map of a `model.safetensors.index.json`: tensor name to file name."""
    size = index_path.stat().st_size
    if size > MAX_INDEX_BYTES:
        raise DataError(f"is {size} bytes, past the {MAX_INDEX_BYTES >> 20} MiB a safetensors "
                        "index of any model takes", path=index_path)
    try:
        document = parse_json(read_whole(index_path))
    except ValueError as error:
        raise DataError(f"not a safetensors index: not JSON ({error})", path=index_path) from None
    weight_map = document.get("weight_map") if isinstance(document, dict) else None
    if not isinstance(weight_map, dict):
        raise DataError("not a safetensors index (no weight_map object)", path=index_path)
    wrong = next((name for name, file_name in weight_map.items()
                  if not isinstance(file_name, str)), None)
    if wrong is not None:
        raise DataError(f"weight_map gives {wrong!r} the file {weight_map[wrong]!r:.80}, not a "
                        "file name", path=index_path)
    return weight_map


def _model_files(source: Path) -> tuple[list[Path], dict | None]:
    if source.is_file():
        return [source], None
    index_path = source / HF_INDEX_FILE_NAME
    if index_path.is_file():
        weight_map = read_weight_map(index_path)
        if not weight_map:
            raise DataError("its weight_map names no tensors: no model to convert",
                            path=index_path)
        names = list(dict.fromkeys(weight_map.values()))
        return [_file_named_by_index(source, index_path, name) for name in names], weight_map
    if (source / SINGLE_FILE_NAME).is_file():
        return [source / SINGLE_FILE_NAME], None
    already = (f"; it holds {METADATA_FILE_NAME}: a DCP checkpoint already (to lay it out for "
               "other ranks, `dcpctl reshard`)" if (source / METADATA_FILE_NAME).exists() else "")
    raise DataError(f"holds neither {HF_INDEX_FILE_NAME} nor {SINGLE_FILE_NAME}{already}",
                    path=source)


def _file_named_by_index(directory: Path, index_path: Path, name) -> Path:
    if not isinstance(name, str) or "/" in name or "\\" in name or name in ("", ".", ".."):
        raise DataError(f"weight_map names file {name!r}, which is not a file name inside the "
                        "directory", path=index_path)
    path = directory / name
    if not path.is_file():
        raise DataError(f"missing, though {index_path.name} names it", path=path)
    return path

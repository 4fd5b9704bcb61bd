"""The typed view of a DCP checkpoint directory: its metadata joined with its data files."""

from __future__ import annotations

import math
import os
from collections import Counter
from dataclasses import dataclass, field
from itertools import chain, compress, repeat
from operator import add, attrgetter, is_, is_not, mul, not_
from pathlib import Path, PurePosixPath

from dcpctl.columns import (first_by_group, index_of_largest_by_group, repeat_each, set_each,
                            sums_of_runs)
from dcpctl.errors import (
    CheckpointNotFoundError,
    DataError,
    IncompleteCheckpointError,
    UnsafePathError,
    UnsupportedLayoutError,
)
from dcpctl.format.dtypes import DType
from dcpctl.format.garbage_collection import paused_garbage_collection
from dcpctl.format.metadata import METADATA_FILE_NAME, read_metadata
from dcpctl.format.records import CheckpointMetadata, ChunkMetadata, StorageInfo, TensorMetadata

HF_INDEX_FILE_NAME = "model.safetensors.index.json"
TORCH_SAVE = "torch_save"
SAFETENSORS = "safetensors"
_ZIP_MAGIC = b"PK\x03\x04"
_ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
_FQN, _KEY_OFFSET, _CHUNKS, _OFFSETS = map(attrgetter, ("fqn", "offset", "chunks", "offsets"))
_PROPERTIES, _DTYPE, _SIZE = map(attrgetter, ("properties", "dtype", "size"))
_ITEMSIZE, _RELATIVE_PATH, _OFFSET, _LENGTH = map(attrgetter, ("itemsize", "relative_path",
                                                                "offset", "length"))


@dataclass
class TensorEntry:
    """A tensor of the checkpoint: fqn, dtype, full shape and its chunks, each joined with the
    storage of its bytes (`chunk.storage`, None where the metadata lacks it)."""

    fqn: str
    dtype: DType
    shape: tuple[int, ...]
    chunks: list[ChunkMetadata]
    nbytes: int = 0
    """Logical size of the full tensor in bytes."""
    stored_bytes: int = 0
    """Bytes its chunks occupy in the data files."""


@dataclass
class ObjectEntry:
    """A non-tensor entry (a pickled Python object) and where it is stored."""

    fqn: str
    storage: StorageInfo | None


@dataclass
class DataFile:
    """A data file the metadata refers to: its size, how its items are serialized, how many
    items it holds and where the last of them ends (the item that ends there: last_fqn)."""

    name: str
    size_bytes: int | None
    serialization: str = TORCH_SAVE
    item_count: int = 0
    end_bytes: int = 0
    last_fqn: str = ""


@dataclass
class Checkpoint:
    """A checkpoint directory read through its metadata; no tensor data is loaded."""

    path: Path
    metadata: CheckpointMetadata
    tensors: list[TensorEntry] = field(default_factory=list)
    objects: list[ObjectEntry] = field(default_factory=list)
    files: dict[str, DataFile] = field(default_factory=dict)
    _checked_paths: dict[str, Path] = field(default_factory=dict, repr=False)

    def data_path(self, relative_path: str) -> Path:
        """The path of a data file named in the metadata, refused if it escapes the directory."""
        path = self._checked_paths.get(relative_path)
        if path is None:
            path = self._checked_paths[relative_path] = resolve_inside(self.path, relative_path)
        return path


def resolve_inside(directory: Path, relative_path: str) -> Path:
    """`directory/relative_path`, refused if it is absolute, climbs out, or links outside."""
    pure = PurePosixPath(relative_path)
    if pure.is_absolute() or ".." in pure.parts or "\\" in relative_path or not pure.parts:
        raise UnsafePathError(
            f"{directory}: metadata names data file {relative_path!r}, which is not a plain "
            "path inside the checkpoint directory"
        )
    candidate = directory / pure
    real_directory = os.path.realpath(directory)
    real_candidate = os.path.realpath(candidate)
    if os.path.commonpath([real_directory, real_candidate]) != real_directory:
        raise UnsafePathError(
            f"{candidate}: data file resolves to {real_candidate}, outside the checkpoint "
            "directory (a symlink out?)"
        )
    return candidate


def open_checkpoint(path: str | os.PathLike, check_files: bool = True) -> Checkpoint:
    """Read a checkpoint's metadata and data file sizes; with check_files, refuse missing or
    truncated files."""
    directory = Path(path)
    _check_is_checkpoint_directory(directory)
    with paused_garbage_collection():
        checkpoint = Checkpoint(directory, read_metadata(directory))
        _collect_entries(checkpoint)
        _collect_files(checkpoint)
    if check_files:
        problems = find_file_problems(checkpoint)
        if problems:
            more = f" (and {len(problems) - 1} more problems)" if len(problems) > 1 else ""
            raise DataError(problems[0] + more)
    return checkpoint


def _check_is_checkpoint_directory(directory: Path) -> None:
    if not directory.exists():
        raise CheckpointNotFoundError(f"{directory}: no such file or directory")
    if not directory.is_dir():
        raise CheckpointNotFoundError(f"{directory}: not a directory; a DCP checkpoint is a "
                                      "directory holding .metadata and .distcp files")
    if (directory / METADATA_FILE_NAME).exists():
        return
    if (directory / HF_INDEX_FILE_NAME).exists():
        raise UnsupportedLayoutError(
            f"{directory}: holds {HF_INDEX_FILE_NAME} but no {METADATA_FILE_NAME}: this is a "
            "Hugging Face safetensors checkpoint (HuggingFaceStorageWriter), not DCP metadata"
        )
    if (directory / f"{METADATA_FILE_NAME}.tmp").exists() or any(directory.glob("*.distcp")):
        raise IncompleteCheckpointError(
            f"{directory}: incomplete checkpoint: data files but no {METADATA_FILE_NAME} "
            "(a save still running, or one that died before finishing)"
        )
    raise IncompleteCheckpointError(f"{directory}: not a DCP checkpoint: no {METADATA_FILE_NAME}")


def _collect_entries(checkpoint: Checkpoint) -> None:
    # Whole columns at a time, with builtins that loop in C: metadata can list millions of chunks.
    storage_data = checkpoint.metadata.storage_data or {}
    storage_by_key = dict(zip(zip(map(_FQN, storage_data), map(_KEY_OFFSET, storage_data)),
                              storage_data.values()))
    entries = checkpoint.metadata.state_dict_metadata
    fqns, values = list(entries), list(entries.values())
    is_tensor = list(map(is_, map(type, values), repeat(TensorMetadata)))
    tensors, tensor_fqns = list(compress(values, is_tensor)), list(compress(fqns, is_tensor))
    chunk_lists = list(map(_CHUNKS, tensors))
    stored_bytes = _join_chunks_to_storage(tensor_fqns, chunk_lists, storage_by_key)
    dtypes, sizes = list(map(_DTYPE, map(_PROPERTIES, tensors))), list(map(_SIZE, tensors))
    nbytes = map(mul, map(math.prod, sizes), map(_ITEMSIZE, dtypes))
    checkpoint.tensors = list(map(TensorEntry, tensor_fqns, dtypes, sizes, chunk_lists, nbytes,
                                  stored_bytes))
    object_fqns = list(compress(fqns, map(not_, is_tensor)))
    object_storage = map(storage_by_key.get, zip(object_fqns, repeat(None)))
    checkpoint.objects = list(map(ObjectEntry, object_fqns, object_storage))


def _join_chunks_to_storage(tensor_fqns: list[str], chunk_lists: list[list[ChunkMetadata]],
                            storage_by_key: dict) -> list[int]:
    """Set each chunk's `storage`; return the bytes each tensor's chunks occupy."""
    chunk_counts = list(map(len, chunk_lists))
    chunks = list(chain.from_iterable(chunk_lists))
    chunk_fqns = repeat_each(tensor_fqns, chunk_counts)
    storages = list(map(storage_by_key.get, zip(chunk_fqns, map(_OFFSETS, chunks))))
    set_each(chunks, "storage", storages)
    if all(storages):
        lengths = map(_LENGTH, storages)
    else:
        lengths = [storage.length if storage is not None else 0 for storage in storages]
    return sums_of_runs(lengths, chunk_counts)


def _collect_files(checkpoint: Checkpoint) -> None:
    storage_data = checkpoint.metadata.storage_data or {}
    keys, infos = list(storage_data), list(storage_data.values())
    paths = list(map(_RELATIVE_PATH, infos))
    for name, item_count in Counter(paths).items():
        try:
            size_bytes = checkpoint.data_path(name).stat().st_size
        except FileNotFoundError:
            size_bytes = None
        checkpoint.files[name] = DataFile(name, size_bytes, item_count=item_count)
    ends = list(map(add, map(_OFFSET, infos), map(_LENGTH, infos)))
    for name, index in index_of_largest_by_group(paths, ends).items():
        if ends[index] > 0:
            checkpoint.files[name].end_bytes, checkpoint.files[name].last_fqn = (
                ends[index], keys[index].fqn)
    is_tensor_item = list(map(is_not, map(_KEY_OFFSET, keys), repeat(None)))
    first_tensor_item = first_by_group(compress(paths, is_tensor_item),
                                       compress(infos, is_tensor_item))
    for name, data_file in checkpoint.files.items():
        if name in first_tensor_item:
            data_file.serialization = _detect_serialization(checkpoint, first_tensor_item[name])


def _detect_serialization(checkpoint: Checkpoint, info: StorageInfo) -> str:
    """torch.save items start with a zip (or zstd) header; SAFETENSORS files with a header length
    followed by JSON."""
    if checkpoint.files[info.relative_path].size_bytes is None:
        return TORCH_SAVE
    with open(checkpoint.data_path(info.relative_path), "rb") as stream:
        stream.seek(info.offset)
        head = stream.read(9)
    if head[:4] in (_ZIP_MAGIC, _ZSTD_MAGIC):
        return TORCH_SAVE
    if len(head) == 9 and head[8:9] == b"{":
        return SAFETENSORS
    return TORCH_SAVE


def find_file_problems(checkpoint: Checkpoint) -> list[str]:
    """Missing data files and item byte ranges that run past the end of their file."""
    problems = []
    for name, data_file in sorted(checkpoint.files.items()):
        path = checkpoint.path / name
        if data_file.size_bytes is None:
            problems.append(f"{path}: missing data file, named by {data_file.item_count} items "
                            "in the metadata")
        elif data_file.end_bytes > data_file.size_bytes:
            problems.append(f"{path}: truncated: {data_file.size_bytes} bytes, but item "
                            f"{data_file.last_fqn!r} ends at byte {data_file.end_bytes}")
    return problems

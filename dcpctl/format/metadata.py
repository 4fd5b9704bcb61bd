"""Safe reading and faithful writing of a DCP `.metadata` file.

Neither reading nor writing imports torch. Reading never runs code from the file: the pickle is
loaded with an allowlist that maps each class DCP metadata uses onto a plain record of ours.
Writing pickles the records under torch's class names (format/torch_pickle.py), so stock
`torch.distributed.checkpoint` reads them as its own.
"""

from __future__ import annotations

import io
import operator
import os
import pickle
from pathlib import Path, PurePosixPath, PureWindowsPath
from typing import Any

from dcpctl.errors import MetadataError, UnsafeMetadataError
from dcpctl.format.dtypes import DTYPE_ALIASES, DTYPES_BY_NAME, DType
from dcpctl.format.garbage_collection import paused_garbage_collection
from dcpctl.format.records import (
    BytesMetadata, CheckpointMetadata, ChunkMetadata, ItemKey, StorageInfo, StorageMeta,
    TensorMetadata, TensorProperties,
)

METADATA_FILE_NAME = ".metadata"
_TORCH_METADATA_MODULE = "torch.distributed.checkpoint.metadata"
_TORCH_FILESYSTEM_MODULE = "torch.distributed.checkpoint.filesystem"
_TORCH_LAYOUTS = ("strided", "sparse_coo", "sparse_csr", "sparse_csc", "sparse_bsr", "sparse_bsc")
_MEMORY_FORMATS = ("contiguous_format", "channels_last", "preserve_format")


def _make_dtype(name: str) -> DType:
    return DTYPES_BY_NAME[DTYPE_ALIASES.get(name, name)]


def _layout_by_qualified_name(qualified_name: Any) -> str:
    """Stands in for torch.serialization._get_layout, which torch pickles layouts through."""
    name = qualified_name.removeprefix("torch.") if isinstance(qualified_name, str) else None
    if name not in _TORCH_LAYOUTS:
        raise UnsafeMetadataError(f"names an unknown tensor layout {qualified_name!r}")
    return name


_RECORD_CLASSES = frozenset({CheckpointMetadata, TensorMetadata, BytesMetadata, ChunkMetadata,
                             TensorProperties, ItemKey, StorageMeta, StorageInfo})


def _reconstruct_record(cls: Any, base: Any, state: Any) -> Any:
    """Stands in for copyreg._reconstructor, restricted to `object.__new__` of our records."""
    if cls not in _RECORD_CLASSES or base is not object or state is not None:
        raise UnsafeMetadataError("uses copyreg._reconstructor on something other than a DCP "
                                  "metadata class")
    return cls.__new__(cls)


_ALLOWED_CLASSES: dict[tuple[str, str], Any] = {
    (_TORCH_METADATA_MODULE, "Metadata"): CheckpointMetadata,
    (_TORCH_METADATA_MODULE, "TensorStorageMetadata"): TensorMetadata,
    (_TORCH_METADATA_MODULE, "BytesStorageMetadata"): BytesMetadata,
    (_TORCH_METADATA_MODULE, "ChunkStorageMetadata"): ChunkMetadata,
    (_TORCH_METADATA_MODULE, "TensorProperties"): TensorProperties,
    (_TORCH_METADATA_MODULE, "MetadataIndex"): ItemKey,
    (_TORCH_METADATA_MODULE, "StorageMeta"): StorageMeta,
    (_TORCH_METADATA_MODULE, "_MEM_FORMAT_ENCODING"): int,
    (_TORCH_FILESYSTEM_MODULE, "_StorageInfo"): StorageInfo,
    ("torch", "Size"): tuple,
    ("torch.serialization", "_get_layout"): _layout_by_qualified_name,
    ("collections", "OrderedDict"): dict,
    ("copyreg", "_reconstructor"): _reconstruct_record,
    ("builtins", "object"): object,
    # Pure paths only: building one touches no file system.
    **{(module, name): PurePosixPath
       for module in ("pathlib", "pathlib._local") for name in ("PosixPath", "PurePosixPath")},
    **{(module, name): PureWindowsPath
       for module in ("pathlib", "pathlib._local") for name in ("WindowsPath", "PureWindowsPath")},
    **{("torch", name): _make_dtype(name) for name in [*DTYPES_BY_NAME, *DTYPE_ALIASES]},
    **{("torch", name): name for name in _TORCH_LAYOUTS},
}


class _AllowlistUnpickler(pickle.Unpickler):
    """Resolves only the globals DCP metadata uses, each to a plain record of ours."""

    def find_class(self, module: str, name: str) -> Any:
        try:
            return _ALLOWED_CLASSES[(module, name)]
        except KeyError:
            raise UnsafeMetadataError(
                f"refers to {module}.{name}, which is not a DCP metadata class; "
                "refusing to unpickle it"
            ) from None

    def persistent_load(self, pid: Any) -> Any:
        raise UnsafeMetadataError("uses pickle persistent ids, which DCP metadata never does")


def parse_metadata(data: bytes, source: str = METADATA_FILE_NAME) -> CheckpointMetadata:
    """Unpickle `.metadata` bytes with the allowlist and check that they are DCP metadata."""
    if not data:
        raise MetadataError(f"{source}: file is empty")
    try:
        with paused_garbage_collection():
            loaded = _AllowlistUnpickler(io.BytesIO(data)).load()
    except UnsafeMetadataError as error:
        raise UnsafeMetadataError(f"{source}: {error}") from None
    except Exception as error:  # a damaged pickle fails in many ways; all mean the same
        raise MetadataError(
            f"{source}: not a readable DCP metadata pickle ({type(error).__name__}: {error})"
        ) from None
    with paused_garbage_collection():
        check_metadata_structure(loaded, source)
    return loaded


def check_metadata_structure(loaded: Any, source: str) -> None:
    """Raise MetadataError unless `loaded` has the shape of DCP metadata; normalizes in place."""

    def fail(rule: str) -> MetadataError:
        return MetadataError(f"{source}: {rule}")

    if not isinstance(loaded, CheckpointMetadata):
        raise fail(f"holds a {type(loaded).__name__}, not DCP Metadata")
    if not isinstance(loaded.state_dict_metadata, dict):
        raise fail("state_dict_metadata is not a dict")
    for fqn, entry in loaded.state_dict_metadata.items():
        if not isinstance(fqn, str):
            raise fail(f"state_dict_metadata key {fqn!r} is not a string")
        if isinstance(entry, TensorMetadata):
            _check_tensor_entry(fqn, entry, fail)
        elif not isinstance(entry, BytesMetadata):
            raise fail(f"entry {fqn!r} is a {type(entry).__name__}, not tensor or bytes metadata")
    storage_data = loaded.storage_data
    if storage_data is None:
        loaded.storage_data = storage_data = {}
    if not isinstance(storage_data, dict):
        raise fail("storage_data is not a dict")
    for key, info in storage_data.items():
        _check_storage_entry(key, info, loaded.state_dict_metadata, fail)


_INT_TYPE_SET = {int}


def _check_tensor_entry(fqn: str, entry: TensorMetadata, fail) -> None:
    # Written for speed: this runs for every chunk of checkpoints with a million of them.
    properties = entry.properties
    if type(properties) is not TensorProperties or type(properties.dtype) is not DType:
        raise fail(f"tensor {fqn!r} has no dtype")
    size = entry.size
    if type(size) is not tuple:
        raise fail(f"tensor {fqn!r} has size {size!r}, not a tuple of sizes")
    rank = len(size)
    chunks = entry.chunks
    if type(chunks) is not list:
        raise fail(f"tensor {fqn!r} has no chunk list")
    numbers = list(size)
    for chunk in chunks:
        if (type(chunk) is not ChunkMetadata or type(chunk.offsets) is not tuple
                or type(chunk.sizes) is not tuple or len(chunk.offsets) != rank
                or len(chunk.sizes) != rank):
            raise fail(f"tensor {fqn!r} has a chunk that is not {rank}-d offsets and sizes")
        numbers += chunk.offsets
        numbers += chunk.sizes
    if numbers and (not set(map(type, numbers)) <= _INT_TYPE_SET or min(numbers) < 0):
        raise fail(f"tensor {fqn!r} has a size, offset or chunk size that is not a "
                   "non-negative integer")
    for chunk in chunks:
        if any(map(operator.gt, map(operator.add, chunk.offsets, chunk.sizes), size)):
            raise fail(f"tensor {fqn!r}: chunk at {list(chunk.offsets)} of size "
                       f"{list(chunk.sizes)} lies outside the tensor's size {list(size)}")


def _check_storage_entry(key: Any, info: Any, entries: dict, fail) -> None:
    if not isinstance(key, ItemKey) or not isinstance(key.fqn, str):
        raise fail(f"storage_data key {key!r} is not a MetadataIndex")
    if key.fqn not in entries:
        raise fail(f"storage_data names {key.fqn!r}, which state_dict_metadata lacks")
    if not isinstance(info, StorageInfo):
        raise fail(f"storage_data for {key.fqn!r} is a {type(info).__name__}, not _StorageInfo")
    if not isinstance(info.relative_path, str) or not info.relative_path:
        raise fail(f"storage_data for {key.fqn!r} has no file name")
    if type(info.offset) is not int or type(info.length) is not int or min(
            info.offset, info.length) < 0:
        raise fail(f"storage_data for {key.fqn!r} has byte range "
                   f"offset={info.offset!r} length={info.length!r}, not two non-negative integers")
    descriptors = info.transform_descriptors
    if descriptors is not None:
        if not isinstance(descriptors, (list, tuple)) or not all(
                isinstance(name, str) for name in descriptors):
            raise fail(f"storage_data for {key.fqn!r} has transforms {descriptors!r}, "
                       "not a list of names")
        info.transform_descriptors = tuple(descriptors) or None


def read_metadata(checkpoint_dir: str | os.PathLike) -> CheckpointMetadata:
    """Read and check `checkpoint_dir/.metadata` without importing torch."""
    path = Path(checkpoint_dir) / METADATA_FILE_NAME
    try:
        data = path.read_bytes()
    except OSError as error:
        raise MetadataError(f"{path}: cannot read ({error.strerror})") from None
    return parse_metadata(data, str(path))


def serialize_metadata(metadata: CheckpointMetadata) -> bytes:
    """`.metadata` bytes that torch's DCP reads as this metadata (torch is not imported)."""
    from dcpctl.format.torch_pickle import pickle_as_torch  # only writers need it

    return pickle_as_torch(metadata)

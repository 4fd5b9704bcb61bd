"""Plain records for what a DCP `.metadata` holds, mirroring torch's classes field for field.

A `.metadata` can hold millions of chunks, each with a storage key and a storage entry. Their
records (ChunkMetadata, MetadataIndex, StorageInfo) keep their fields in slots, not a dict of
their own, and are unpickled by a `__setstate__` that takes the fields from the dict the pickle
built. The unpickler keeps that dict until the whole file is read, so a dict of the record's
own besides it would add to the peak memory of every reader (1.93 against 1.63 GiB at a million
chunks). That dict is left as the pickle built it: a pickle may refer to it again. A record
given fields torch's class does not have is refused, since a rewrite would drop them. Between
dcpctl's own processes these records travel as calls of their constructors.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from dcpctl.errors import MetadataError
from dcpctl.format.dtypes import DType


def _fields_refused(torch_class: str, fields: frozenset[str]) -> MetadataError:
    return MetadataError(f"holds a {torch_class} whose pickled fields are not torch's "
                         f"{', '.join(sorted(fields))}")


TORCH_LAYOUTS = ("strided", "sparse_coo", "sparse_csr", "sparse_csc", "sparse_bsr", "sparse_bsc")
# torch's _MEM_FORMAT_ENCODING: contiguous, channels last, preserve
MEMORY_FORMAT_CODES = (0, 1, 2)


@dataclass
class TensorProperties:
    """torch's TensorProperties; only `dtype` matters, the rest is kept to write it back."""

    dtype: DType
    layout: str = "strided"
    requires_grad: bool = False
    memory_format_code: int = 0
    pin_memory: bool = False

    def __setstate__(self, state: tuple) -> None:
        try:
            (self.dtype, self.layout, self.requires_grad,
             self.memory_format_code, self.pin_memory) = state
        except (TypeError, ValueError):
            raise _properties_refused() from None
        if (type(self.dtype) is not DType or self.layout not in TORCH_LAYOUTS
                or type(self.requires_grad) is not bool or type(self.pin_memory) is not bool
                or self.memory_format_code not in MEMORY_FORMAT_CODES
                or type(self.memory_format_code) is not int):
            raise _properties_refused()


def _properties_refused() -> MetadataError:
    return MetadataError("holds a TensorProperties whose pickled state is not torch's (dtype, "
                         "layout, requires_grad, memory format 0-2, pin_memory)")


@dataclass(slots=True)
class ChunkMetadata:
    """One stored chunk of a tensor: where it starts in the full tensor and how big it is.

    `storage` is not part of the pickle: opening a checkpoint joins it from storage_data.
    """

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    storage: StorageInfo | None = field(default=None, compare=False, repr=False)

    def __setstate__(self, state: dict) -> None:
        try:
            self.offsets, self.sizes, self.storage = state["offsets"], state["sizes"], None
        except (KeyError, TypeError):
            raise _fields_refused("ChunkStorageMetadata", _CHUNK_FIELDS) from None
        if len(state) != 2:
            raise _fields_refused("ChunkStorageMetadata", _CHUNK_FIELDS)

    def __reduce__(self) -> tuple:
        return ChunkMetadata, (self.offsets, self.sizes, self.storage)


_CHUNK_FIELDS = frozenset({"offsets", "sizes"})


@dataclass
class TensorMetadata:
    """A tensor entry: dtype, full size and the chunks that make it up."""

    properties: TensorProperties
    size: tuple[int, ...]
    chunks: list[ChunkMetadata]


@dataclass
class BytesMetadata:
    """A non-tensor entry, stored as one opaque item."""


@dataclass(unsafe_hash=True, slots=True)
class MetadataIndex:
    """torch's MetadataIndex: an fqn, plus a chunk's offsets for tensor items."""

    fqn: str
    offset: tuple[int, ...] | None = None
    index: int | None = field(default=None, compare=False, hash=False)

    def __setstate__(self, state: dict) -> None:
        try:  # torch pickles all three fields: told apart from any other state with no set
            self.fqn, self.offset, self.index = state["fqn"], state["offset"], state["index"]
            if len(state) == 3:
                return
        except (KeyError, TypeError):
            pass
        try:
            self.fqn, self.offset, self.index = (state["fqn"], state.get("offset"),
                                                 state.get("index"))
        except (KeyError, TypeError, AttributeError):
            raise _fields_refused("MetadataIndex", _INDEX_FIELDS) from None
        if len(state) > 3 or not state.keys() <= _INDEX_FIELDS:
            raise _fields_refused("MetadataIndex", _INDEX_FIELDS)

    def __reduce__(self) -> tuple:
        return MetadataIndex, (self.fqn, self.offset, self.index)


_INDEX_FIELDS = frozenset({"fqn", "offset", "index"})


@dataclass(slots=True)
class StorageInfo:
    """Where one item's bytes live: file, byte range and the transforms to decode them."""

    relative_path: str
    offset: int
    length: int
    transform_descriptors: tuple[str, ...] | None = None

    def __setstate__(self, state: dict) -> None:
        try:  # torch's _StorageInfo pickles only the fields that are not None
            self.relative_path, self.offset, self.length, self.transform_descriptors = (
                state["relative_path"], state["offset"], state["length"],
                state.get("transform_descriptors"))
        except (KeyError, TypeError, AttributeError):
            raise _fields_refused("_StorageInfo", _STORAGE_INFO_FIELDS) from None
        if len(state) > 3 and (len(state) > 4 or not state.keys() <= _STORAGE_INFO_FIELDS):
            raise _fields_refused("_StorageInfo", _STORAGE_INFO_FIELDS)

    def __reduce__(self) -> tuple:
        return StorageInfo, (self.relative_path, self.offset, self.length,
                             self.transform_descriptors)


_STORAGE_INFO_FIELDS = frozenset({"relative_path", "offset", "length", "transform_descriptors"})


@dataclass
class StorageMeta:
    """torch's StorageMeta: ids of the save that wrote the checkpoint. Fields an older torch
    did not write yet (`modules`) take the defaults torch's class gives them."""

    checkpoint_id: Any = None
    save_id: str | None = None
    load_id: str | None = None
    modules: list[str] = field(default_factory=list)

    def __setstate__(self, state: dict) -> None:
        if type(state) is not dict or not state.keys() <= _STORAGE_META_FIELDS:
            raise _fields_refused("StorageMeta", _STORAGE_META_FIELDS)
        self.checkpoint_id, self.save_id, self.load_id, self.modules = (
            state.get("checkpoint_id"), state.get("save_id"), state.get("load_id"),
            state.get("modules", []))


_STORAGE_META_FIELDS = frozenset({"checkpoint_id", "save_id", "load_id", "modules"})


@dataclass
class CheckpointMetadata:
    """Everything `.metadata` holds; planner_data, storage_meta and version ride along."""

    state_dict_metadata: dict[str, TensorMetadata | BytesMetadata]
    planner_data: Any = None
    storage_data: dict[MetadataIndex, StorageInfo] | None = None
    storage_meta: StorageMeta | None = None
    version: str | None = None
    mcore_data: dict | None = None
    """Megatron-Core's data about each tensor (0.14 and 0.15 add it to torch's Metadata; its
    loader needs it for the tensors it flattened): plain data, written back as it came. (The
    save plans Megatron also keeps there, `all_local_plans`, describe the layout of the save
    that wrote them: reading drops them, so no rewrite carries a stale plan.)"""

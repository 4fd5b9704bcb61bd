"""Plain records for what a DCP `.metadata` holds, mirroring torch's classes field for field."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from dcpctl.format.dtypes import DType


@dataclass
class TensorProperties:
    """torch's TensorProperties; only `dtype` matters, the rest is kept to write it back."""

    dtype: DType
    layout: str = "strided"
    requires_grad: bool = False
    memory_format_code: int = 0
    pin_memory: bool = False

    def __setstate__(self, state: tuple) -> None:
        (self.dtype, self.layout, self.requires_grad,
         self.memory_format_code, self.pin_memory) = state


@dataclass
class ChunkMetadata:
    """One stored chunk of a tensor: where it starts in the full tensor and how big it is.

    `storage` is not part of the pickle: opening a checkpoint joins it from storage_data.
    """

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    storage: StorageInfo | None = field(default=None, compare=False, repr=False)


@dataclass
class TensorMetadata:
    """A tensor entry: dtype, full size and the chunks that make it up."""

    properties: TensorProperties
    size: tuple[int, ...]
    chunks: list[ChunkMetadata]


@dataclass
class BytesMetadata:
    """A non-tensor entry, stored as one opaque item."""


@dataclass(unsafe_hash=True)
class MetadataIndex:
    """torch's MetadataIndex: an fqn, plus a chunk's offsets for tensor items."""

    fqn: str
    offset: tuple[int, ...] | None = None
    index: int | None = field(default=None, compare=False, hash=False)


@dataclass
class StorageInfo:
    """Where one item's bytes live: file, byte range and the transforms to decode them."""

    relative_path: str
    offset: int
    length: int
    transform_descriptors: tuple[str, ...] | None = None


@dataclass
class StorageMeta:
    """torch's StorageMeta: ids of the save that wrote the checkpoint."""

    checkpoint_id: Any = None
    save_id: str | None = None
    load_id: str | None = None
    modules: list[str] = field(default_factory=list)


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

"""Where each item of a checkpoint is stored, how to decode it, and what it must hold."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from dcpctl.errors import DataError, DcpctlError, UnsupportedLayoutError
from dcpctl.format.checkpoint.view import SAFETENSORS, Checkpoint, ObjectEntry, TensorEntry
from dcpctl.format.codecs.registry import IDENTITY, Codec, codec_for_descriptors
from dcpctl.format.dtypes import DType
from dcpctl.format.metadata.records import ChunkMetadata, StorageInfo
from dcpctl.format.safetensors import safetensors_tensor_range
from dcpctl.format.torch_save.layout import max_tensor_archive_bytes


@dataclass(slots=True)
class ExpectedTensor:
    """What a tensor item must hold: a tensor of its chunk's dtype and sizes."""

    dtype: DType
    sizes: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        """Bytes of the chunk's elements."""
        return math.prod(self.sizes) * self.dtype.itemsize


@dataclass(slots=True)
class ItemLocation:
    """Where an item's stored bytes are, how to decode them, what a tensor item must hold
    (expected; None for an object), whether they are the tensor's bare bytes (raw: in a
    SAFETENSORS-serialized file) rather than a torch.save archive, and the most bytes they may
    decode to (None: no bound known, as for objects)."""

    fqn: str
    path: Path
    start: int
    length: int
    codec: Codec
    expected: ExpectedTensor | None = None
    max_decoded_bytes: int | None = None
    raw: bool = False

    @property
    def end(self) -> int:
        """Offset one past the item's last stored byte in its file."""
        return self.start + self.length

    @property
    def place(self) -> dict:
        """Where the item lies, as DcpctlError and its `located` take it."""
        return dict(path=self.path, fqn=self.fqn, start=self.start, end=self.end)

    def __hash__(self) -> int:
        # Where the bytes lie tells items apart; equal locations lie in the same place. A
        # location is a key of every read of a reshard or convert, and the hash dataclass
        # would make hashes its codec and expected tensor too, each a call of its own.
        return hash((self.path, self.start, self.length))


def locate_item(checkpoint: Checkpoint, fqn: str, storage: StorageInfo,
                expected: ExpectedTensor | None = None) -> ItemLocation:
    """The byte range and codec of one item: a tensor chunk that must hold `expected`, or
    (None) an object. In SAFETENSORS-serialized files, tensor items live inside one
    safetensors blob per file and are found through its header."""
    path = checkpoint.data_path(storage.relative_path)
    is_tensor = expected is not None
    if checkpoint.files[storage.relative_path].serialization == SAFETENSORS and is_tensor:
        if storage.transform_descriptors:
            raise UnsupportedLayoutError(
                f"combines SAFETENSORS serialization with transforms "
                f"{list(storage.transform_descriptors)}, which torch cannot read back either",
                path=path, fqn=fqn)
        start, length = safetensors_tensor_range(path, storage.offset, fqn)
        return ItemLocation(fqn, path, start, length, IDENTITY, expected, raw=True)
    try:
        codec = codec_for_descriptors(storage.transform_descriptors)
    except DcpctlError as error:
        raise error.located(path=path, fqn=fqn) from None
    bound = (max_tensor_archive_bytes(expected.nbytes) if is_tensor and codec.descriptors
             else None)
    return ItemLocation(fqn, path, storage.offset, storage.length, codec, expected, bound)


def locate_chunk(checkpoint: Checkpoint, tensor: TensorEntry, chunk: ChunkMetadata
                 ) -> ItemLocation:
    """Where a tensor chunk is stored; raises DataError if the metadata gives it no storage."""
    if chunk.storage is None:
        raise DataError(f"chunk at {list(chunk.offsets)} has no storage entry in the metadata",
                        path=checkpoint.path, fqn=tensor.fqn)
    return locate_item(checkpoint, tensor.fqn, chunk.storage,
                       ExpectedTensor(tensor.dtype, tuple(chunk.sizes)))


def locate_object(checkpoint: Checkpoint, entry: ObjectEntry) -> ItemLocation:
    """Where a non-tensor entry is stored; raises DataError if the metadata gives it none."""
    if entry.storage is None:
        raise DataError("object has no storage entry in the metadata", path=checkpoint.path,
                        fqn=entry.fqn)
    return locate_item(checkpoint, entry.fqn, entry.storage)

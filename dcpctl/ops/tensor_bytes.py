"""A checkpoint tensor's full row-major bytes, assembled from its chunks one chunk at a time.

When the chunks are whole rows (the dim-0 sharding FSDP2 writes), each chunk is a contiguous
run of the full tensor and is handed on as soon as it is read, so memory holds a chunk, not the
tensor. Other layouts (a 2-D mesh's Shard(1)) are assembled in one buffer of the full tensor.
"""

from __future__ import annotations

import io
import math
from typing import Iterator

import torch

from dcpctl.errors import DataError
from dcpctl.format.checkpoint import SAFETENSORS, Checkpoint, TensorEntry
from dcpctl.format.dtypes import DType
from dcpctl.format.items import locate_item, read_item
from dcpctl.format.records import ChunkMetadata


def torch_dtype(dtype: DType) -> torch.dtype:
    """The torch dtype dcpctl's DType names."""
    return getattr(torch, dtype.name)


def read_chunk(checkpoint: Checkpoint, tensor: TensorEntry, chunk: ChunkMetadata) -> torch.Tensor:
    """One stored chunk's values, shaped chunk.sizes."""
    if chunk.storage is None:
        raise DataError(f"{checkpoint.path}: tensor {tensor.fqn!r} has a chunk at "
                        f"{list(chunk.offsets)} with no storage entry in the metadata")
    location = locate_item(checkpoint, tensor.fqn, chunk.storage, is_tensor=True)
    payload = read_item(location)
    dtype = torch_dtype(tensor.dtype)
    if checkpoint.files[chunk.storage.relative_path].serialization == SAFETENSORS:
        values = torch.frombuffer(bytearray(payload), dtype=dtype) if payload else \
            torch.empty(0, dtype=dtype)
        return values.reshape(chunk.sizes)
    where = f"{location.path}: item {tensor.fqn!r} at {list(chunk.offsets)}"
    try:
        values = torch.load(io.BytesIO(payload), weights_only=True)
    except Exception as error:  # a damaged archive fails in many ways; all mean the same
        raise DataError(f"{where} is not a readable torch.save archive ({error})") from None
    if (not isinstance(values, torch.Tensor) or values.dtype != dtype
            or tuple(values.shape) != tuple(chunk.sizes)):
        raise DataError(f"{where} does not hold a {dtype} tensor of shape {list(chunk.sizes)}")
    return values


def _bytes_of(values: torch.Tensor) -> memoryview:
    """A tensor's row-major bytes, without a copy when it is contiguous."""
    flat = values.detach().contiguous().reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy()) if flat.numel() else memoryview(b"")


def iter_tensor_bytes(checkpoint: Checkpoint, tensor: TensorEntry,
                      dtype: DType | None = None) -> Iterator[memoryview]:
    """The full tensor's row-major bytes in order, cast to dtype if given, in pieces."""
    target = torch_dtype(dtype or tensor.dtype)
    if math.prod(tensor.shape) == 0:
        return
    chunks = [chunk for chunk in tensor.chunks if math.prod(chunk.sizes)]
    covered = sum(math.prod(chunk.sizes) for chunk in chunks)
    if covered != math.prod(tensor.shape):
        raise DataError(f"{checkpoint.path}: the chunks of tensor {tensor.fqn!r} hold {covered} "
                        f"of its {math.prod(tensor.shape)} elements")
    if _are_row_blocks(tensor.shape, chunks):
        for chunk in sorted(chunks, key=lambda chunk: chunk.offsets[:1]):
            yield _bytes_of(read_chunk(checkpoint, tensor, chunk).to(target))
        return
    full = torch.empty(tensor.shape, dtype=target)
    for chunk in chunks:
        region = tuple(slice(offset, offset + size)
                       for offset, size in zip(chunk.offsets, chunk.sizes))
        full[region] = read_chunk(checkpoint, tensor, chunk)
    yield _bytes_of(full)


def _are_row_blocks(shape: tuple[int, ...], chunks: list[ChunkMetadata]) -> bool:
    """Whether the chunks are whole rows that tile dim 0 in order, without gap or overlap."""
    if not shape:
        return True
    rows = sorted((chunk.offsets[0], chunk.sizes[0]) for chunk in chunks
                  if tuple(chunk.sizes[1:]) == tuple(shape[1:]))
    next_row = 0
    for start, count in rows:
        if start != next_row:
            return False
        next_row += count
    return len(rows) == len(chunks) and next_row == shape[0]

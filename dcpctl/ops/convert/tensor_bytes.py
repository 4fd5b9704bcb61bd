"""A checkpoint tensor's full row-major bytes, assembled from its chunks one chunk at a time.

A chunk's bytes are read straight from its item: the torch.save archive's layout (format/
torch_save.py, found from the archive's ends without reading the data) says where the payload
lies, so nothing is unpickled by torch. When the chunks are whole rows (the dim-0 sharding
FSDP2 writes), each chunk is a contiguous run of the full tensor and is handed on as soon as it
is read, so memory holds a chunk, not the tensor. Other layouts (a 2-D mesh's Shard(1)) are
assembled in one buffer of the full tensor. torch is imported only to cast between dtypes (or
to lay out a strided view someone saved), so a plain conversion never pays for importing it.
"""

from __future__ import annotations

import io
import math
from typing import TYPE_CHECKING, Iterator

import numpy

from dcpctl.errors import DataError
from dcpctl.format.checkpoint.view import SAFETENSORS, Checkpoint, TensorEntry
from dcpctl.format.dtypes import DType
from dcpctl.format.checkpoint.items import ItemLocation, locate_item, read_item
from dcpctl.format.metadata.records import ChunkMetadata
from dcpctl.format.torch_save.layout import max_tensor_archive_bytes, read_torch_save_layout

if TYPE_CHECKING:
    import torch


def torch_dtype(dtype: DType) -> torch.dtype:
    """The torch dtype dcpctl's DType names."""
    import torch

    return getattr(torch, dtype.name)


def read_chunk_bytes(checkpoint: Checkpoint, tensor: TensorEntry,
                     chunk: ChunkMetadata) -> bytearray:
    """One stored chunk's raw row-major bytes."""
    if chunk.storage is None:
        raise DataError(f"{checkpoint.path}: tensor {tensor.fqn!r} has a chunk at "
                        f"{list(chunk.offsets)} with no storage entry in the metadata")
    location = locate_item(checkpoint, tensor.fqn, chunk.storage, is_tensor=True)
    expected_bytes = math.prod(chunk.sizes) * tensor.dtype.itemsize
    if checkpoint.files[chunk.storage.relative_path].serialization == SAFETENSORS:
        data = _read_file_range(location, 0, location.length)
    else:
        data = _read_payload(location, tensor, chunk, expected_bytes)
    if len(data) != expected_bytes:
        raise DataError(f"{location.path}: item {tensor.fqn!r} at {list(chunk.offsets)} holds "
                        f"{len(data)} bytes of tensor data, its shape needs {expected_bytes}")
    return data


def _read_payload(location: ItemLocation, tensor: TensorEntry, chunk: ChunkMetadata,
                  expected_bytes: int) -> bytearray:
    """The tensor bytes of a torch.save item; an item under a codec is decoded whole first
    (refused past what a chunk of expected_bytes can hold)."""
    archive = read_item(location, max_tensor_archive_bytes(expected_bytes)) \
        if location.codec.descriptors else None
    if archive is not None:
        def read_range(start: int, length: int) -> bytes:
            return archive[start:start + length]
    else:
        def read_range(start: int, length: int) -> bytes:
            return bytes(_read_file_range(location, start, length))
    where = f"{location.path}: item {tensor.fqn!r} at {list(chunk.offsets)}"
    try:
        layout = read_torch_save_layout(read_range, len(archive) if archive else location.length)
    except DataError as error:
        raise DataError(f"{where}: {error}") from None
    saved = layout.tensor
    if saved.dtype != tensor.dtype or saved.shape != tuple(chunk.sizes):
        raise DataError(f"{where} holds a {saved.dtype.name} tensor of shape {list(saved.shape)}, "
                        f"the metadata says {tensor.dtype.name} {list(chunk.sizes)}")
    if not saved.is_contiguous:  # a strided view: let torch lay it out
        import torch

        values = torch.load(io.BytesIO(archive or read_item(location)), weights_only=True)
        return bytes_of(values)
    if archive is not None:
        return bytearray(archive[layout.payload_offset:layout.payload_offset + saved.nbytes])
    return _read_file_range(location, layout.payload_offset, saved.nbytes)


def _read_file_range(location: ItemLocation, start: int, length: int) -> bytearray:
    """Bytes [start, start + length) of a plain item, in a writable buffer."""
    buffer = bytearray(length)
    with open(location.path, "rb", buffering=0) as stream:
        stream.seek(location.start + start)
        if stream.readinto(buffer) != length:
            raise DataError(f"{location.path}: truncated inside item {location.fqn!r}")
    return buffer


def bytes_of(values: torch.Tensor) -> bytearray | memoryview:
    """A tensor's row-major bytes, without a copy when it is contiguous."""
    import torch

    flat = values.detach().contiguous().reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy()) if flat.numel() else bytearray()


def _cast(data: bytearray | memoryview, source: DType, target: DType) -> memoryview:
    """Row-major bytes of source-dtype elements as target-dtype elements."""
    import torch

    return bytes_of(torch.frombuffer(data, dtype=torch_dtype(source)).to(torch_dtype(target)))


def iter_tensor_bytes(checkpoint: Checkpoint, tensor: TensorEntry,
                      dtype: DType | None = None) -> Iterator[bytearray | memoryview]:
    """The full tensor's row-major bytes in order, cast to dtype if given, in pieces."""
    target = dtype or tensor.dtype
    if math.prod(tensor.shape) == 0:
        return
    chunks = [chunk for chunk in tensor.chunks if math.prod(chunk.sizes)]
    covered = sum(math.prod(chunk.sizes) for chunk in chunks)
    if covered != math.prod(tensor.shape):
        raise DataError(f"{checkpoint.path}: the chunks of tensor {tensor.fqn!r} hold {covered} "
                        f"of its {math.prod(tensor.shape)} elements")
    if _are_row_blocks(tensor.shape, chunks):
        pieces = (read_chunk_bytes(checkpoint, tensor, chunk)
                  for chunk in sorted(chunks, key=lambda chunk: chunk.offsets[:1]))
    else:
        pieces = iter([_assemble(checkpoint, tensor, chunks)])
    for data in pieces:
        yield data if target == tensor.dtype else _cast(data, tensor.dtype, target)


def _assemble(checkpoint: Checkpoint, tensor: TensorEntry,
              chunks: list[ChunkMetadata]) -> memoryview:
    """The whole tensor's bytes, each chunk put at its region (as bytes: a trailing axis of
    the element size)."""
    itemsize = tensor.dtype.itemsize
    full = numpy.empty((*tensor.shape, itemsize), dtype=numpy.uint8)
    for chunk in chunks:
        region = tuple(slice(offset, offset + size)
                       for offset, size in zip(chunk.offsets, chunk.sizes))
        full[region] = numpy.frombuffer(read_chunk_bytes(checkpoint, tensor, chunk),
                                        dtype=numpy.uint8).reshape((*chunk.sizes, itemsize))
    return memoryview(full).cast("B")


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

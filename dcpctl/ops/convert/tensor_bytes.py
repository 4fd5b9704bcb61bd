"""A checkpoint tensor's full row-major bytes, assembled from its chunks one chunk at a time.

Each chunk's bytes come from the one reader of chunk payloads (format/checkpoint/payloads.py),
so whatever reshard reads, convert reads too, and nothing is unpickled by torch. When the chunks
are whole rows (the dim-0 sharding FSDP2 writes), each chunk is a contiguous run of the full
tensor and is handed on as soon as it is read, so memory holds a chunk, not the tensor. Other
layouts (a 2-D mesh's Shard(1)) are assembled in one buffer of the full tensor. torch is
imported only to cast between dtypes, so a plain conversion never pays for importing it.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Iterator

import numpy

from dcpctl.errors import DataError
from dcpctl.format.checkpoint.locations import locate_chunk
from dcpctl.format.checkpoint.payloads import BytesWithCrc, PayloadReader
from dcpctl.format.checkpoint.view import Checkpoint, TensorEntry
from dcpctl.format.dtypes import DType
from dcpctl.format.metadata.records import ChunkMetadata

if TYPE_CHECKING:
    import torch


def torch_dtype(dtype: DType) -> torch.dtype:
    """The torch dtype dcpctl's DType names."""
    import torch

    return getattr(torch, dtype.name)


def read_chunk_bytes(payloads: PayloadReader, checkpoint: Checkpoint, tensor: TensorEntry,
                     chunk: ChunkMetadata) -> BytesWithCrc:
    """One stored chunk's raw row-major bytes, with their CRC-32 where reading worked it out."""
    return payloads.read_chunk(locate_chunk(checkpoint, tensor, chunk))


def bytes_of(values: torch.Tensor) -> bytearray | memoryview:
    """A tensor's row-major bytes, without a copy when it is contiguous."""
    import torch

    flat = values.detach().contiguous().reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy()) if flat.numel() else bytearray()


def _cast(data: bytearray | memoryview, source: DType, target: DType) -> memoryview:
    """Row-major bytes of source-dtype elements as target-dtype elements, the same bytes for
    the same elements however the tensor is split into pieces."""
    import torch

    values = torch.frombuffer(data, dtype=torch_dtype(source))
    cast = values.to(torch_dtype(target))
    if str(values.dtype) in _IEEE_FLOATS and str(cast.dtype) in _IEEE_FLOATS:
        _cast_nans_as_full_vectors(values, cast)
    return bytes_of(cast)


_IEEE_FLOATS = {"torch.float16", "torch.bfloat16", "torch.float32", "torch.float64"}
_FULL_VECTORS = 16384
"""Elements cast at a time where NaNs are: a multiple of every vector width, and under
torch's parallel grain (32,768), so one thread's vector loop casts them all, with no tail."""


def _cast_nans_as_full_vectors(values, cast) -> None:
    """Where values holds a NaN, cast it all again in blocks of full vectors. For some pairs
    of dtypes (float16 to float32, float64 to bfloat16) torch's vector loop and its loop over
    a tail give a NaN different bits, so a cast's bits followed where each NaN fell in the
    piece cast: one checkpoint gave two outputs, as its chunks were laid out. Other values
    cast alike in both loops. The test for a NaN is a sum (no mask of the piece), which an
    infinity of each sign also makes NaN: those pieces take the blocks too, to the same
    bits."""
    import torch

    if not bool(values.sum().isnan()):
        return
    tail = torch.zeros(_FULL_VECTORS, dtype=values.dtype)
    for start in range(0, len(values), _FULL_VECTORS):
        block = values[start:start + _FULL_VECTORS]
        if len(block) < _FULL_VECTORS:  # padded to full vectors
            tail[:len(block)] = block
            block = tail
        cast[start:start + len(block)] = block.to(cast.dtype)[:len(cast) - start]


def largest_piece_bytes(tensor: TensorEntry, dtype: DType | None = None) -> int:
    """The most bytes iter_tensor_bytes(..., tensor, dtype) gives in one piece: the largest
    chunk of a tensor split by rows, else the whole tensor (at the larger of the two dtypes'
    sizes: a cast holds both)."""
    chunks = [chunk for chunk in tensor.chunks if math.prod(chunk.sizes)]
    if not chunks:
        return 0
    itemsize = max(tensor.dtype.itemsize, (dtype or tensor.dtype).itemsize)
    if _are_row_blocks(tensor.shape, chunks):
        return max(math.prod(chunk.sizes) for chunk in chunks) * itemsize
    return math.prod(tensor.shape) * itemsize


def iter_tensor_bytes(payloads: PayloadReader, checkpoint: Checkpoint, tensor: TensorEntry,
                      dtype: DType | None = None) -> Iterator[BytesWithCrc]:
    """The full tensor's row-major bytes in order, cast to dtype if given, in pieces, each
    with its CRC-32 where it is a chunk read as stored (a CRC-32 its reading worked out)."""
    target = dtype or tensor.dtype
    if math.prod(tensor.shape) == 0:
        return
    chunks = [chunk for chunk in tensor.chunks if math.prod(chunk.sizes)]
    covered = sum(math.prod(chunk.sizes) for chunk in chunks)
    if covered != math.prod(tensor.shape):
        raise DataError(f"the chunks of tensor {tensor.fqn!r} hold {covered} of its "
                        f"{math.prod(tensor.shape)} elements", path=checkpoint.path)
    if _are_row_blocks(tensor.shape, chunks):
        pieces = (read_chunk_bytes(payloads, checkpoint, tensor, chunk)
                  for chunk in sorted(chunks, key=lambda chunk: chunk.offsets[:1]))
    else:
        pieces = iter([BytesWithCrc(_assemble(payloads, checkpoint, tensor, chunks))])
    for piece in pieces:
        yield piece if target == tensor.dtype else BytesWithCrc(
            _cast(piece.data, tensor.dtype, target))


def _assemble(payloads: PayloadReader, checkpoint: Checkpoint, tensor: TensorEntry,
              chunks: list[ChunkMetadata]) -> memoryview:
    """The whole tensor's bytes, each chunk put at its region (as bytes: a trailing axis of
    the element size)."""
    itemsize = tensor.dtype.itemsize
    full = numpy.empty((*tensor.shape, itemsize), dtype=numpy.uint8)
    for chunk in chunks:
        region = tuple(slice(offset, offset + size)
                       for offset, size in zip(chunk.offsets, chunk.sizes))
        full[region] = numpy.frombuffer(
            read_chunk_bytes(payloads, checkpoint, tensor, chunk).data,
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

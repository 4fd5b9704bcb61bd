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
    """Row-major bytes of source-dtype elements as target-dtype elements, as torch casts them
    but for a NaN, which becomes the target's quiet NaN of its sign: the bits torch gives a
    NaN depend on where it falls in what it casts (its vector loop against its tail loop) and
    on the machine's vector instructions, so one tensor split differently, or cast on another
    machine, came out with other bits."""
    import torch

    values = torch.frombuffer(data, dtype=torch_dtype(source))
    cast = values.to(torch_dtype(target))
    quiet_nan = _QUIET_NANS.get(str(cast.dtype))
    if quiet_nan is not None and str(values.dtype) in _QUIET_NANS:
        _make_nans_quiet(values, cast, *quiet_nan)
    return bytes_of(cast)


_QUIET_NANS = {"torch.float16": ("int16", 0x7E00), "torch.bfloat16": ("int16", 0x7FC0),
               "torch.float32": ("int32", 0x7FC00000), "torch.float64": ("int64", 0x7FF8 << 48)}
"""Each IEEE float dtype's bits seen as a signed integer, and its positive quiet NaN."""
_BLOCK_ELEMENTS = 1 << 20  # the NaN masks of a block at a time


def _make_nans_quiet(values, cast, integer: str, quiet_nan: int) -> None:
    """Set each element of cast whose value is a NaN to the quiet NaN of the value's sign. A
    piece is looked into only where its sum is NaN (no mask of a piece without NaN; an
    infinity of each sign makes it NaN too)."""
    import torch

    if not bool(values.sum().isnan()):
        return
    bits = cast.view(getattr(torch, integer))
    sign = -1 << (bits.element_size() * 8 - 1)  # the sign bit, as a signed integer
    for start in range(0, len(values), _BLOCK_ELEMENTS):
        block = values[start:start + _BLOCK_ELEMENTS]
        nans = block.isnan()
        if bool(nans.any()):
            negative = torch.signbit(block[nans])
            bits[start:start + len(block)][nans] = torch.where(
                negative, torch.tensor(quiet_nan | sign, dtype=bits.dtype),
                torch.tensor(quiet_nan, dtype=bits.dtype))


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

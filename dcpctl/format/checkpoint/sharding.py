"""Where a real N-rank FSDP2 save puts each tensor's rows: `Shard(0)` with torch.chunk semantics."""

from __future__ import annotations

from dataclasses import dataclass

from dcpctl.errors import InvalidOptionError


@dataclass(frozen=True)
class RankChunk:
    """The chunk of a tensor that one rank holds: its rank, offsets and sizes."""

    rank: int
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]


MAX_WORLD_SIZE = 1 << 20
"""The most ranks a checkpoint is laid out for: far past any job, short of a runaway."""


def check_world_size(world_size: int) -> None:
    """Refuse a world size that no job can have."""
    if not 1 <= world_size <= MAX_WORLD_SIZE:
        raise InvalidOptionError(f"--ranks must be from 1 to {MAX_WORLD_SIZE}, not "
                                 f"{world_size}")


def shard_dim0_chunks(shape: tuple[int, ...], world_size: int) -> list[RankChunk]:
    """The chunks an FSDP2 (`fully_shard`, 1-D mesh) save of world_size ranks writes for a
    tensor of this shape: ceil(rows / world_size) rows per rank, later ranks smaller or empty.
    An empty chunk starts at the end of dim 0; ranks whose chunks are equal (several empty ones)
    share one entry, as DCP deduplicates them, given here to the lowest of those ranks (torch
    gives it to the rank with the least data planned so far). A 0-d tensor is not sharded:
    rank 0 holds it."""
    check_world_size(world_size)
    if not shape:
        return [RankChunk(0, (), ())]
    rows, rest = shape[0], tuple(shape[1:])
    rows_per_rank = -(-rows // world_size) if rows else 0
    ranks_with_rows = -(-rows // rows_per_rank) if rows else 0
    zeros = (0,) * len(rest)
    chunks = [RankChunk(rank, (rank * rows_per_rank,) + zeros,
                        (min(rows_per_rank, rows - rank * rows_per_rank),) + rest)
              for rank in range(ranks_with_rows)]
    if ranks_with_rows < world_size:  # every later rank holds the same empty chunk
        chunks.append(RankChunk(ranks_with_rows, (rows,) + zeros, (0,) + rest))
    return chunks

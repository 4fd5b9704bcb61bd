"""Where a real N-rank FSDP2 save puts each tensor's rows (`Shard(0)` with torch.chunk
semantics), and which rank's file each item lands in once DCP has deduplicated what several
ranks hold (replicated tensors and objects, shared empty chunks)."""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Sequence

from dcpctl.errors import InvalidOptionError


@dataclass(slots=True)
class RankChunk:
    """A chunk of a tensor as a save writes it: its offsets and sizes, and the ranks whose save
    plans hold this very chunk (ascending; several where ranks hold equal chunks: a replicated
    tensor, or the empty chunk of the ranks past a tensor's rows), which DCP saves once
    (place_like_a_save says on which)."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    holders: Sequence[int]


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
    share one entry, as DCP deduplicates them (its holders are those ranks). A 0-d tensor is
    not sharded: one chunk that every rank holds."""
    check_world_size(world_size)
    if not shape:
        return [RankChunk((), (), range(world_size))]
    rows, rest = shape[0], tuple(shape[1:])
    rows_per_rank = -(-rows // world_size) if rows else 0
    ranks_with_rows = -(-rows // rows_per_rank) if rows else 0
    zeros = (0,) * len(rest)
    full_sizes = (rows_per_rank,) + rest
    chunks = [RankChunk((rank * rows_per_rank,) + zeros, full_sizes, range(rank, rank + 1))
              for rank in range(ranks_with_rows - 1)]
    if ranks_with_rows:  # the last rank with rows holds what is left
        last = ranks_with_rows - 1
        chunks.append(RankChunk((last * rows_per_rank,) + zeros,
                                (rows - last * rows_per_rank,) + rest, range(last, last + 1)))
    if ranks_with_rows < world_size:  # every later rank holds the same empty chunk
        chunks.append(RankChunk((rows,) + zeros, (0,) + rest,
                                range(ranks_with_rows, world_size)))
    return chunks


def place_like_a_save(items: Sequence[tuple[Sequence[int], int]], world_size: int) -> list[int]:
    """The rank whose file holds each item of a world_size-rank save. items: for each item of
    the state dict, in its order, the ranks whose save plans hold it and its size as torch
    counts it (the bytes of the whole tensor, even for one chunk of it; 0 for an object).

    This is torch's deduplication (dedup_save_plans, as DefaultSavePlanner runs it): the items
    are taken plan by plan (rank 0's, then those rank 1's adds, ...), each plan in state-dict
    order, and an item that several plans hold goes to the one with the fewest bytes planned
    so far, the lowest rank on a tie; an item of no bytes counts one. So a replicated tensor or
    object lands on the least loaded rank at its turn, not always on rank 0."""
    planned = [0] * world_size
    least_planned = [(0, rank) for rank in range(world_size)]  # a heap, one entry a rank
    placed = [0] * len(items)
    first_holders = [holders[0] for holders, _ in items]
    for index in sorted(range(len(items)), key=first_holders.__getitem__):  # a stable sort
        holders, size = items[index]
        rank = holders[0] if len(holders) == 1 else _least_planned(least_planned, planned,
                                                                   holders)
        placed[index] = rank
        planned[rank] += size or 1
    return placed


def _least_planned(heap: list[tuple[int, int]], planned: list[int], holders: Sequence[int]
                   ) -> int:
    """The holder with the fewest bytes planned (the lowest on a tie). The heap holds one entry
    a rank, whose key may lag behind what has been planned since (it only grows): a lagging
    top is brought up to date and sunk; ranks outside holders are set aside and put back."""
    if not isinstance(holders, range):
        holders = frozenset(holders)
    set_aside = []
    while True:
        size, rank = heap[0]
        if size != planned[rank]:
            heapq.heapreplace(heap, (planned[rank], rank))
        elif rank in holders:
            break
        else:
            set_aside.append(heapq.heappop(heap))
    for entry in set_aside:
        heapq.heappush(heap, entry)
    return rank

"""Splitting a plan's lanes (output files, or files to read) into shares, one per worker."""

from __future__ import annotations

from typing import Sequence


def split_by_size(sizes: Sequence[int], count: int) -> list[list[int]]:
    """The indexes of sizes in `count` shares of neighbouring lanes, balanced by total size:
    lane i goes to the share its midpoint falls in when the lanes are laid end to end. Lanes
    stay with their neighbours because neighbours often read the same input (the rank files of
    a reshard that follow each other are cut from the same input chunks), so a worker reads
    what its lanes need once. A pure function, so every worker computes the same split."""
    shares: list[list[int]] = [[] for _ in range(count)]
    total = sum(sizes)
    before = 0
    for index, size in enumerate(sizes):
        if total:
            share = min(count - 1, (2 * before + size) * count // (2 * total))
        else:
            share = index * count // max(1, len(sizes))
        shares[share].append(index)
        before += size
    return shares

"""Splitting a plan's lanes (output files, or files to read) into shares, one per worker, and
dealing them out as the work goes: a worker that finishes its share early takes lanes not yet
claimed from the back of the others', so a slow worker (one that shares its cores, or a node
slower than the rest) does not hold the whole job back."""

from __future__ import annotations

from typing import Iterator, Protocol, Sequence

_BACK = 1 << 32
"""A share's claim counter counts the lanes taken from its front in its low 32 bits and those
taken from its back above them; one atomic add claims lanes and reads both counts."""


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


class ClaimCounters(Protocol):
    """One counter a share, starting at 0, shared by every worker of a job."""

    def add(self, share: int, amount: int) -> int:
        """Add amount to the share's counter, atomically among the workers; its new value."""


def claimed_lanes(sizes: Sequence[int], index: int, count: int, counters: ClaimCounters
                  ) -> Iterator[list[int]]:
    """The lanes worker `index` of `count` works on, a batch at a time, each lane claimed by
    exactly one worker. First its own share (split_by_size) from the front, half of what is
    left of it in each batch (so that its neighbouring lanes mostly stay together); then,
    one lane at a time, the last lane not yet claimed of the share with the most bytes left
    among those whose workers have begun. A share whose worker has not claimed a lane yet is
    left to it: that worker is still starting, and has the share planned."""
    shares = split_by_size(sizes, count)
    own = shares[index]
    left = len(own)
    while left > 0:
        wanted = max(1, left // 2)
        front, back = _claim(counters, index, wanted)
        batch = own[front - wanted:max(0, min(front, len(own) - back))]
        if batch:
            yield batch
        left = len(own) - front - back
    while (victim := _most_bytes_left(shares, sizes, counters)) is not None:
        front, back = _claim(counters, victim, _BACK)
        if front + back <= len(shares[victim]):  # else another worker took the last one
            yield [shares[victim][-back]]


def _claim(counters: ClaimCounters, share: int, amount: int) -> tuple[int, int]:
    """Add amount to a share's counter; the lanes claimed from its front and from its back."""
    value = counters.add(share, amount)
    return value % _BACK, value // _BACK


def _most_bytes_left(shares: list[list[int]], sizes: Sequence[int], counters: ClaimCounters
                     ) -> int | None:
    """Of the shares whose workers have begun, the one whose lanes not yet claimed hold the
    most bytes (None: there are none left)."""
    best, most = None, -1
    for share, lanes in enumerate(shares):
        front, back = _claim(counters, share, 0)
        if front == 0:  # not begun
            continue
        unclaimed = lanes[front:max(0, len(lanes) - back)]
        if unclaimed and sum(sizes[lane] for lane in unclaimed) > most:
            best, most = share, sum(sizes[lane] for lane in unclaimed)
    return best

"""Splitting lanes into shares (every lane in exactly one share, neighbours together, balanced)
and dealing them out (every lane claimed by exactly one worker, a slow one's left to others)."""

from __future__ import annotations

import random

import pytest

from dcpctl.execution.shares import claimed_lanes, split_by_size


@pytest.mark.parametrize("sizes, count", [([1] * 16, 2), ([1] * 16, 3), ([10, 1, 1, 1], 2),
                                          ([0, 0, 0], 2), ([5], 3), ([], 4),
                                          ([7, 3, 9, 1, 4, 4, 2], 3)])
def test_every_lane_goes_to_one_share_in_order(sizes, count):
    shares = split_by_size(sizes, count)
    assert len(shares) == count
    assert [lane for share in shares for lane in share] == list(range(len(sizes)))


def test_neighbours_stay_together_and_the_load_is_balanced():
    assert split_by_size([1] * 16, 2) == [list(range(8)), list(range(8, 16))]
    shares = split_by_size([3] * 12, 3)
    assert [sum(3 for _ in share) for share in shares] == [12, 12, 12]
    assert split_by_size([10, 1, 1, 1], 2) == [[0], [1, 2, 3]]  # no share can do better


class _Counters:
    """Claim counters of one process, with a hook run before each add (another worker's
    claims, interleaved)."""

    def __init__(self, count: int) -> None:
        self.values = [0] * count
        self.before_add = lambda: None

    def add(self, share: int, amount: int) -> int:
        self.before_add()
        self.values[share] += amount
        return self.values[share]


def test_a_worker_claims_its_own_share_in_halves_then_a_begun_share_from_the_back():
    counters = _Counters(2)
    sizes = [1] * 16
    # worker 1 has not begun: its share is left to it
    assert list(claimed_lanes(sizes, 0, 2, counters)) == [[0, 1, 2, 3], [4, 5], [6], [7]]
    counters.add(1, 1)  # worker 1 begins with lane 8
    assert list(claimed_lanes(sizes, 0, 2, counters)) == [
        [15], [14], [13], [12], [11], [10], [9]]


def test_the_share_with_the_most_bytes_left_is_taken_from_first():
    counters = _Counters(3)
    sizes = [1, 1, 1, 1, 1, 1, 5, 5, 5, 1, 1]  # shares [0..5], [6, 7], [8, 9, 10]
    assert split_by_size(sizes, 3) == [[0, 1, 2, 3, 4, 5], [6, 7], [8, 9, 10]]
    counters.values = [6, 1, 1]  # worker 0 has claimed its share; 1 and 2 have begun
    # lane 7 (share 1 has 5 bytes left) before 10 and 9 (share 2 has 2)
    assert list(claimed_lanes(sizes, 0, 3, counters)) == [[7], [10], [9]]


@pytest.mark.parametrize("count", [2, 3, 5])
@pytest.mark.parametrize("seed", range(40))
def test_interleaved_workers_claim_every_lane_exactly_once(count, seed):
    """Workers claiming in a random interleaving, as processes would: every lane is claimed
    by exactly one of them, whatever the order."""
    rng = random.Random(seed)
    sizes = [rng.randrange(0, 10) for _ in range(rng.randrange(0, 30))]
    counters = _Counters(count)
    claims = [claimed_lanes(sizes, index, count, counters) for index in range(count)]
    claimed: list[int] = []
    live = list(range(count))
    while live:
        index = rng.choice(live)
        batch = next(claims[index], None)
        if batch is None:
            live.remove(index)
        else:
            claimed += batch
    assert sorted(claimed) == list(range(len(sizes)))

"""Splitting lanes into shares: every lane in exactly one share, neighbours together, balanced."""

from __future__ import annotations

import pytest

from dcpctl.execution.shares import split_by_size


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

"""Column helpers agree with the plain loops they stand for."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest

from dcpctl.columns import (first_by_group, index_of_largest_by_group, join_runs, map_distinct,
                            repeat_each, set_each, sums_by_key, sums_of_runs)


def test_map_distinct_calls_once_per_distinct_value():
    calls = []

    def shout(text):
        calls.append(text)
        return text.upper()

    assert list(map_distinct(shout, ["a", "b", "a", "a"])) == ["A", "B", "A", "A"]
    assert sorted(calls) == ["a", "b"]


@pytest.mark.parametrize("lengths", [[1, 1, 1], [0, 2, 1], [3], [], [0, 0]])
def test_runs_follow_their_lengths(lengths):
    values = list(range(1, sum(lengths) + 1))
    starts = [sum(lengths[:index]) for index in range(len(lengths))]
    runs = [values[start:start + length] for start, length in zip(starts, lengths)]
    assert sums_of_runs(values, lengths) == [sum(run) for run in runs]
    texts = list(map(str, values))
    assert list(join_runs(",", texts, lengths)) == [",".join(map(str, run)) for run in runs]
    assert list(repeat_each(["x", "y", "z"][:len(lengths)], lengths)) == [
        name for name, length in zip("xyz", lengths) for _ in range(length)]


@pytest.mark.parametrize("key_count", [1, 3, 20])
def test_sums_by_key_in_first_seen_order(key_count):
    generator = random.Random(key_count)
    keys = [f"k{generator.randrange(key_count)}" for _ in range(500)]
    values = [generator.randrange(1000) for _ in keys]
    expected: dict = {}
    for key, value in zip(keys, values):
        expected[key] = expected.get(key, 0) + value
    result = sums_by_key(keys, values)
    assert result == expected and list(result) == list(expected)


def test_largest_and_first_by_group():
    groups = ["a", "b", "a", "b", "a", "c"]
    values = [5, 7, 9, 7, 9, 0]
    assert index_of_largest_by_group(groups, values) == {"a": 2, "b": 1, "c": 5}
    assert first_by_group(groups, range(6)) == {"a": 0, "b": 1, "c": 5}


def test_set_each():
    objects = [SimpleNamespace(), SimpleNamespace()]
    set_each(objects, "storage", [1, 2])
    assert [item.storage for item in objects] == [1, 2]

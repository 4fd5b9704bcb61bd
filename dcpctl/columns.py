"""Work over whole columns of values with builtins that loop in C.

Checkpoint metadata can list millions of chunks; a Python loop over them costs seconds where
map, zip, islice and dict lookups cost a fraction of that. These helpers name the few
column operations that have no builtin of their own.
"""

from __future__ import annotations

from collections import deque
from itertools import chain, compress, islice, repeat
from operator import eq
from typing import Any, Callable, Hashable, Iterable, Iterator, Sequence

# Up to this many distinct keys, summing by key takes one C-level pass per key.
_FEW_KEYS = 6


def set_each(objects: Iterable, attribute: str, values: Iterable) -> None:
    """Set `attribute` of each object to the matching value."""
    deque(map(setattr, objects, repeat(attribute), values), maxlen=0)


def map_distinct(function: Callable[[Any], Any], values: Iterable[Hashable]) -> Iterator:
    """function(value) for each value, calling it once per distinct value.

    Values that compare equal share a result, so mix no types that do (1, 1.0, True).
    """
    values = list(values)
    result_of = {value: function(value) for value in set(values)}
    return map(result_of.__getitem__, values)


def repeat_each(values: list, counts: list[int]) -> Iterable:
    """Each value repeated its count of times, in order."""
    if _all_ones(counts) and len(counts) == len(values):
        return values
    return chain.from_iterable(map(repeat, values, counts))


def sums_of_runs(values: Iterable[int], run_lengths: list[int]) -> list[int]:
    """The sums of consecutive runs of values, one run per length."""
    if _all_ones(run_lengths):
        return list(values)
    remaining = iter(values)
    # Each islice takes the next run from the one shared iterator.
    return list(map(sum, map(islice, repeat(remaining), run_lengths)))


def join_runs(separator: str, texts: Iterable[str], run_lengths: list[int]) -> Iterable[str]:
    """Consecutive runs of texts, each run joined with separator, one run per length."""
    if _all_ones(run_lengths):
        return texts
    remaining = iter(texts)
    return map(separator.join, map(islice, repeat(remaining), run_lengths))


def _all_ones(run_lengths: list[int]) -> bool:
    return bool(run_lengths) and min(run_lengths) == max(run_lengths) == 1


def sums_by_key(keys: Sequence[Hashable], values: Sequence[int]) -> dict:
    """The total of the values of each key, keys in the order they first appear."""
    distinct = list(dict.fromkeys(keys))
    if len(distinct) == 1:
        return {distinct[0]: sum(values)}
    if len(distinct) <= _FEW_KEYS:
        return {key: sum(compress(values, map(eq, keys, repeat(key)))) for key in distinct}
    totals = dict.fromkeys(distinct, 0)
    for key, value in zip(keys, values):
        totals[key] += value
    return totals


def first_by_group(groups: Iterable[Hashable], values: Iterable) -> dict:
    """The first value of each group, groups in the order they first appear."""
    firsts: dict = {}
    deque(map(firsts.setdefault, groups, values), maxlen=0)
    return firsts


def index_of_largest_by_group(groups: Sequence[Hashable], values: Sequence[int]) -> dict:
    """For each group, the index of its largest value (the first such index, on ties)."""
    # A stable sort: equal values keep their order, so the first index of the largest comes
    # first in its group.
    descending = sorted(range(len(values)), key=values.__getitem__, reverse=True)
    return first_by_group(map(groups.__getitem__, descending), descending)

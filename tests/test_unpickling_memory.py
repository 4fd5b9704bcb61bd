"""The cap on what one unpickling of `.metadata` may take (dcpctl/unpickling_memory.py)."""

from __future__ import annotations

import resource

import pytest

from dcpctl import unpickling_memory
from dcpctl.unpickling_memory import bounded_memory

OVER_THE_BUDGET = 3 << 30  # a small pickle's budget is 1 GiB: malloc refuses this at once


def test_only_processes_that_ask_for_it_are_capped(monkeypatch):
    """A training job loading through dcpctl.storage_reader keeps its memory to itself."""
    monkeypatch.setattr(unpickling_memory, "_bounded", False)
    before = resource.getrlimit(resource.RLIMIT_DATA)
    with bounded_memory(100):
        assert resource.getrlimit(resource.RLIMIT_DATA) == before


def test_the_cap_holds_while_any_unpickling_runs_and_is_lifted_after(monkeypatch):
    monkeypatch.setattr(unpickling_memory, "_bounded", True)
    before = resource.getrlimit(resource.RLIMIT_DATA)
    with bounded_memory(100):
        with bounded_memory(100):
            with pytest.raises(MemoryError):
                bytearray(OVER_THE_BUDGET)
        with pytest.raises(MemoryError):  # the outer one still runs
            bytearray(OVER_THE_BUDGET)
        assert len(bytearray(64 << 20)) == 64 << 20  # within the budget
    assert resource.getrlimit(resource.RLIMIT_DATA) == before


def test_a_limit_set_before_is_never_raised(monkeypatch):
    monkeypatch.setattr(unpickling_memory, "_bounded", True)
    before = resource.getrlimit(resource.RLIMIT_DATA)
    data_bytes = unpickling_memory._data_segment_bytes()
    own = data_bytes + (256 << 20)
    resource.setrlimit(resource.RLIMIT_DATA, (own, before[1]))
    try:
        with bounded_memory(100):
            assert resource.getrlimit(resource.RLIMIT_DATA)[0] == own
        assert resource.getrlimit(resource.RLIMIT_DATA)[0] == own
    finally:
        resource.setrlimit(resource.RLIMIT_DATA, before)

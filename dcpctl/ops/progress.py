"""How operations report progress and pick their thread count, without printing anything."""

from __future__ import annotations

import os
from typing import Protocol


class Progress(Protocol):
    """Told the total bytes of work once, then each amount done (from any thread)."""

    def start(self, total_bytes: int) -> None: ...

    def advance(self, done_bytes: int) -> None: ...


class NoProgress:
    """Progress that nobody watches."""

    def start(self, total_bytes: int) -> None:
        """Ignore the total."""

    def advance(self, done_bytes: int) -> None:
        """Ignore the step."""


def thread_count(requested: int | None = None) -> int:
    """The threads to use: as requested, else one per core this process may run on."""
    if requested is not None:
        return max(1, requested)
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1

"""How dcpctl words what it counts, in reports and error messages alike."""

from __future__ import annotations

from typing import Sequence


def counted(count: int, noun: str, plural: str | None = None) -> str:
    """`1 file`, `2 files`: count and the noun, plural (noun + s unless given) but for one."""
    return f"{count} {noun}" if count == 1 else f"{count} {plural or noun + 's'}"


def listed(items: Sequence[str], shown: int, separator: str = ", ") -> str:
    """The first `shown` of items, joined by separator, then ` and 3 more` for the rest."""
    more = len(items) - shown
    return separator.join(items[:shown]) + (f" and {more} more" if more > 0 else "")

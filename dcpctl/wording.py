"""How dcpctl words what it counts, in reports and error messages alike."""

from __future__ import annotations


def counted(count: int, noun: str, plural: str | None = None) -> str:
    """`1 file`, `2 files`: count and the noun, plural (noun + s unless given) but for one."""
    return f"{count} {noun}" if count == 1 else f"{count} {plural or noun + 's'}"

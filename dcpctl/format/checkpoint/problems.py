"""What can be wrong with a checkpoint, as structured problems: `verify` lists them, and
`open_checkpoint` refuses a checkpoint with missing or truncated files (view.py decides those
once; reads that meet one later raise errors.missing_file_error or truncated_error)."""

from __future__ import annotations

from dataclasses import dataclass

MISSING_FILE, NOT_REGULAR_FILE, TRUNCATED = "missing-file", "not-regular-file", "truncated"


@dataclass(frozen=True)
class Problem:
    """One thing wrong with a checkpoint: the rule broken, where (file and byte range
    [start, end), when known) and the fqns affected."""

    rule: str
    message: str
    file: str | None = None
    start: int | None = None
    end: int | None = None
    fqns: tuple[str, ...] = ()

"""What can be wrong with a checkpoint, as structured problems (`verify` lists them, and
`open_checkpoint` refuses a checkpoint with missing or truncated files, view.py deciding
those once), and the errors of reads that meet a missing or truncated file."""

from __future__ import annotations

import os
from dataclasses import dataclass

from dcpctl.errors import DataError

MISSING_FILE, TRUNCATED = "missing-file", "truncated"


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


def missing_file_error(path: str | os.PathLike, fqn: str | None = None) -> DataError:
    """The error of a read that finds its data file gone."""
    return DataError("missing data file", path=path, fqn=fqn)


def truncated_error(path: str | os.PathLike, fqn: str | None, start: int, end: int,
                    file_end: int) -> DataError:
    """The error of a read of bytes [start, end) that finds the file ending at file_end."""
    return DataError(f"truncated: the file ends at byte {file_end}", path=path, fqn=fqn,
                     start=start, end=end)

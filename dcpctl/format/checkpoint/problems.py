"""What can be wrong with a checkpoint, as structured problems: `verify` lists them; the other
commands refuse what has one, with the first as one error (problems_error). Missing and
truncated files are decided once, in view.py; reads that meet one later raise
errors.missing_file_error or truncated_error."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from dcpctl.errors import DataError


class Rule:
    """The rules a checkpoint can break, named as `verify` reports them (the README lists them)."""

    INCOMPLETE = "incomplete"
    METADATA = "metadata"
    CHECKSUMS_FILE = "checksums-file"
    MISSING_FILE = "missing-file"
    NOT_REGULAR_FILE = "not-regular-file"
    TRUNCATED = "truncated"
    ITEM_OVERLAP = "item-overlap"
    NO_STORAGE = "no-storage"
    ORPHAN_STORAGE = "orphan-storage"
    CHUNK_OVERLAP = "chunk-overlap"
    CHUNK_GAP = "chunk-gap"
    STORED_LENGTH = "stored-length"
    UNKNOWN_FILE = "unknown-file"
    NOT_CHECKSUMMED = "not-checksummed"
    CHECKSUM_MISMATCH = "checksum-mismatch"
    UNSUPPORTED_TRANSFORM = "unsupported-transform"
    DECODE = "decode"
    ARCHIVE = "archive"
    CRC_MISMATCH = "crc-mismatch"
    TENSOR_MISMATCH = "tensor-mismatch"
    SAFETENSORS_HEADER = "safetensors-header"
    READ_ERROR = "read-error"
    CONSOLIDATION = "consolidation"


ALL_RULES = tuple(value for name, value in vars(Rule).items() if name.isupper())


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

    def to_json(self) -> dict:
        """The problem as `--json` reports carry it."""
        return {"rule": self.rule, "file": self.file, "start": self.start, "end": self.end,
                "fqns": list(self.fqns), "message": self.message}


class ProblemsError(DataError):
    """A checkpoint refused for the problems it has (problems_error)."""

    def __init__(self, message: str, problems: list[Problem], **where) -> None:
        super().__init__(message, **where)
        self.problems = problems


def problems_error(problems: list[Problem], where: Path) -> ProblemsError:
    """One error for the first of problems: its rule and message, its file (in the checkpoint
    directory `where`; `where` itself for a problem without a file name, as an item's own
    problems have), the fqn when it is one item's, the byte range, and how many more there
    are."""
    first = problems[0]
    more = f" (and {len(problems) - 1} more problems; see dcpctl verify)" if problems[1:] else ""
    return ProblemsError(f"{first.rule}: {first.message}{more}", problems,
                         path=where / first.file if first.file else where,
                         fqn=first.fqns[0] if len(first.fqns) == 1 else None,
                         start=first.start, end=first.end)

"""The one exception hierarchy of dcpctl: every failure a user can cause or meet is one of these.

An error carries where it happened as fields (`path`, `fqn`, `start`, `end`), apart from what
went wrong (`message`): code that reports it (verify's problems, say) reads the fields, and
`str()` joins them into the one line a user sees, `<path>: item '<fqn>' at bytes a..b: <what>`
(or `<path>: bytes a..b: <what>` where no item is known).
"""

from __future__ import annotations

import os


def describe_os_error(error: OSError) -> str:
    """`path: reason` for an OSError, the way dcpctl reports one."""
    where = f"{error.filename}: " if error.filename else ""
    return f"{where}{error.strerror or error}"


def name_and_message(error: BaseException) -> str:
    """`ConnectionResetError: reset by peer`, or the class's name alone where the error says
    nothing more (a client's timeout often does not)."""
    message = str(error)
    return f"{type(error).__name__}: {message}" if message else type(error).__name__


def _path_text(path) -> str:
    """A local path as os.fspath gives it, a URL (an object store's path) as it is written."""
    return path if isinstance(path, str) else str(path)


class DcpctlError(Exception):
    """A failure to report as one line, `Error: <str(error)>`, with exit status `exit_code`."""

    exit_code = 1

    def __init__(self, message: str, *, path: str | os.PathLike | None = None,
                 fqn: str | None = None, start: int | None = None,
                 end: int | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.path = None if path is None else _path_text(path)
        self.fqn = fqn
        self.start = start
        self.end = end

    def located(self, *, path: str | os.PathLike | None = None, fqn: str | None = None,
                start: int | None = None, end: int | None = None) -> DcpctlError:
        """This error, with the place filled in where it does not say yet (an error raised deep
        down learns its file and item on the way up)."""
        if self.path is None and path is not None:
            self.path = _path_text(path)
        if self.fqn is None and fqn is not None:
            self.fqn = fqn
            if self.start is None:
                self.start, self.end = start, end
        return self

    def __str__(self) -> str:
        parts = [self.path] if self.path else []
        span = f"bytes {self.start}..{self.end}" if self.start is not None else None
        if self.fqn is not None:
            parts.append(f"item {self.fqn!r}" + (f" at {span}" if span else ""))
        elif span:
            parts.append(span)
        return ": ".join([*parts, self.message])


class InvalidOptionError(DcpctlError):
    """A value given to dcpctl that can never work (a codec it does not know, a zstd level or
    rank count out of range): a usage error, exit status 2."""

    exit_code = 2


class CheckpointNotFoundError(DcpctlError):
    """The path does not exist or is not a directory."""


class IncompleteCheckpointError(DcpctlError):
    """A directory without `.metadata`: a save that never finished, or not a checkpoint."""


class MetadataError(DcpctlError):
    """`.metadata` is empty, truncated, not a pickle, or not DCP metadata."""


class UnsafeMetadataError(MetadataError):
    """`.metadata` names something outside the allowlist of DCP metadata classes."""


class UnknownClassError(UnsafeMetadataError):
    """`.metadata` names a class outside DCP's (a custom planner's, a quantized dtype; or a
    damaged name): no sign of damage alone, as torch may read it."""


class MetadataReadError(MetadataError):
    """`.metadata` could not be read at all (the file system failed it): nothing is judged."""


NO_SIGN_OF_DAMAGE = (UnknownClassError, MetadataReadError)
"""The refusals of a `.metadata` that say nothing of the checkpoint's soundness: verify calls
it unreadable where one is all it found, as ls and prune do."""


class UnsafePathError(DcpctlError):
    """A path recorded in the metadata escapes the checkpoint directory."""


class UnsupportedLayoutError(DcpctlError):
    """A checkpoint layout, codec or dtype that dcpctl does not handle."""


class DataError(DcpctlError):
    """A data file is missing, truncated or holds bytes that do not decode."""


class OutputError(DcpctlError):
    """The output location cannot be used: it exists and is not empty, or is not writable."""


TRY_AGAIN_EXIT_CODE = 75
"""EX_TEMPFAIL: another run held or changed what this one works on; nothing was done, and a
script tells that from damage or a wrong path, and tries again later."""


class LockHeldError(DcpctlError):
    """Another dcpctl process holds the lock on this directory; nothing was changed."""

    exit_code = TRY_AGAIN_EXIT_CODE


class ChangedWhileReadError(DataError):
    """A file changed while dcpctl read it (another process writing it): nothing was done
    with what was read; run the command again."""

    exit_code = TRY_AGAIN_EXIT_CODE


class OutputTakenError(OutputError):
    """Another run is writing the output, or took it over or changed it while this one wrote
    it; nothing was published."""

    exit_code = TRY_AGAIN_EXIT_CODE


class PartialFailureError(DcpctlError):
    """An operation did part of its work; its report says what was done and what was not."""


class SelectionError(DcpctlError):
    """A conversion's include/exclude/rename options select nothing or give two entries one
    name."""


def missing_file_error(path: str | os.PathLike, fqn: str | None = None) -> DataError:
    """The error of a read that finds its data file gone."""
    return DataError("missing data file", path=path, fqn=fqn)


def truncated_error(path: str | os.PathLike, fqn: str | None, start: int, end: int,
                    file_end: int) -> DataError:
    """The error of a read of bytes [start, end) that finds the file ending at file_end."""
    return DataError(f"truncated: the file ends at byte {file_end}", path=path, fqn=fqn,
                     start=start, end=end)

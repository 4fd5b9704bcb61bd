"""The one exception hierarchy of dcpctl: every failure a user can cause or meet is one of these."""


def describe_os_error(error: OSError) -> str:
    """`path: reason` for an OSError, the way dcpctl reports one."""
    where = f"{error.filename}: " if error.filename else ""
    return f"{where}{error.strerror or error}"


class DcpctlError(Exception):
    """A failure to report as one line, `Error: <message>`, with exit status 1."""

    exit_code = 1


class CheckpointNotFoundError(DcpctlError):
    """The path does not exist or is not a directory."""


class IncompleteCheckpointError(DcpctlError):
    """A directory without `.metadata`: a save that never finished, or not a checkpoint."""


class MetadataError(DcpctlError):
    """`.metadata` is empty, truncated, not a pickle, or not DCP metadata."""


class UnsafeMetadataError(MetadataError):
    """`.metadata` names something outside the allowlist of DCP metadata classes."""


class UnsafePathError(DcpctlError):
    """A path recorded in the metadata escapes the checkpoint directory."""


class UnsupportedLayoutError(DcpctlError):
    """A checkpoint layout, codec or dtype that dcpctl does not handle."""


class DataError(DcpctlError):
    """A data file is missing, truncated or holds bytes that do not decode."""


class OutputError(DcpctlError):
    """The output location cannot be used: it exists and is not empty, or is not writable."""


class LockHeldError(DcpctlError):
    """Another dcpctl process holds the lock on this directory; nothing was changed."""


class PartialFailureError(DcpctlError):
    """An operation did part of its work; its report says what was done and what was not."""


class SelectionError(DcpctlError):
    """A conversion's include/exclude/rename options select nothing or give two entries one
    name."""

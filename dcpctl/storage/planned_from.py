"""The files a process has made its plans from, and fingerprints that tell whether another
process, on another machine, read the same files at the same paths.

Every rank of a torchrun job plans alone, from the files it reads. A rank that reads another
file at a path (a node's own copy of a model, another working directory) plans from another
checkpoint, and its share of the output would be made of that one's bytes; rank 0 compares
their fingerprints with its own (execution/torchrun.py) and publishes nothing where they
differ. A `.metadata` is fingerprinted whole: it is what a plan is made of, and it names its
save. A safetensors or torch.save file is fingerprinted by its size and its first and last
ENDS_BYTES, where these formats keep their structure: hashing the whole of a model's files
again would cost each rank as much as the job. A torch.save file's zip directory, at its end,
holds each record's CRC-32, so its fingerprint covers its contents; a safetensors header holds
names, shapes and offsets only, so two files that differ only in the middle of a tensor of
more than ENDS_BYTES pass for one (a limit the README states).
"""

from __future__ import annotations

from dcpctl.errors import DcpctlError
from dcpctl.storage.file_digests import sha256_of_ends, sha256_of_file
from dcpctl.storage.paths import storage_path
from dcpctl.thread_pools import thread_pool

ENDS_BYTES = 1 << 20
"""The bytes at each end of a file that its fingerprint covers, where it does not cover it
whole."""

FINGERPRINT_THREADS = 8
"""Files fingerprinted at once: in an object store, each waits on a few requests."""

_planned_from: dict[str, bool] = {}  # path or URL as read: whether fingerprinted whole


def note_planned_from(path: object, whole: bool) -> None:
    """Note that this process made a plan from the file at path (`str(path)` is its name in
    fingerprints), fingerprinted whole or by its ends."""
    _planned_from[str(path)] = whole


def planned_from() -> dict[str, bool]:
    """Every file noted so far: path to whether it is fingerprinted whole."""
    return dict(_planned_from)


def fingerprints(files: dict[str, bool]) -> dict[str, str | None]:
    """The fingerprint of each of files (as planned_from gives them), as this process reads
    the file now; None where it cannot be read."""
    def fingerprint(path: str) -> str | None:
        try:
            return (sha256_of_file(storage_path(path)) if files[path]
                    else sha256_of_ends(storage_path(path), ENDS_BYTES))
        except (OSError, DcpctlError):
            return None

    if len(files) < 2:
        return {path: fingerprint(path) for path in files}
    with thread_pool(min(FINGERPRINT_THREADS, len(files)), "dcpctl-fingerprint") as pool:
        return dict(zip(files, pool.map(fingerprint, files)))

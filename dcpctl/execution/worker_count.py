"""How many worker processes a command starts when `--workers` is not given.

Processes beat threads once there is data enough: threads share one interpreter lock, while a
worker costs a fraction of a second to start and to plan its job, and holds a plan of its own
(memory that grows with the chunks `.metadata` lists). So the default is a process per core,
bounded by the data (one per AUTOMATIC_WORKER_BYTES) and by the memory available for the plans;
one process in an object store (its threads wait on the network more than on each other) and
under torchrun (each rank is one worker).
"""

from __future__ import annotations

import os

from dcpctl.execution import torchrun
from dcpctl.format.file_names import METADATA_FILE_NAME, rank_of_metadata_file_name
from dcpctl.pipeline import default_thread_count
from dcpctl.storage.paths import StoragePath, is_remote

AUTOMATIC_WORKER_BYTES = 256 << 20
"""The data each worker started by default has at least: a share this size repays the start."""
PLAN_BYTES_PER_METADATA_BYTE = 16
"""A process's plan takes about this many bytes of memory per byte of `.metadata` (measured:
1.2 to 1.9 GiB for a `.metadata` of 144 MB listing a million chunks)."""
PROCESS_BASE_BYTES = 128 << 20
"""A worker's memory besides its plan: the interpreter, dcpctl and the pieces in flight."""


def automatic_workers(source: StoragePath, output: StoragePath | None = None) -> int:
    """The processes a command on source (writing to output, if any) shares its work among
    by default (see the module docstring); at least 1."""
    if torchrun.current_team() is not None or is_remote(source) or (
            output is not None and is_remote(output)):
        return 1
    data_bytes, metadata_bytes = _local_sizes(source)
    count = min(default_thread_count(), data_bytes // AUTOMATIC_WORKER_BYTES)
    available = available_memory_bytes()
    if available is not None:
        per_worker = PROCESS_BASE_BYTES + PLAN_BYTES_PER_METADATA_BYTE * metadata_bytes
        count = min(count, available // 2 // per_worker)
    return max(1, count)


def _local_sizes(source: StoragePath) -> tuple[int, int]:
    """The bytes of the files of a local checkpoint directory (or of a file), and of its
    metadata (`.metadata`, or its ranks' own); (0, 0) where there is nothing to read (the
    command says so)."""
    try:
        if not os.path.isdir(source):
            return os.path.getsize(source), 0
        data_bytes = metadata_bytes = 0
        with os.scandir(source) as entries:
            for entry in entries:
                if entry.is_file(follow_symlinks=False):
                    size = entry.stat(follow_symlinks=False).st_size
                    data_bytes += size
                    if (entry.name == METADATA_FILE_NAME
                            or rank_of_metadata_file_name(entry.name) is not None):
                        metadata_bytes += size  # a rank's own, of use_collectives=False
        return data_bytes, metadata_bytes
    except OSError:
        return 0, 0


def available_memory_bytes() -> int | None:
    """The memory the system can give without swapping (Linux's MemAvailable), or None where
    that is not known."""
    try:
        with open("/proc/meminfo", encoding="ascii") as stream:
            for line in stream:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, AttributeError):
        return None

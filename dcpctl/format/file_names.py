"""The names of the files a DCP checkpoint directory holds, and of those beside it."""

from __future__ import annotations

import re
from typing import Iterable

from dcpctl.storage.local import final_name_of

METADATA_FILE_NAME = ".metadata"
"""The pickled metadata; torch writes it last, so a directory without it is incomplete."""
METADATA_TEMPORARY_FILE_NAME = f"{METADATA_FILE_NAME}.tmp"
"""What torch writes `.metadata` as before its atomic rename: a save that is still running."""
DATA_FILE_SUFFIX = ".distcp"
SHA256SUMS_FILE_NAME = "SHA256SUMS"
HF_INDEX_FILE_NAME = "model.safetensors.index.json"
"""The index of sharded safetensors files (Hugging Face's layout, also torch's HF writer)."""


# as torch writes the rank: no leading zero (`__01.metadata` is no rank's: torch never reads it)
_RANK_METADATA_FILE_NAME = re.compile(rf"__(0|[1-9][0-9]*){re.escape(METADATA_FILE_NAME)}")


def rank_metadata_file_name(rank: int) -> str:
    """The file of a rank's own metadata, as torch's save with use_collectives=False names it
    (each rank plans and writes alone, and no `.metadata` is written)."""
    return f"__{rank}{METADATA_FILE_NAME}"


def rank_of_metadata_file_name(name: str) -> int | None:
    """The rank whose own metadata a file holds (rank_metadata_file_name), or None."""
    match = _RANK_METADATA_FILE_NAME.fullmatch(name)
    return int(match.group(1)) if match else None


def rank_file_name(rank: int) -> str:
    """The data file of a rank, as torch's FileSystemWriter names it (one file per rank)."""
    return f"__{rank}_0{DATA_FILE_SUFFIX}"


_RANK_FILE_NAME = re.compile(rf"__([0-9]+)_[0-9]+{re.escape(DATA_FILE_SUFFIX)}")


def rank_of_file_name(name: str) -> int | None:
    """The rank that wrote a data file named as torch's FileSystemWriter names them
    (`__<rank>_<n>.distcp`, perhaps under a prefix, or under the temporary name dcpctl gives
    such a file: an in-place rewrite in an object store, which cannot rename, keeps it), or
    None."""
    match = _RANK_FILE_NAME.fullmatch(final_name_of(name.rpartition("/")[2]))
    return int(match.group(1)) if match else None


def natural_order(name: str) -> tuple:
    """A sort key comparing the numbers in a file name as numbers: `__2_0.distcp` before
    `__10_0.distcp`, in the order of the ranks that name them."""
    # the runs of digits are every other part: only they are read as numbers (a `²`, which
    # isdigit() takes for a digit, stays text)
    parts = re.split(r"(\d+)", name)
    return tuple(int(part) if index % 2 else part for index, part in enumerate(parts))


def world_size_of_rank_files(names: Iterable[str]) -> int | None:
    """How many ranks saved a checkpoint whose data files are these, told by their rank
    numbers (`__<rank>_<n>.distcp`); None where a file is not named by rank, or none is."""
    ranks = {rank_of_file_name(name) for name in names}
    if not ranks or None in ranks:
        return None
    return max(ranks) + 1


def is_plain_file_name(name: str) -> bool:
    """Whether name is what dcpctl accepts for a file of a checkpoint: a path below its
    directory written the one plain way (`a/b.distcp`: no leading `/`, no empty, `.` or `..`
    part, no `\\`), printable (no NUL, line break of any kind or control character:
    SHA256SUMS lists one name per line, and terminals show them). Directories are allowed:
    writers to S3 spread ranks over prefixes (`0000000000/__0_0.distcp`)."""
    return (name.isprintable() and "\\" not in name
            and all(part not in ("", ".", "..") for part in name.split("/")))

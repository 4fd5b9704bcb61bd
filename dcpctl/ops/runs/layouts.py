"""How trainers lay out the checkpoints of a run directory, as `ls` and `prune` read them.

- One DCP directory per checkpoint: torchtitan `step-N/`, torchtune `dist_epoch_N/`, a plain
  `dcp.save`. Complete when it holds `.metadata` (torch writes it last).
- Several DCP directories per checkpoint: accelerate's `checkpoint_N/` holds
  `pytorch_model_fsdp_<i>/` and `optimizer_<i>/` beside `random_states_<rank>.pkl`,
  `scheduler.bin` and the like. The DCP directories are its parts; it is complete when every
  part holds `.metadata` and `random_states_0.pkl` is there (accelerate's `save_state` writes
  the models, then the optimizers, then the RNG states, then the objects registered for
  checkpointing, `custom_checkpoint_<i>.pkl`: scan.py doubts one holding fewer of them than
  the checkpoint before it). The transformers Trainer,
  under FSDP with SHARDED_STATE_DICT, writes the same parts through accelerate into
  `checkpoint-N/`, then `scheduler.pt`, each rank's `rng_state_<rank>.pth` and, last,
  `trainer_state.json`, which makes one of its checkpoints complete.
- Megatron-Core's `iter_0000004/` is one DCP directory too, with `common.pt`, written first,
  and `metadata.json`, written after `.metadata`: complete once that is there (its loader
  refuses a directory without).
- A torch save with `use_collectives=False`: each rank writes its own data files and then its
  own `__<rank>.metadata`, and no `.metadata`: complete once every rank with data files, and
  every rank below the highest with metadata, has written its metadata
  (format/checkpoint/rank_metadata.py).
- Megatron-Core names the iteration it resumes from in `latest_checkpointed_iteration.txt` in
  the run directory (written once a save is finished), which prune always keeps.
- Lightning's ModelCheckpoint names a sharded checkpoint (a DCP directory) as it names a file,
  by default `epoch=2-step=300.ckpt`, and writes `meta.pt` in it after `.metadata`: complete
  once that is there (Lightning takes a directory without it for no sharded checkpoint).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Collection, Iterable

from dcpctl.errors import CheckpointNotFoundError
from dcpctl.format.checkpoint.rank_metadata import (first_rank_lacking_metadata,
                                                    left_by_a_larger_save, rank_metadata_names)
from dcpctl.format.checkpoint.side_files import (LIGHTNING_STATE, MEGATRON_COMMON_STATE,
                                                 MEGATRON_CONFIG)
from dcpctl.format.file_names import (DATA_FILE_SUFFIX, METADATA_FILE_NAME,
                                      METADATA_TEMPORARY_FILE_NAME, SHA256SUMS_FILE_NAME,
                                      rank_metadata_file_name, rank_of_metadata_file_name)
from dcpctl.format.state_dict_layouts import ACCELERATE_MODEL_PART, ACCELERATE_PART
from dcpctl.storage.paths import StoragePath

_PARTIAL_SAVE_FILES = (DATA_FILE_SUFFIX, METADATA_TEMPORARY_FILE_NAME)
_ACCELERATE_RNG_STATE = re.compile(r"random_states_[0-9]+\.pkl")
ACCELERATE_LAST_WRITTEN = "random_states_0.pkl"
ACCELERATE_CUSTOM_OBJECT = re.compile(r"custom_checkpoint_[0-9]+\.pkl")
TRAINER_LAST_WRITTEN = "trainer_state.json"
MEGATRON_TRACKER = "latest_checkpointed_iteration.txt"
MEGATRON_TRACKER_MAX_BYTES = 1 << 20
"""Megatron writes the iteration as decimal digits (or `release`) and reads the file whole,
stripped of white space around it; a tracker longer than this is not read."""


METADATA_IS_A_DIRECTORY = f"its {METADATA_FILE_NAME} is a directory: not a DCP checkpoint"

LIGHTNING_CHECKPOINT_NAME = re.compile(r"(?:epoch=[0-9]+-)?step=(?P<number>[0-9]+)\.ckpt")
"""The names Lightning's ModelCheckpoint gives by default (`{epoch}-{step}`, or `{step}`):
names with other metrics in them, or a version (`-v1`) that a second checkpoint of one step
gets, are none that dcpctl takes for a checkpoint's."""


@dataclass(frozen=True)
class CheckpointShape:
    """What a checkpoint directory holds: its DCP parts (none for a single DCP directory,
    which is its own part) and whether the save finished."""

    parts: tuple[str, ...]
    complete: bool
    custom_objects: int = 0
    """Of an accelerate checkpoint: the objects registered for checkpointing it holds."""
    rank_metadata: tuple[str, ...] = ()
    """Of a save with use_collectives=False: its ranks' own metadata files, in place of
    `.metadata`."""
    doubt: str | None = None
    """Why an incomplete one may be a whole checkpoint all the same (scan.py CheckpointEntry):
    prune never deletes it."""

    @property
    def metadata_files(self) -> list[str]:
        """The `.metadata` files that make it complete (its ranks' own, of a save with
        use_collectives=False), relative to it: what a deletion removes first, so that a
        deletion cut short leaves it looking incomplete."""
        return list(self.rank_metadata) or self._in_each_part(METADATA_FILE_NAME)

    @property
    def sha256sums_files(self) -> list[str]:
        """The SHA256SUMS files that certify all of it (`dcpctl checksum` of each part)."""
        return self._in_each_part(SHA256SUMS_FILE_NAME)

    def _in_each_part(self, file_name: str) -> list[str]:
        if not self.parts:
            return [file_name]
        return [f"{part}/{file_name}" for part in self.parts]


def checkpoint_shape(names: Collection[str], directory_name: str) -> CheckpointShape | str:
    """The shape of the checkpoint directory of this name from the names of the files in it
    and in its subdirectories at any depth (`part/file`), or why it is not a checkpoint."""
    if any(f"/{METADATA_FILE_NAME}/" in f"/{name}" for name in names):
        return METADATA_IS_A_DIRECTORY
    if METADATA_FILE_NAME in names:
        # Others below its own (seed_1/step-100/.metadata) are a run of the user's kept in it,
        # which deleting the checkpoint would delete too.
        nested = sorted({name.rpartition("/")[0] for name in names if "/" in name
                         and name.rpartition("/")[2] in (METADATA_FILE_NAME,
                                                         METADATA_TEMPORARY_FILE_NAME)})
        if nested:
            shown = ", ".join(part or "''" for part in nested[:3])
            return (f"holds DCP checkpoints ({shown}) below its own {METADATA_FILE_NAME}: a run "
                    "of its own, or the user's")
        # Megatron writes common.pt first and metadata.json after .metadata; its loader
        # refuses a directory without metadata.json.
        megatron_unfinished = MEGATRON_COMMON_STATE in names and MEGATRON_CONFIG not in names
        lightning_unfinished = (LIGHTNING_CHECKPOINT_NAME.fullmatch(directory_name) is not None
                                and LIGHTNING_STATE not in names)
        rank_files = rank_metadata_names(names)
        if rank_files:
            return CheckpointShape((), complete=False, doubt=_two_saves_said(rank_files))
        return CheckpointShape((), complete=not (megatron_unfinished or lightning_unfinished))
    parts = sorted(_dcp_subdirectories(names))
    if parts:
        # Only accelerate keeps a checkpoint in several DCP directories. Others in a directory
        # named like a step (checkpoint-1/step-100, step-3/checkpoint_0/...) are a run of their own,
        # or the user's: deleting the directory would delete them with whatever lies beside.
        foreign = [part for part in parts if not ACCELERATE_PART.fullmatch(part)]
        if foreign:
            shown = ", ".join(part or "''" for part in foreign[:3])  # a key's empty segment
            return (f"holds DCP checkpoints ({shown}) that are not the parts "
                    "of an accelerate checkpoint: a run of its own, or the user's")
        complete = (all(f"{part}/{METADATA_FILE_NAME}" in names for part in parts)
                    and (ACCELERATE_LAST_WRITTEN in names or TRAINER_LAST_WRITTEN in names))
        custom_objects = sum(1 for name in names if ACCELERATE_CUSTOM_OBJECT.fullmatch(name))
        return CheckpointShape(tuple(parts), complete, custom_objects)
    rank_files = rank_metadata_names(names)
    if rank_files:  # saved without collectives
        lacking = first_rank_lacking_metadata(names, rank_files)
        other_reading = None if lacking is None else left_by_a_larger_save(lacking, rank_files)
        return CheckpointShape((), lacking is None, rank_metadata=tuple(rank_files), doubt=(
            f"rank {lacking} has data files but no {rank_metadata_file_name(lacking)}: a save "
            f"cut short, {other_reading}; never deleted by prune (delete it by hand, or the "
            "files of the ranks without metadata, if it is not wanted)"
            if other_reading else None))
    # A save in progress (or one that died) holds data files or `.metadata.tmp`, or nothing yet.
    if not names or any(name.endswith(_PARTIAL_SAVE_FILES) for name in names if "/" not in name):
        return CheckpointShape((), complete=False)
    return (f"no {METADATA_FILE_NAME} and no .distcp files, in it or in a directory in it: "
            "not a DCP checkpoint")


def _two_saves_said(rank_files: list[str]) -> str:
    """Why a checkpoint holding `.metadata` and ranks' own metadata files is in doubt: torch's
    writers leave the other kind in place, so two saves wrote into it, one with
    use_collectives=False; which one its data files are no name tells, and torch loads by
    `.metadata`, which after a later save without collectives describes files it overwrote."""
    more = f" and {len(rank_files) - 1} more" if len(rank_files) > 1 else ""
    return (f"holds {METADATA_FILE_NAME} and {rank_files[0]}{more}, the ranks' "
            "own metadata of a save with use_collectives=False: two saves wrote into it, and "
            "its data files may be either's (torch loads by .metadata); never deleted by prune "
            "(delete the stale metadata, or the checkpoint, by hand)")


def _dcp_subdirectories(names: Iterable[str]) -> set[str]:
    parts = set()
    for name in names:
        part, slash, file_name = name.partition("/")
        if slash and "/" not in file_name and (
                file_name == METADATA_FILE_NAME or file_name.endswith(_PARTIAL_SAVE_FILES)):
            parts.add(part)
    return parts


def refuse_a_checkpoint_as_run_directory(directory: StoragePath, names: Iterable[str]) -> None:
    """Refuse a run directory that is a checkpoint itself, from the names in it (an object's
    key names its directory first): one holding `.metadata`, or a checkpoint saved with
    use_collectives=False (`__0.metadata`), or an accelerate checkpoint, which holds
    accelerate's RNG states or model parts. Its `optimizer_0` and `pytorch_model_fsdp_0` would
    read as checkpoints of step 0, and pruning them would delete part of one checkpoint."""
    for name in sorted(names):
        entry = name.partition("/")[0]
        if name == METADATA_FILE_NAME:
            raise CheckpointNotFoundError(f"is a checkpoint itself (holds {METADATA_FILE_NAME}); "
                                          "give the run directory above it", path=directory)
        if entry == name and rank_of_metadata_file_name(name) is not None:
            raise CheckpointNotFoundError(
                f"is a checkpoint itself (holds {name}: saved with use_collectives=False); "
                "give the run directory above it", path=directory)
        part = ACCELERATE_PART.fullmatch(entry)
        model_part = part is not None and part.group(1) == ACCELERATE_MODEL_PART
        if model_part or _ACCELERATE_RNG_STATE.fullmatch(entry):
            raise CheckpointNotFoundError(
                f"is an accelerate checkpoint itself (holds {entry}); give the run directory "
                "above it (accelerate's `checkpoints/`)", path=directory)


def parse_tracked_iteration(data: bytes) -> int | None:
    """The iteration Megatron's tracker file names; None for `release` or anything else (a
    number of more digits than any step has, too: Python's int refuses past 4,300)."""
    text = data.decode("ascii", errors="replace").strip()
    if not (text.isdecimal() and text.isascii()) or len(text) > _MAX_STEP_DIGITS:
        return None
    return int(text)


_MAX_STEP_DIGITS = 20  # 2**64 has 20 digits

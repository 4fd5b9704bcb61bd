"""Checkpoints torch's HuggingFaceStorageWriter writes: safetensors files and no `.metadata`.

- Sharded (`save_distributed=True`, no consolidation): each rank r writes
  `shard-<r+1>-model-<i>-of-<N>.safetensors` (5 digits each), holding its chunk of every
  tensor; the header's `__metadata__` holds `DCP_SHARDING_INFO`, JSON of
  `{fqn: {"saved_offsets": [...]}}`, where each chunk lies in the full tensor.
- Consolidated (a rank-0 save, or `enable_consolidation=True`, which leaves the rank files in
  `sharded/`): `model-<i>-of-<N>.safetensors` of full tensors and `model.safetensors.index.json`.

torch's HuggingFaceStorageReader loads either from the `.safetensors` files directly in the
directory; dcpctl reads them the same way, as the metadata a DCP checkpoint of
SAFETENSORS-serialized files would have: each tensor's chunks (offsets from
DCP_SHARDING_INFO, else zeros), its size (the furthest extent of its chunks, as torch
computes it), each chunk's bytes inside its file, found through the file's header. Nothing
records the world size, so a missing last rank file cannot be told from the others (a gap
among the shard numbers can); `dcpctl checksum` writes SHA256SUMS, which then can.
"""

from __future__ import annotations

import re
from typing import Iterable

from dcpctl.errors import DcpctlError, DataError, IncompleteCheckpointError, MetadataError
from dcpctl.format.file_names import HF_INDEX_FILE_NAME, METADATA_FILE_NAME
from dcpctl.format.metadata.records import (ChunkMetadata, CheckpointMetadata, MetadataIndex,
                                            StorageInfo, TensorMetadata, TensorProperties)
from dcpctl.format.metadata.structure import check_metadata_structure
from dcpctl.storage.planned_from import note_planned_from
from dcpctl.format.safetensors import (METADATA_KEY, SHARDING_INFO_KEY, check_back_to_back,
                                       parse_entry, parse_json, read_safetensors_header,
                                       read_weight_map)
from dcpctl.storage.paths import StoragePath, file_names_in

SAFETENSORS_SUFFIX = ".safetensors"
SAVED_OFFSETS_KEY = "saved_offsets"
CONSOLIDATED_FROM_DIRECTORY = "sharded"
"""Where `enable_consolidation=True` leaves the rank files the consolidated files came from."""
_SHARD_FILE = re.compile(r"shard-([0-9]+)-model-[0-9]+-of-[0-9]+\.safetensors")


def hf_storage_files(names: Iterable[str]) -> list[str]:
    """The safetensors files of a directory, from the names in it, as torch's reader takes
    them (directly in it, not in subdirectories)."""
    return sorted(name for name in names if name.endswith(SAFETENSORS_SUFFIX) and "/" not in name)


def is_hf_storage_shards(directory: StoragePath) -> bool:
    """Whether directory holds the ranks' files of a save (and no `.metadata`): files named
    for their ranks, or files whose headers place their tensors as chunks (DCP_SHARDING_INFO,
    which torch's writer gives even the one file of a save from one process)."""
    if not directory.is_dir() or (directory / METADATA_FILE_NAME).exists():
        return False
    names = file_names_in(directory)
    return any(_SHARD_FILE.fullmatch(name) for name in names) or any(
        _places_chunks(directory / name) for name in hf_storage_files(names))


def refuse_unconsolidated_save(directory: StoragePath, what_is_missing: str) -> None:
    """Where directory holds no safetensors file of its own but its `sharded/` holds the
    ranks' files of a save (consolidation never ran, or was cut short), raise
    IncompleteCheckpointError saying so and giving that directory, which reads whole."""
    rank_files = directory / CONSOLIDATED_FROM_DIRECTORY
    if (directory.is_dir() and not hf_storage_files(file_names_in(directory))
            and is_hf_storage_shards(rank_files)):
        raise IncompleteCheckpointError(
            f"{what_is_missing}, and no consolidated safetensors files beside "
            f"{CONSOLIDATED_FROM_DIRECTORY}/, which holds the ranks' files of a torch "
            "HuggingFaceStorageWriter save (its consolidation did not run, or did not finish): "
            f"give {rank_files} to read them", path=directory)


def _places_chunks(path: StoragePath) -> bool:
    """Whether a safetensors file's header places its tensors as chunks; False for one that
    does not read (a stray file beside a model: what reads it says what is wrong with it)."""
    try:
        return _sharding_info(read_safetensors_header(path, 0)[0], path) is not None
    except DcpctlError:
        return False


def describe_hf_storage(file_names: Iterable[str]) -> str:
    """Which kind of HuggingFaceStorageWriter save, in words."""
    sharded = any(_SHARD_FILE.fullmatch(name) for name in file_names)
    kind = "each rank's chunks" if sharded else "consolidated"
    return f"torch HuggingFaceStorageWriter, {kind}"


def hf_storage_extra_files(names: Iterable[str]) -> list[str]:
    """The files of such a checkpoint, from the names under it (`sharded/x` for those below),
    that torch's reader does not take: the index, and the rank files consolidation left."""
    return sorted(name for name in names if name == HF_INDEX_FILE_NAME or (
        name.startswith(f"{CONSOLIDATED_FROM_DIRECTORY}/") and name.endswith(SAFETENSORS_SUFFIX)
        and name.count("/") == 1))


def hf_storage_metadata(directory: StoragePath, file_names: list[str],
                        file_sizes: dict[str, int]) -> CheckpointMetadata:
    """The DCP metadata of a directory of HuggingFaceStorageWriter files (module docstring),
    checked as `.metadata` would be: every chunk inside its tensor, no two chunks alike."""
    _refuse_gaps_in_shard_numbers(directory, file_names)
    entries: dict[str, TensorMetadata] = {}
    storage_data: dict[MetadataIndex, StorageInfo] = {}
    for name in file_names:
        path = directory / name
        note_planned_from(path, whole=False)
        header, data_start = read_safetensors_header(path, 0)
        offsets_by_fqn = _sharding_info(header, path)
        tensors = [parse_entry(path, fqn, entry, data_start, file_sizes[name])
                   for fqn, entry in header.items() if fqn != METADATA_KEY]
        check_back_to_back(path, tensors, data_start, file_sizes[name])
        for tensor in tensors:
            fqn = tensor.name
            offsets = _saved_offsets(offsets_by_fqn, fqn, len(tensor.shape), path)
            index = MetadataIndex(fqn, offsets, 0)
            if index in storage_data:
                if any(tensor.shape):
                    raise DataError(f"tensor {fqn!r} has a chunk at {list(offsets)} that "
                                    f"{storage_data[index].relative_path} holds too", path=path)
                continue  # the empty chunk of several ranks past the rows, saved by each
            known = entries.get(fqn)
            if known is None:
                known = entries[fqn] = TensorMetadata(TensorProperties(tensor.dtype),
                                                      (0,) * len(tensor.shape), [])
            elif known.properties.dtype != tensor.dtype or len(known.size) != len(tensor.shape):
                raise DataError(f"tensor {fqn!r} is {tensor.dtype.name} of {len(tensor.shape)} "
                                f"dimensions here, {known.properties.dtype.name} of "
                                f"{len(known.size)} in another file", path=path)
            known.chunks.append(ChunkMetadata(offsets, tensor.shape))
            known.size = tuple(max(extent, offset + size) for extent, offset, size
                               in zip(known.size, offsets, tensor.shape))
            storage_data[index] = StorageInfo(name, 0, tensor.nbytes, None)
    metadata = CheckpointMetadata(entries, planner_data=None, storage_data=storage_data)
    check_metadata_structure(metadata, str(directory))
    return metadata


def check_index(directory: StoragePath, metadata: CheckpointMetadata) -> None:
    """Refuse a `model.safetensors.index.json` whose weight_map puts a tensor in a file that
    does not hold it, or misses one, or names one no file holds (its file missing): Hugging
    Face loaders go by it."""
    path = directory / HF_INDEX_FILE_NAME
    if not path.exists():
        return
    weight_map = read_weight_map(path)
    files_of: dict[str, set[str]] = {}
    for index, info in (metadata.storage_data or {}).items():
        files_of.setdefault(index.fqn, set()).add(info.relative_path)
    for fqn, files in sorted(files_of.items()):
        if weight_map.get(fqn) not in files:
            raise DataError(f"weight_map puts {fqn!r} in {weight_map.get(fqn)!r}, but "
                            f"{', '.join(sorted(files))} holds it", path=path, fqn=fqn)
    read = set().union(*files_of.values())
    for fqn, name in sorted(weight_map.items()):  # a file gone takes its tensors with it
        if fqn not in files_of:
            held = "does not hold it" if name in read else "is not there"
            raise DataError(f"weight_map puts {fqn!r} in {name!r}, which {held}", path=path,
                            fqn=fqn)


def saving_ranks(file_names: Iterable[str]) -> set[int]:
    """The ranks (numbered from 1) whose files, named for them, lie among file_names; none
    for a consolidated save, whose files split whole tensors by size, not by rank."""
    return {int(match.group(1)) for name in file_names if (match := _SHARD_FILE.fullmatch(name))}


def _refuse_gaps_in_shard_numbers(directory: StoragePath, file_names: list[str]) -> None:
    numbers = sorted(saving_ranks(file_names))
    missing = sorted(set(range(1, numbers[-1] + 1)) - set(numbers)) if numbers else []
    if missing:
        raise DataError(f"holds the files of ranks' shards {', '.join(map(str, numbers))} but "
                        f"none of shard {missing[0]}: a rank's file is missing",
                        path=directory)


def _sharding_info(header: dict, path: StoragePath) -> dict | None:
    """DCP_SHARDING_INFO of a file's header, or None for a file of full tensors."""
    metadata = header.get(METADATA_KEY)
    if not isinstance(metadata, dict) or SHARDING_INFO_KEY not in metadata:
        return None
    try:
        info = parse_json(metadata[SHARDING_INFO_KEY])
        if not isinstance(info, dict):
            raise ValueError("not a JSON object")
    except (TypeError, ValueError) as error:
        raise MetadataError(f"{SHARDING_INFO_KEY} is not a JSON object of chunk offsets "
                            f"({error})", path=path) from None
    return info


def _saved_offsets(offsets_by_fqn: dict | None, fqn: str, dimensions: int,
                   path: StoragePath) -> tuple[int, ...]:
    if offsets_by_fqn is None:
        return (0,) * dimensions
    entry = offsets_by_fqn.get(fqn)
    offsets = entry.get(SAVED_OFFSETS_KEY) if isinstance(entry, dict) else None
    if (not isinstance(offsets, list) or len(offsets) != dimensions
            or not all(type(offset) is int and offset >= 0 for offset in offsets)):
        raise MetadataError(f"{SHARDING_INFO_KEY} gives tensor {fqn!r} no {dimensions} "
                            "non-negative saved_offsets", path=path, fqn=fqn)
    return tuple(offsets)

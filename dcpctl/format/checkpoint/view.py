"""The typed view of a DCP checkpoint directory: its metadata joined with its data files."""

from __future__ import annotations

import math
import os
import stat
from dataclasses import dataclass, field
from itertools import chain
from pathlib import Path, PurePosixPath
from typing import Callable, Iterable

from dcpctl.cycle_collector import paused_cycle_collector
from dcpctl.errors import (CheckpointNotFoundError, DataError, IncompleteCheckpointError,
                           UnsafePathError)
from dcpctl.format.checkpoint.problems import Problem, Rule, problems_error
from dcpctl.format.codecs.zstd_blocks import ZSTD_MAGIC
from dcpctl.format.dtypes import DType
from dcpctl.format.file_names import (DATA_FILE_SUFFIX, HF_INDEX_FILE_NAME, METADATA_FILE_NAME,
                                      METADATA_TEMPORARY_FILE_NAME, SHA256SUMS_FILE_NAME,
                                      is_plain_file_name, rank_metadata_file_name)
from dcpctl.format.checkpoint.hf_storage import (check_index, hf_storage_files,
                                                 hf_storage_metadata, refuse_unconsolidated_save)
from dcpctl.format.checkpoint.rank_metadata import (Replica, first_rank_lacking_metadata,
                                                    left_by_a_larger_save, merged_rank_metadata,
                                                    rank_metadata_names)
from dcpctl.format.metadata.reading import read_metadata
from dcpctl.format.metadata.records import (CheckpointMetadata, ChunkMetadata, StorageInfo,
                                            TensorMetadata)
from dcpctl.format.torch_save.zip_records import LOCAL_SIGNATURE
from dcpctl.storage.local import NotARegularFileError
from dcpctl.storage.objects import ObjectInfo, ObjectPath
from dcpctl.storage.paths import StoragePath, open_ranged, storage_path
from dcpctl.wording import counted

TORCH_SAVE = "torch_save"
SAFETENSORS = "safetensors"


@dataclass
class TensorEntry:
    """A tensor of the checkpoint: fqn, dtype, full shape and its chunks, each joined with the
    storage of its bytes (`chunk.storage`, None where the metadata lacks it)."""

    fqn: str
    dtype: DType
    shape: tuple[int, ...]
    chunks: list[ChunkMetadata]
    nbytes: int = 0
    """Logical size of the full tensor in bytes."""
    stored_bytes: int = 0
    """Bytes its chunks occupy in the data files."""


@dataclass
class ObjectEntry:
    """A non-tensor entry (a pickled Python object) and where it is stored."""

    fqn: str
    storage: StorageInfo | None


@dataclass
class DataFile:
    """A data file the metadata refers to: its size, how its items are serialized, how many
    items it holds and where the last of them ends (the item that ends there: last_fqn)."""

    name: str
    size_bytes: int | None
    """None when the file is missing."""
    regular: bool = True
    """False for a FIFO, a device or a directory where a data file should be."""
    serialization: str = TORCH_SAVE
    item_count: int = 0
    end_bytes: int = 0
    last_fqn: str = ""
    items_apart: bool = True
    """Whether each item the metadata places in the file starts at or past the end of every
    item listed before it: then no two of them share a byte, as in every file torch writes."""


@dataclass
class Checkpoint:
    """A checkpoint directory (local, or a prefix in an object store) read through its
    metadata; no tensor data is loaded."""

    path: StoragePath
    metadata: CheckpointMetadata
    tensors: list[TensorEntry] = field(default_factory=list)
    objects: list[ObjectEntry] = field(default_factory=list)
    files: dict[str, DataFile] = field(default_factory=dict)
    listing: dict[str, ObjectInfo] | None = field(default=None, repr=False)
    """For a checkpoint in an object store: every object under its prefix, from one listing."""
    hf_storage: bool = False
    """Whether torch's HuggingFaceStorageWriter wrote it (hf_storage.py): its metadata is read
    from its safetensors files, and it has no `.metadata`."""
    rank_metadata: list[str] = field(default_factory=list)
    """The ranks' own metadata files it is read from where it was saved with
    use_collectives=False and has no `.metadata` (rank_metadata.py), lowest rank first."""
    replicas: list[Replica] = field(default_factory=list, repr=False)
    """Of one read from its ranks' own metadata: the items a rank saved that a lower rank saved
    too (rank_metadata.py), which no data is read from but verify and checksum check."""
    joined_one_to_one: bool = False
    """Whether every chunk and object was joined with a storage entry of its key, and every
    storage entry with one of them (_collect_entries): then none lacks storage and no entry is
    an orphan."""
    _checked_paths: dict[str, StoragePath] = field(default_factory=dict, repr=False)

    def data_path(self, relative_path: str) -> StoragePath:
        """The path of a data file named in the metadata, refused if it escapes the directory
        or is one of the checkpoint's own files (`.metadata`, SHA256SUMS)."""
        path = self._checked_paths.get(relative_path)
        if path is None:
            if PurePosixPath(relative_path).parts[:1] in _NOT_DATA_FILE_PATHS:
                raise UnsafePathError(f"metadata names data file {relative_path!r}, which is one "
                                      "of the checkpoint's own files, not a data file",
                                      path=self.path)
            path = self._checked_paths[relative_path] = resolve_inside(self.path, relative_path)
        return path


# What no data file may be called: the checkpoint's own files, whose bytes are not items.
_NOT_DATA_FILE_PATHS = frozenset({(METADATA_FILE_NAME,), (METADATA_TEMPORARY_FILE_NAME,),
                                  (SHA256SUMS_FILE_NAME,)})


def resolve_inside(directory: StoragePath, relative_path: str) -> StoragePath:
    """`directory/relative_path`, refused unless it is a plain file name (is_plain_file_name:
    a path below the directory, printable, written one way; it may hold directories), and
    locally if it links outside the directory."""
    if not is_plain_file_name(relative_path):
        raise UnsafePathError(f"metadata names data file {relative_path!r}, which is not a "
                              "plain path inside the checkpoint directory (printable, no "
                              "`..`, no `\\`, no empty or `.` part)", path=directory)
    candidate = directory / relative_path
    if isinstance(directory, ObjectPath):
        return candidate  # no links in an object store: the name is the whole story
    real_path_inside(directory, relative_path)
    return candidate


def real_path_inside(directory: Path, relative_path: str) -> Path:
    """Where `directory/relative_path` really is, through any links, refused (UnsafePathError)
    unless inside the directory or in its hub cache repository's blobs: open this path, not
    the name, to read what was checked."""
    real_directory = os.path.realpath(directory)
    real_candidate = os.path.realpath(directory / relative_path)
    if (os.path.commonpath([real_directory, real_candidate]) != real_directory
            and not _in_its_hub_cache_blobs(real_directory, real_candidate)):
        raise UnsafePathError(f"{relative_path!r} resolves to {real_candidate}, outside the "
                              "checkpoint directory (a symlink out?)", path=directory)
    return Path(real_candidate)


def regular_file_inside(directory: Path, name: str) -> Path:
    """The regular file a name of a local checkpoint directory holds: its own path, or the
    real path of the file its link leads to where a data file's link may lead
    (real_path_inside: open this path, as no link, to read what was checked); else
    FileNotFoundError (nothing there), UnsafePathError (a link out) or another OSError."""
    path = directory / name
    if stat.S_ISLNK(os.lstat(path).st_mode):
        path = real_path_inside(directory, name)  # resolved once: what is checked is opened
    if not stat.S_ISREG(os.lstat(path).st_mode):
        raise NotARegularFileError(directory / name)
    return path


def holds_a_regular_file(directory: Path, name: str) -> bool:
    """Whether regular_file_inside finds the regular file a name stands for (nothing there, a
    FIFO, a dangling link or a link out: no)."""
    try:
        regular_file_inside(directory, name)
    except (OSError, UnsafePathError):
        return False
    return True


def _in_its_hub_cache_blobs(real_directory: str, real_candidate: str) -> bool:
    """Whether a checkpoint in huggingface_hub's cache (`REPO/snapshots/REVISION/...`, every
    file a symlink to `REPO/blobs/HASH`) links real_candidate into its own repository's blobs:
    a real directory beside its snapshots, not a link out of the tree."""
    parts = Path(real_directory).parts
    if "snapshots" not in parts[:-1]:
        return False
    repository = Path(*parts[:len(parts) - 1 - parts[::-1].index("snapshots")])
    blobs = repository / "blobs"
    return not os.path.islink(blobs) and os.path.dirname(real_candidate) == str(blobs)


def open_checkpoint(path: str | os.PathLike | StoragePath, check_files: bool = True
                    ) -> Checkpoint:
    """Read a checkpoint's metadata and data file sizes; with check_files, refuse missing or
    truncated files. In an object store this is one listing and one read of `.metadata`."""
    directory = storage_path(path)
    if isinstance(directory, ObjectPath):
        listing = directory.store.list_tree(directory.key, pin_current=True)  # read anew
        hf_files, rank_files = _check_is_checkpoint_prefix(directory, listing)
    else:
        listing = None
        hf_files, rank_files = _check_is_checkpoint_directory(directory)
    replicas: list[Replica] = []
    with paused_cycle_collector():
        if hf_files:
            metadata = hf_storage_metadata(directory, hf_files,
                                           _file_sizes(directory, listing, hf_files))
            check_index(directory, metadata)
        elif rank_files:
            _file_sizes(directory, listing, rank_files)  # like every file of it, inside it
            metadata, replicas = merged_rank_metadata(directory, rank_files)
        else:
            resolve_inside(directory, METADATA_FILE_NAME)  # like every file of it, inside it
            metadata = read_metadata(directory)
        checkpoint = Checkpoint(directory, metadata, listing=listing, hf_storage=bool(hf_files),
                                rank_metadata=rank_files, replicas=replicas)
        _collect_entries(checkpoint)
    if check_files:
        problems = find_file_problems(checkpoint)
        if problems:
            raise problems_error(problems, directory)
    return checkpoint


def _check_is_checkpoint_directory(directory: Path) -> tuple[list[str], list[str]]:
    """Refuse what is no checkpoint; the files the metadata of one without `.metadata` is
    read from (_refuse_unless_checkpoint)."""
    if not directory.exists():
        raise CheckpointNotFoundError("no such file or directory", path=directory)
    if not directory.is_dir():
        raise CheckpointNotFoundError("not a directory; a DCP checkpoint is a directory holding "
                                      ".metadata and .distcp files", path=directory)
    return _refuse_unless_checkpoint(directory, lambda name: (directory / name).exists(),
                                     lambda: any(directory.glob(f"*{DATA_FILE_SUFFIX}")),
                                     lambda: os.listdir(directory))


def _check_is_checkpoint_prefix(directory: ObjectPath, listing: dict[str, ObjectInfo]
                                ) -> tuple[list[str], list[str]]:
    if not listing:
        raise CheckpointNotFoundError("no objects under this prefix", path=directory)
    return _refuse_unless_checkpoint(
        directory, listing.__contains__,
        lambda: any(name.endswith(DATA_FILE_SUFFIX) for name in listing), lambda: listing)


def _refuse_unless_checkpoint(directory: StoragePath, holds: Callable[[str], bool],
                              holds_data_files: Callable[[], bool],
                              names: Callable[[], Iterable[str]]
                              ) -> tuple[list[str], list[str]]:
    """Refuse a directory (or prefix) without `.metadata`, saying what it looks like, unless
    torch's HuggingFaceStorageWriter wrote it, or a save with use_collectives=False: then the
    files its metadata is read from, (its safetensors files (hf_storage.py), []) or ([], its
    ranks' own metadata files (rank_metadata.py)); ([], []) with `.metadata`."""
    if holds(METADATA_FILE_NAME):
        return [], []
    listed = list(names())
    rank_files = rank_metadata_names(listed)
    if rank_files:
        lacking = first_rank_lacking_metadata(listed, rank_files)
        if lacking is not None:  # as ls and prune (ops/runs/layouts.py) tell it
            other_reading = left_by_a_larger_save(lacking, rank_files)
            raise IncompleteCheckpointError(
                f"incomplete checkpoint saved with use_collectives=False: rank {lacking} has "
                f"not written its {rank_metadata_file_name(lacking)} (a save still running, or "
                "one that died before finishing" + (f"; {other_reading}: move the files of the "
                                                    "ranks without metadata away to read it"
                                                    if other_reading else "") + ")",
                path=directory)
        return [], rank_files
    if holds(METADATA_TEMPORARY_FILE_NAME) or holds_data_files():
        raise IncompleteCheckpointError(
            f"incomplete checkpoint: data files but no {METADATA_FILE_NAME} (a save still "
            "running, or one that died before finishing)", path=directory)
    hf_files = hf_storage_files(listed)
    if hf_files:
        return hf_files, []
    if holds(HF_INDEX_FILE_NAME):
        raise DataError(f"holds {HF_INDEX_FILE_NAME} of a Hugging Face safetensors checkpoint "
                        "but no .safetensors file beside it", path=directory)
    refuse_unconsolidated_save(directory, f"not a DCP checkpoint: no {METADATA_FILE_NAME}")
    below = sorted(name for name in {name.partition("/")[0] for name in listed}
                   if holds(f"{name}/{METADATA_FILE_NAME}"))
    hint = (f"; it holds checkpoints ({', '.join(below[:3])}{', ...' if len(below) > 3 else ''})"
            ": give one of them, or list them with `dcpctl ls`" if below else "")
    raise CheckpointNotFoundError(f"not a DCP checkpoint: no {METADATA_FILE_NAME}{hint}",
                                  path=directory)


def _file_sizes(directory: StoragePath, listing: dict[str, ObjectInfo] | None,
                names: list[str]) -> dict[str, int]:
    """The sizes of files a checkpoint's metadata is read from, refused unless regular files
    inside the directory."""
    if listing is not None:
        return {name: listing[name].size for name in names}
    sizes = {}
    for name in names:
        status = resolve_inside(directory, name).stat()
        if not stat.S_ISREG(status.st_mode):
            raise DataError("is not a regular file", path=directory / name)
        sizes[name] = status.st_size
    return sizes


def _file_status(checkpoint: Checkpoint, relative_path: str) -> tuple[int | None, bool]:
    """A data file's size (None: missing) and whether it is a regular file."""
    if checkpoint.listing is not None:
        info = checkpoint.listing.get(relative_path)
        return (None, True) if info is None else (info.size, True)
    try:
        status = checkpoint.data_path(relative_path).stat()
    except FileNotFoundError:
        return None, True
    return status.st_size, stat.S_ISREG(status.st_mode)


def _collect_entries(checkpoint: Checkpoint) -> None:
    """The tensors and objects of the metadata, each chunk and object joined with its storage
    entry, and the data files those entries name."""
    stored_by_fqn, first_tensor_items = _scan_storage(checkpoint)
    storage_by_key: dict | None = None  # built only for tensors _join_in_order cannot join
    entries_joined = 0  # storage entries joined one to one, in the fqns' own order
    all_joined_so_far = True  # each tensor and object so far joined with all its entries
    for fqn, entry in checkpoint.metadata.state_dict_metadata.items():
        stored = stored_by_fqn.get(fqn, ())
        if isinstance(entry, TensorMetadata):
            stored_bytes = _join_in_order(entry.chunks, stored)
            if stored_bytes is None:
                if storage_by_key is None:
                    storage_by_key = {(key.fqn, key.offset): info for key, info
                                      in checkpoint.metadata.storage_data.items()}
                stored_bytes = _join_by_key(fqn, entry.chunks, storage_by_key)
                all_joined_so_far = False
            else:
                entries_joined += len(stored)
            dtype = entry.properties.dtype
            nbytes = math.prod(entry.size) * dtype.itemsize
            checkpoint.tensors.append(
                TensorEntry(fqn, dtype, entry.size, entry.chunks, nbytes, stored_bytes))
        else:
            checkpoint.objects.append(ObjectEntry(fqn, next(
                (info for offset, info in stored if offset is None), None)))
            if len(stored) == 1 and stored[0][0] is None:
                entries_joined += 1
            else:
                all_joined_so_far = False
    # stored_by_fqn holds each entry once, under its key's fqn: every one of them was joined
    # when as many were joined as there are
    checkpoint.joined_one_to_one = all_joined_so_far and entries_joined == len(
        checkpoint.metadata.storage_data or ())
    chunk_nbytes = _chunk_nbytes_of(checkpoint, first_tensor_items)
    for name, (_, info) in first_tensor_items.items():
        checkpoint.files[name].serialization = _detect_serialization(checkpoint, info,
                                                                     chunk_nbytes.get(name))
    for name, (info, nbytes) in _first_replicated_tensors(checkpoint, first_tensor_items).items():
        checkpoint.files[name].serialization = _detect_serialization(checkpoint, info, nbytes)


def _first_replicated_tensors(checkpoint: Checkpoint, first_tensor_items: dict
                              ) -> dict[str, tuple[StorageInfo, int | None]]:
    """Of each data file that holds tensor replicas alone (rank_metadata.py: a rank that
    saved only what a lower rank saved too), the first one's storage and its chunk's bytes,
    which tell how the file's items are serialized."""
    firsts: dict[str, tuple[StorageInfo, int | None]] = {}
    for replica in checkpoint.replicas:
        name = replica.storage.relative_path
        if replica.chunk is None or name in first_tensor_items or name in firsts:
            continue
        entry = replica.tensor or checkpoint.metadata.state_dict_metadata.get(replica.key.fqn)
        nbytes = (math.prod(replica.chunk.sizes) * entry.properties.dtype.itemsize
                  if isinstance(entry, TensorMetadata) else None)
        firsts[name] = (replica.storage, nbytes)
    return firsts


def _scan_storage(checkpoint: Checkpoint
                  ) -> tuple[dict[str, list[tuple[tuple | None, StorageInfo]]],
                             dict[str, tuple[str, StorageInfo]]]:
    """One pass over the storage entries: each fqn's (key offsets, entry) in the order the
    metadata lists them, and each data file they name, with its item count and where its last
    item ends (into checkpoint.files); and each file's first tensor item, which tells how its
    items are serialized."""
    stored_by_fqn: dict[str, list[tuple[tuple | None, StorageInfo]]] = {}
    first_tensor_items: dict[str, tuple[str, StorageInfo]] = {}
    for key, info in (checkpoint.metadata.storage_data or {}).items():
        fqn = key.fqn
        stored = stored_by_fqn.get(fqn)
        if stored is None:
            stored = stored_by_fqn[fqn] = []
        stored.append((key.offset, info))
        _count_item(checkpoint, fqn, info)
        if key.offset is not None and info.relative_path not in first_tensor_items:
            first_tensor_items[info.relative_path] = (fqn, info)
    for replica in checkpoint.replicas:
        # listed after the file's other items: the overlap check sorts its items
        _count_item(checkpoint, replica.key.fqn, replica.storage).items_apart = False
    return stored_by_fqn, first_tensor_items


def _count_item(checkpoint: Checkpoint, fqn: str, info: StorageInfo) -> DataFile:
    """Count an item into the data file that holds it (checkpoint.files), which it adds."""
    data_file = checkpoint.files.get(info.relative_path)
    if data_file is None:
        checkpoint.data_path(info.relative_path)  # refuses a path that escapes
        data_file = checkpoint.files[info.relative_path] = DataFile(
            info.relative_path, *_file_status(checkpoint, info.relative_path))
    data_file.item_count += 1
    if info.offset < data_file.end_bytes:
        data_file.items_apart = False
    end = info.offset + info.length
    if end > data_file.end_bytes:
        data_file.end_bytes, data_file.last_fqn = end, fqn
    return data_file


def _join_in_order(chunks: list[ChunkMetadata], stored: list) -> int | None:
    """Give each chunk its storage entry where the fqn's entries list the chunks' offsets in
    the chunks' own order, as torch writes them (both follow the ranks' plans); the bytes
    stored, or None (nothing joined) where they do not line up. Keys are unique, so a chunk
    joined here gets the entry of its key, as _join_by_key would give it."""
    if len(stored) != len(chunks):
        return None
    for chunk, (offset, _) in zip(chunks, stored):
        if offset != chunk.offsets:
            return None
    stored_bytes = 0
    for chunk, (_, info) in zip(chunks, stored):
        chunk.storage = info
        stored_bytes += info.length
    return stored_bytes


def _join_by_key(fqn: str, chunks: list[ChunkMetadata], storage_by_key: dict) -> int:
    """Give each chunk the storage entry of its key (None where there is none); the bytes
    stored."""
    stored_bytes = 0
    for chunk in chunks:
        chunk.storage = storage = storage_by_key.get((fqn, chunk.offsets))
        if storage is not None:
            stored_bytes += storage.length
    return stored_bytes


def _detect_serialization(checkpoint: Checkpoint, info: StorageInfo, chunk_nbytes: int | None
                          ) -> str:
    """How a file's items are stored, told by its first tensor item (info; its chunk's bytes:
    chunk_nbytes). An item stored untransformed in exactly its chunk's bytes is a SAFETENSORS
    file's (torch.save wraps every tensor in an archive of its own, always longer than the
    tensor's bytes): no data is read. Otherwise the item's first bytes tell: torch.save items
    start with a zip (or zstd) header, SAFETENSORS files with a header length followed by
    JSON."""
    if not info.transform_descriptors and info.length == chunk_nbytes:
        return SAFETENSORS
    data_file = checkpoint.files[info.relative_path]
    if not info.transform_descriptors or data_file.size_bytes is None or not data_file.regular:
        return TORCH_SAVE
    with open_ranged(checkpoint.data_path(info.relative_path)) as reader:
        head = reader.read(info.offset, 9)
    if head[:4] in (LOCAL_SIGNATURE, ZSTD_MAGIC):
        return TORCH_SAVE
    if len(head) == 9 and head[8:9] == b"{":
        return SAFETENSORS
    return TORCH_SAVE


def _chunk_nbytes_of(checkpoint: Checkpoint, items: dict[str, tuple[str, StorageInfo]]
                     ) -> dict[str, int]:
    """The bytes of the chunk each of items (file name: its fqn and storage entry) is the
    storage of, by file name (none where no chunk has it). Each tensor's chunks are looked at
    once, however many files' items it has: a thousand files whose first items are chunks of
    one tensor of a thousand chunks are a thousand steps, not a million."""
    names_by_fqn: dict[str, dict[int, str]] = {}
    for name, (fqn, info) in items.items():
        names_by_fqn.setdefault(fqn, {})[id(info)] = name
    nbytes: dict[str, int] = {}
    for fqn, names in names_by_fqn.items():
        entry = checkpoint.metadata.state_dict_metadata.get(fqn)
        if not isinstance(entry, TensorMetadata):
            continue
        for chunk in entry.chunks:
            name = names.get(id(chunk.storage))
            if name is not None and name not in nbytes:
                nbytes[name] = math.prod(chunk.sizes) * entry.properties.dtype.itemsize
    return nbytes


def find_file_problems(checkpoint: Checkpoint) -> list[Problem]:
    """Data files the metadata names that are missing, or end before an item that it places
    in them does, with the fqns of the items affected."""
    # each wrong file's rule and the byte its items must end before (-1: every item)
    wrong: dict[str, tuple[str, int]] = {}
    for name, data_file in checkpoint.files.items():
        if data_file.size_bytes is None:
            wrong[name] = (Rule.MISSING_FILE, -1)
        elif not data_file.regular:
            wrong[name] = (Rule.NOT_REGULAR_FILE, -1)
        elif data_file.end_bytes > data_file.size_bytes:
            wrong[name] = (Rule.TRUNCATED, data_file.size_bytes)
    if not wrong:
        return []
    affected = _fqns_past(checkpoint, {name: past for name, (_, past) in wrong.items()})
    problems = []
    for name, (rule, _) in sorted(wrong.items()):
        data_file, fqns = checkpoint.files[name], affected[name]
        if rule == Rule.MISSING_FILE:
            problems.append(Problem(rule, f"missing data file, named by "
                                    f"{counted(data_file.item_count, 'item')}", name,
                                    fqns=_distinct(fqns)))
        elif rule == Rule.NOT_REGULAR_FILE:
            problems.append(Problem(rule, "not a regular file (a FIFO, a device or a directory) "
                                    "where a data file should be", name, fqns=_distinct(fqns)))
        else:
            problems.append(Problem(rule, f"the file is {data_file.size_bytes} bytes, but "
                                    f"{counted(len(fqns), 'item')} end past it, the last (item "
                                    f"{data_file.last_fqn!r}) at byte {data_file.end_bytes}",
                                    name, data_file.size_bytes, data_file.end_bytes,
                                    _distinct(fqns)))
    return problems


def _fqns_past(checkpoint: Checkpoint, past_by_file: dict[str, int]) -> dict[str, list[str]]:
    """For each file of past_by_file, the fqn of each item in it that ends past the byte
    given, in storage order: one pass over the items, however many files are wrong (a
    checkpoint of a thousand ranks whose files are all missing has a million items)."""
    fqns: dict[str, list[str]] = {name: [] for name in past_by_file}
    replicas = ((replica.key, replica.storage) for replica in checkpoint.replicas)
    for key, info in chain(checkpoint.metadata.storage_data.items(), replicas):
        past = past_by_file.get(info.relative_path)
        if past is not None and info.offset + info.length > past:
            fqns[info.relative_path].append(key.fqn)
    return fqns


def _distinct(fqns: list[str]) -> tuple[str, ...]:
    return tuple(dict.fromkeys(fqns))

"""What a checkpoint holds, from its metadata and file sizes alone."""

from __future__ import annotations

import fnmatch
import os
import re
from collections import Counter
from itertools import chain
from operator import attrgetter
from dataclasses import dataclass, field, replace
from typing import Iterable

from dcpctl.cycle_collector import paused_cycle_collector
from dcpctl.format.checkpoint.hf_storage import describe_hf_storage
from dcpctl.format.checkpoint.problems import Problem
from dcpctl.format.checkpoint.rank_metadata import describe_rank_metadata
from dcpctl.format.checkpoint.side_files import saver_of_side_files, side_files_of
from dcpctl.format.checkpoint.view import (Checkpoint, DataFile, ObjectEntry, TensorEntry,
                                           find_file_problems, open_checkpoint)
from dcpctl.format.state_dict_layouts import describe_layout, is_optimizer_state
from dcpctl.format.codecs.names import describe_codec
from dcpctl.format.file_names import natural_order, world_size_of_rank_files
from dcpctl.ops.inspection.json_text import inspect_report_json_text
from dcpctl.storage.locks import locked_checkpoint


@dataclass
class InspectReport:
    """Everything `dcpctl inspect` shows; `to_json` gives the stable machine-readable form."""

    path: str
    version: str | None
    filter: str | None
    tensors: list[TensorEntry]
    objects: list[ObjectEntry]
    files: list[DataFile]
    layout: str = ""
    """Whose state dict it is and where its model weights are (state_dict_layouts.py)."""
    nbytes: int = 0
    stored_bytes: int = 0
    nbytes_by_dtype: dict[str, int] = field(default_factory=dict)
    nbytes_by_top_level_key: dict[str, int] = field(default_factory=dict)
    stored_bytes_by_top_level_key: dict[str, int] = field(default_factory=dict)
    compression: dict[str, int] = field(default_factory=dict)
    codecs_by_file: dict[str, dict[str, int]] = field(default_factory=dict)
    problems: list[Problem] = field(default_factory=list)
    """Data files the metadata names that are missing, not regular files, or end before the
    items in them: what the metadata and file sizes show wrong (verify reads the rest)."""

    def to_json(self) -> dict:
        """A JSON-ready dict with stable keys."""
        with paused_cycle_collector():
            return {**self.summary_json(),
                    "tensors": [_tensor_json(tensor) for tensor in self.tensors],
                    "objects": [_object_json(entry) for entry in self.objects],
                    "files": self.files_json()}

    def to_json_text(self) -> str:
        """`to_json()` encoded compactly, as `json.dumps(..., separators=(",", ":"))` would."""
        with paused_cycle_collector():
            return inspect_report_json_text(self.summary_json(), self.tensors, self.objects,
                                            self.files_json())

    def summary_json(self) -> dict:
        """The keys of `to_json()` that come before its tensors, objects and files."""
        return {
            "path": self.path,
            "version": self.version,
            "layout": self.layout,
            "filter": self.filter,
            "tensor_count": len(self.tensors),
            "object_count": len(self.objects),
            "nbytes": self.nbytes,
            "stored_bytes": self.stored_bytes,
            "file_bytes": sum(f.size_bytes or 0 for f in self.files),
            "nbytes_by_dtype": self.nbytes_by_dtype,
            "nbytes_by_top_level_key": self.nbytes_by_top_level_key,
            "stored_bytes_by_top_level_key": self.stored_bytes_by_top_level_key,
            "compression": self.compression,
            "problems": [problem.to_json() for problem in self.problems],
        }

    def files_json(self) -> list[dict]:
        """The `files` of `to_json()`."""
        return [{"name": f.name, "bytes": f.size_bytes, "serialization": f.serialization,
                 "items": f.item_count, "codecs": self.codecs_by_file[f.name]}
                for f in self.files]


def _tensor_json(tensor: TensorEntry) -> dict:
    chunks = []
    for chunk in tensor.chunks:
        storage = chunk.storage
        chunks.append({
            "offsets": list(chunk.offsets), "sizes": list(chunk.sizes),
            "file": storage.relative_path if storage else None,
            "offset": storage.offset if storage else None,
            "length": storage.length if storage else None,
            "transforms": list(storage.transform_descriptors or ()) if storage else [],
        })
    return {"fqn": tensor.fqn, "dtype": tensor.dtype.name, "shape": list(tensor.shape),
            "chunks": chunks, "nbytes": tensor.nbytes, "stored_bytes": tensor.stored_bytes}


def _object_json(entry: ObjectEntry) -> dict:
    storage = entry.storage
    return {"fqn": entry.fqn, "file": storage.relative_path if storage else None,
            "stored_bytes": storage.length if storage else 0,
            "transforms": list(storage.transform_descriptors or ()) if storage else []}


def inspect_checkpoint(path: str | os.PathLike, fqn_glob: str | None = None) -> InspectReport:
    """Summarize a checkpoint; `fqn_glob` keeps only tensors and objects whose fqn matches.
    Data files that are missing or cut short are no reason not to show what the metadata says:
    they are the report's problems. Held shared while read: a checkpoint another dcpctl is
    rewriting is refused at once, not read half old, half new."""
    with paused_cycle_collector(), locked_checkpoint(path, exclusive=False):
        checkpoint = open_checkpoint(path, check_files=False)
        report = build_inspect_report(checkpoint, fqn_glob)
        report.problems = find_file_problems(checkpoint)
        return report


def build_inspect_report(checkpoint: Checkpoint, fqn_glob: str | None = None) -> InspectReport:
    """The InspectReport of an already opened checkpoint."""
    report = InspectReport(
        path=str(checkpoint.path), version=checkpoint.metadata.version, filter=fqn_glob,
        tensors=_matching(checkpoint.tensors, fqn_glob),
        objects=_matching(checkpoint.objects, fqn_glob),
        files=sorted(checkpoint.files.values(), key=lambda f: natural_order(f.name)),
        layout=describe_layout((tensor.fqn for tensor in checkpoint.tensors),
                               (entry.fqn for entry in checkpoint.objects),
                               checkpoint.path.name, _saver(checkpoint))
        + _sharding_api(checkpoint),
    )
    _add_size_totals(report)
    report.compression = _count_by_codec(_transforms_used(report).items())
    report.codecs_by_file = _codecs_by_file(checkpoint)
    if fqn_glob is not None:
        _keep_files_of_matching_items(report)
    return report


def _keep_files_of_matching_items(report: InspectReport) -> None:
    """Under --filter: the files that hold an item matching it, each with the matching
    items alone counted (its size stays the file's)."""
    by_file = _transforms_by_file(_report_storages(report))
    report.files = [replace(data_file, item_count=sum(count for _, count in by_file[
        data_file.name])) for data_file in report.files if data_file.name in by_file]
    report.codecs_by_file = {name: _count_by_codec(counts) for name, counts in by_file.items()}


def _sharding_api(checkpoint: Checkpoint) -> str:
    """`; FSDP2/DTensor chunks` or `; FSDP1/ShardedTensor chunks`, where the chunks tell.

    Among tensors with fewer rows than the ranks that saved them, a DTensor (FSDP2, tensor
    parallel) leaves an empty chunk for the ranks past its rows; a ShardedTensor (FSDP1's
    SHARDED_STATE_DICT) leaves them out. So with no empty chunk anywhere, a tensor split into
    one-row chunks, or a parameter's optimizer state in one chunk where other tensors are
    split (a buffer has no optimizer state; DDP splits nothing), tell FSDP1."""
    world_size = world_size_of_rank_files(checkpoint.files) or 1
    split_somewhere = one_row_split = optimizer_state_whole = False
    for tensor in checkpoint.tensors:
        chunks = tensor.chunks
        split_somewhere = split_somewhere or len(chunks) > 1
        if not tensor.shape or tensor.shape[0] >= world_size:
            continue
        if len(chunks) > 1 and any(not chunk.sizes[0] for chunk in chunks):  # not just empty
            return "; FSDP2/DTensor chunks"
        whole_rows = all(tuple(chunk.sizes[1:]) == tensor.shape[1:] for chunk in chunks)
        one_row_split = one_row_split or (len(chunks) > 1 and whole_rows and all(
            chunk.sizes[0] == 1 for chunk in chunks))
        optimizer_state_whole = optimizer_state_whole or (
            len(chunks) == 1 and is_optimizer_state(tensor.fqn))
    if one_row_split or (split_somewhere and optimizer_state_whole):
        return "; FSDP1/ShardedTensor chunks"
    return ""


def _saver(checkpoint: Checkpoint) -> str | None:
    """Who wrote the checkpoint, where its files tell."""
    if checkpoint.hf_storage:
        return describe_hf_storage(checkpoint.files)
    if checkpoint.rank_metadata:
        return describe_rank_metadata(checkpoint.rank_metadata)
    saver = saver_of_side_files(side_files_of(checkpoint))
    if saver is None and checkpoint.metadata.mcore_data is not None:
        return "Megatron-Core torch_dist"
    return saver


def _matching(entries: list, fqn_glob: str | None) -> list:
    if fqn_glob is None:
        return list(entries)
    # What fnmatch.fnmatchcase does for each name, with the pattern compiled once.
    matches = re.compile(fnmatch.translate(fqn_glob)).match
    return [entry for entry in entries if matches(entry.fqn)]


def _add_size_totals(report: InspectReport) -> None:
    """Logical and stored bytes, in all, by dtype and by top-level key (`model` of
    `model.layers.0.weight`; objects count 0 logical bytes)."""
    nbytes_by_dtype: dict[str, int] = {}
    nbytes_by_key: dict[str, int] = {}
    stored_bytes_by_key: dict[str, int] = {}
    for tensor in report.tensors:
        key, dtype, nbytes = tensor.fqn.partition(".")[0], tensor.dtype.name, tensor.nbytes
        nbytes_by_key[key] = nbytes_by_key.get(key, 0) + nbytes
        stored_bytes_by_key[key] = stored_bytes_by_key.get(key, 0) + tensor.stored_bytes
        nbytes_by_dtype[dtype] = nbytes_by_dtype.get(dtype, 0) + nbytes
    for entry in report.objects:
        key = entry.fqn.partition(".")[0]
        nbytes_by_key.setdefault(key, 0)
        stored_bytes = entry.storage.length if entry.storage else 0
        stored_bytes_by_key[key] = stored_bytes_by_key.get(key, 0) + stored_bytes
    report.nbytes_by_dtype = nbytes_by_dtype
    report.nbytes_by_top_level_key = nbytes_by_key
    report.stored_bytes_by_top_level_key = stored_bytes_by_key
    report.nbytes = sum(nbytes_by_key.values())
    report.stored_bytes = sum(stored_bytes_by_key.values())


def _transforms_used(report: InspectReport) -> Counter[tuple[str, ...] | None]:
    """How many of the report's items use each list of transform descriptors."""
    # counted by loops in C: a checkpoint can hold millions of chunks
    return Counter(map(_TRANSFORMS, _report_storages(report)))


def _report_storages(report: InspectReport) -> Iterable:
    """The storage entries of the report's items (its tensors' chunks, its objects)."""
    chunks = chain.from_iterable(map(_CHUNKS, report.tensors))
    return filter(None, chain(map(_STORAGE, chunks), map(_STORAGE, report.objects)))


def _transforms_by_file(infos: Iterable) -> dict[str, list]:
    """The (transform descriptors, item count) pairs of each file the storage entries name."""
    infos = list(infos)
    by_file: dict[str, list] = {}
    for (name, transforms), count in Counter(zip(map(_FILE, infos),
                                                 map(_TRANSFORMS, infos))).items():
        by_file.setdefault(name, []).append((transforms, count))
    return by_file


_CHUNKS, _STORAGE = attrgetter("chunks"), attrgetter("storage")
_TRANSFORMS, _FILE = attrgetter("transform_descriptors"), attrgetter("relative_path")


def _count_by_codec(transforms_counts: Iterable[tuple[tuple[str, ...] | None, int]]
                    ) -> dict[str, int]:
    """Item counts by codec name, most used first."""
    by_codec: Counter[str] = Counter()
    for transforms, count in transforms_counts:
        by_codec[describe_codec(transforms)] += count
    return dict(by_codec.most_common())


def _codecs_by_file(checkpoint: Checkpoint) -> dict[str, dict[str, int]]:
    infos = (checkpoint.metadata.storage_data or {}).values()
    if set(map(_TRANSFORMS, infos)) <= {None}:  # nothing transformed: a file's items, counted
        return {name: _count_by_codec([(None, data_file.item_count)] if data_file.item_count
                                      else [])  # as the checkpoint was opened
                for name, data_file in checkpoint.files.items()}
    by_file = _transforms_by_file(infos)
    return {name: _count_by_codec(by_file.get(name, [])) for name in checkpoint.files}

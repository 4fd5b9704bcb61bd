"""What a checkpoint holds, from its metadata and file sizes alone."""

from __future__ import annotations

import fnmatch
import os
import re
from collections import Counter
from dataclasses import asdict, dataclass, field

from dcpctl.format.checkpoint import Checkpoint, open_checkpoint
from dcpctl.format.codecs import describe_codec
from dcpctl.format.records import StorageInfo


@dataclass
class ChunkReport:
    """One stored chunk: where it sits in the tensor and in which file bytes."""

    offsets: list[int]
    sizes: list[int]
    file: str | None
    offset: int | None
    length: int | None
    transforms: list[str]


@dataclass
class TensorReport:
    """One tensor: its fqn, dtype, shape, chunks, logical and stored sizes."""

    fqn: str
    dtype: str
    shape: list[int]
    chunks: list[ChunkReport]
    nbytes: int
    stored_bytes: int


@dataclass
class ObjectReport:
    """One non-tensor entry and its stored size."""

    fqn: str
    file: str | None
    stored_bytes: int
    transforms: list[str]


@dataclass
class FileReport:
    """One data file: size, serialization, how many items and which codecs it holds."""

    name: str
    bytes: int | None
    serialization: str
    items: int
    codecs: dict[str, int]


@dataclass
class InspectReport:
    """Everything `dcpctl inspect` shows; `to_json` gives the stable machine-readable form."""

    path: str
    version: str | None
    filter: str | None
    tensors: list[TensorReport]
    objects: list[ObjectReport]
    files: list[FileReport]
    nbytes: int = 0
    stored_bytes: int = 0
    nbytes_by_dtype: dict[str, int] = field(default_factory=dict)
    nbytes_by_top_level_key: dict[str, int] = field(default_factory=dict)
    stored_bytes_by_top_level_key: dict[str, int] = field(default_factory=dict)
    compression: dict[str, int] = field(default_factory=dict)

    def to_json(self) -> dict:
        """A JSON-ready dict with stable keys."""
        report = asdict(self)
        report["tensor_count"] = len(self.tensors)
        report["object_count"] = len(self.objects)
        report["file_bytes"] = sum(f.bytes or 0 for f in self.files)
        return report


def _stored_length(storage: StorageInfo | None) -> int:
    return storage.length if storage is not None else 0


def inspect_checkpoint(path: str | os.PathLike, fqn_glob: str | None = None) -> InspectReport:
    """Summarize a checkpoint; `fqn_glob` keeps only tensors and objects whose fqn matches."""
    checkpoint = open_checkpoint(path)
    return build_inspect_report(checkpoint, fqn_glob)


def build_inspect_report(checkpoint: Checkpoint, fqn_glob: str | None = None) -> InspectReport:
    """The InspectReport of an already opened checkpoint."""
    def selected(fqn: str) -> bool:
        return fqn_glob is None or fnmatch.fnmatchcase(fqn, fqn_glob)

    report = InspectReport(
        path=str(checkpoint.path), version=checkpoint.metadata.version, filter=fqn_glob,
        tensors=[], objects=[], files=_file_reports(checkpoint),
    )
    compression: Counter[str] = Counter()
    for tensor in checkpoint.tensors:
        if not selected(tensor.fqn):
            continue
        chunks = []
        for chunk in tensor.chunks:
            storage = chunk.storage
            transforms = list(storage.transform_descriptors or ()) if storage else []
            compression[describe_codec(transforms)] += 1
            chunks.append(ChunkReport(
                list(chunk.offsets), list(chunk.sizes),
                storage.relative_path if storage else None,
                storage.offset if storage else None,
                storage.length if storage else None, transforms))
        stored = sum(_stored_length(chunk.storage) for chunk in tensor.chunks)
        report.tensors.append(TensorReport(tensor.fqn, tensor.dtype.name, list(tensor.shape),
                                           chunks, tensor.nbytes, stored))
        _add_to_totals(report, tensor.fqn, tensor.nbytes, stored)
        report.nbytes_by_dtype[tensor.dtype.name] = (
            report.nbytes_by_dtype.get(tensor.dtype.name, 0) + tensor.nbytes)
    for entry in checkpoint.objects:
        if not selected(entry.fqn):
            continue
        storage = entry.storage
        transforms = list(storage.transform_descriptors or ()) if storage else []
        compression[describe_codec(transforms)] += 1
        report.objects.append(ObjectReport(entry.fqn, storage.relative_path if storage else None,
                                           _stored_length(storage), transforms))
        _add_to_totals(report, entry.fqn, 0, _stored_length(storage))
    report.compression = dict(compression.most_common())
    return report


def _add_to_totals(report: InspectReport, fqn: str, nbytes: int, stored_bytes: int) -> None:
    top_level_key = fqn.split(".", 1)[0]
    report.nbytes += nbytes
    report.stored_bytes += stored_bytes
    report.nbytes_by_top_level_key[top_level_key] = (
        report.nbytes_by_top_level_key.get(top_level_key, 0) + nbytes)
    report.stored_bytes_by_top_level_key[top_level_key] = (
        report.stored_bytes_by_top_level_key.get(top_level_key, 0) + stored_bytes)


def _file_reports(checkpoint: Checkpoint) -> list[FileReport]:
    codecs_by_file: dict[str, Counter[str]] = {name: Counter() for name in checkpoint.files}
    for info in (checkpoint.metadata.storage_data or {}).values():
        codecs_by_file[info.relative_path][describe_codec(info.transform_descriptors)] += 1
    return [
        FileReport(name, data_file.size_bytes, data_file.serialization, data_file.item_count,
                   dict(codecs_by_file[name].most_common()))
        for name, data_file in sorted(checkpoint.files.items(), key=lambda kv: _file_order(kv[0]))
    ]


def _file_order(name: str) -> tuple:
    """`__10_0.distcp` after `__2_0.distcp`: compare the numbers in a name as numbers."""
    return tuple(int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name))

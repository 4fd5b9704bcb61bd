"""What a checkpoint holds, from its metadata and file sizes alone."""

from __future__ import annotations

import fnmatch
import os
import re
from collections import Counter
from dataclasses import dataclass, field
from itertools import chain, compress, repeat
from operator import attrgetter, itemgetter
from typing import Iterable

from dcpctl.columns import sums_by_key
from dcpctl.format.checkpoint import Checkpoint, DataFile, ObjectEntry, TensorEntry, \
    open_checkpoint
from dcpctl.format.codec_names import describe_codec
from dcpctl.format.garbage_collection import paused_garbage_collection
from dcpctl.ops.inspect_json import inspect_report_json_text

_FQN, _DTYPE, _NAME, _CHUNKS = map(attrgetter, ("fqn", "dtype", "name", "chunks"))
_NBYTES, _STORED_BYTES, _STORAGE = map(attrgetter, ("nbytes", "stored_bytes", "storage"))
_RELATIVE_PATH, _TRANSFORMS = attrgetter("relative_path"), attrgetter("transform_descriptors")
_TOP_LEVEL_KEY = itemgetter(0)  # of fqn.partition("."): `model` of `model.layers.0.weight`


@dataclass
class InspectReport:
    """Everything `dcpctl inspect` shows; `to_json` gives the stable machine-readable form."""

    path: str
    version: str | None
    filter: str | None
    tensors: list[TensorEntry]
    objects: list[ObjectEntry]
    files: list[DataFile]
    nbytes: int = 0
    stored_bytes: int = 0
    nbytes_by_dtype: dict[str, int] = field(default_factory=dict)
    nbytes_by_top_level_key: dict[str, int] = field(default_factory=dict)
    stored_bytes_by_top_level_key: dict[str, int] = field(default_factory=dict)
    compression: dict[str, int] = field(default_factory=dict)
    codecs_by_file: dict[str, dict[str, int]] = field(default_factory=dict)

    def to_json(self) -> dict:
        """A JSON-ready dict with stable keys."""
        with paused_garbage_collection():
            return {**self.summary_json(),
                    "tensors": [_tensor_json(tensor) for tensor in self.tensors],
                    "objects": [_object_json(entry) for entry in self.objects],
                    "files": self.files_json()}

    def to_json_text(self) -> str:
        """`to_json()` encoded compactly, as `json.dumps(..., separators=(",", ":"))` would."""
        with paused_garbage_collection():
            return inspect_report_json_text(self)

    def summary_json(self) -> dict:
        """The keys of `to_json()` that come before its tensors, objects and files."""
        return {
            "path": self.path,
            "version": self.version,
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
    """Summarize a checkpoint; `fqn_glob` keeps only tensors and objects whose fqn matches."""
    with paused_garbage_collection():
        return build_inspect_report(open_checkpoint(path), fqn_glob)


def build_inspect_report(checkpoint: Checkpoint, fqn_glob: str | None = None) -> InspectReport:
    """The InspectReport of an already opened checkpoint."""
    report = InspectReport(
        path=str(checkpoint.path), version=checkpoint.metadata.version, filter=fqn_glob,
        tensors=_matching(checkpoint.tensors, fqn_glob),
        objects=_matching(checkpoint.objects, fqn_glob),
        files=sorted(checkpoint.files.values(), key=lambda f: _natural_order(f.name)),
    )
    _add_size_totals(report)
    chunk_storage = map(_STORAGE, chain.from_iterable(map(_CHUNKS, report.tensors)))
    object_storage = map(_STORAGE, report.objects)
    transforms_used = Counter(map(_TRANSFORMS, filter(None, chain(chunk_storage, object_storage))))
    report.compression = _count_by_codec(transforms_used.items())
    report.codecs_by_file = _codecs_by_file(checkpoint)
    return report


def _add_size_totals(report: InspectReport) -> None:
    """Logical and stored bytes, in all, by dtype and by top-level key (objects count as 0
    logical bytes)."""
    tensors, objects = report.tensors, report.objects
    tensor_nbytes = list(map(_NBYTES, tensors))
    object_stored_bytes = [entry.storage.length if entry.storage else 0 for entry in objects]
    top_level_keys = [*map(_TOP_LEVEL_KEY, map(str.partition, map(_FQN, tensors), repeat("."))),
                      *map(_TOP_LEVEL_KEY, map(str.partition, map(_FQN, objects), repeat(".")))]
    report.nbytes_by_dtype = sums_by_key(list(map(_NAME, map(_DTYPE, tensors))), tensor_nbytes)
    report.nbytes_by_top_level_key = sums_by_key(
        top_level_keys, [*tensor_nbytes, *repeat(0, len(objects))])
    report.stored_bytes_by_top_level_key = sums_by_key(
        top_level_keys, [*map(_STORED_BYTES, tensors), *object_stored_bytes])
    report.nbytes = sum(tensor_nbytes)
    report.stored_bytes = sum(report.stored_bytes_by_top_level_key.values())


def _matching(entries: list, fqn_glob: str | None) -> list:
    if fqn_glob is None:
        return list(entries)
    # What fnmatch.fnmatchcase does for one name, compiled once for all of them.
    matches = re.compile(fnmatch.translate(fqn_glob)).match
    return list(compress(entries, map(matches, map(_FQN, entries))))


def _count_by_codec(transforms_counts: Iterable[tuple[tuple[str, ...] | None, int]]
                    ) -> dict[str, int]:
    """Item counts by codec name, most used first."""
    by_codec: Counter[str] = Counter()
    for transforms, count in transforms_counts:
        by_codec[describe_codec(transforms)] += count
    return dict(by_codec.most_common())


def _codecs_by_file(checkpoint: Checkpoint) -> dict[str, dict[str, int]]:
    infos = (checkpoint.metadata.storage_data or {}).values()
    used = Counter(zip(map(_RELATIVE_PATH, infos), map(_TRANSFORMS, infos)))
    by_file: dict[str, list] = {name: [] for name in checkpoint.files}
    for (name, transforms), count in used.items():
        by_file[name].append((transforms, count))
    return {name: _count_by_codec(counts) for name, counts in by_file.items()}


def _natural_order(name: str) -> tuple:
    """`__10_0.distcp` after `__2_0.distcp`: compare the numbers in a name as numbers."""
    return tuple(int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name))

"""The JSON text of an InspectReport, written directly from the report.

`json.dumps(report.to_json(), separators=(",", ":"))` is the reference. For a checkpoint of a
hundred thousand tensors, building that dict takes longer than reading the metadata, so the
tensors and objects are written here with f-strings, and each distinct shape, offset list,
file name and dtype is encoded once. tests/ops/inspection/test_inspection.py holds both texts to
the same bytes.
"""

from __future__ import annotations

import json
from json.encoder import encode_basestring_ascii as json_string  # json.dumps' own, in C
from typing import Any, Callable, Hashable

from dcpctl.format.checkpoint.view import ObjectEntry, TensorEntry
from dcpctl.format.metadata.records import ChunkMetadata


def compact_json(value: Any) -> str:
    """`value` as compact JSON; what JSON cannot hold is written as its str()."""
    return json.dumps(value, separators=(",", ":"), default=str)


def inspect_report_json_text(summary: dict, tensors: list[TensorEntry],
                             objects: list[ObjectEntry], files: list[dict]) -> str:
    """The compact JSON text of an inspect report's dict (its summary keys, then `tensors`,
    `objects` and `files`), written from the entries without building their dicts."""
    objects_text = ",".join([_object_json(entry) for entry in objects])
    return "".join([compact_json(summary)[:-1], ',"tensors":[', _tensors_json(tensors),
                    '],"objects":[', objects_text, '],"files":', compact_json(files), "}"])


def _tensors_json(tensors: list[TensorEntry]) -> str:
    # Most tensors share their dtype, shape, chunk offsets and sizes and file names with many
    # others: `known` keeps the JSON of each (`known.get(value) or ...` looks it up, encoded
    # texts are never empty). Metadata checks leave only ints in shapes and offsets, so tuples
    # that compare equal are interchangeable; tuples and names never compare equal.
    known: dict = {}
    texts = []
    for tensor in tensors:
        chunks = ",".join([_chunk_json(chunk, known) for chunk in tensor.chunks])
        dtype, shape = tensor.dtype.name, tensor.shape
        texts.append(f'{{"fqn":{json_string(tensor.fqn)},'
                     f'"dtype":{known.get(dtype) or _learn(known, dtype, json_string)},'
                     f'"shape":{known.get(shape) or _learn(known, shape, _int_list_json)},'
                     f'"chunks":[{chunks}],"nbytes":{tensor.nbytes},'
                     f'"stored_bytes":{tensor.stored_bytes}}}')
    return ",".join(texts)


def _chunk_json(chunk: ChunkMetadata, known: dict) -> str:
    offsets, sizes, storage = chunk.offsets, chunk.sizes, chunk.storage
    layout = (f'{{"offsets":{known.get(offsets) or _learn(known, offsets, _int_list_json)},'
              f'"sizes":{known.get(sizes) or _learn(known, sizes, _int_list_json)}')
    if storage is None:
        return f'{layout},"file":null,"offset":null,"length":null,"transforms":[]}}'
    path, transforms = storage.relative_path, storage.transform_descriptors
    return (f'{layout},"file":{known.get(path) or _learn(known, path, json_string)},'
            f'"offset":{storage.offset},"length":{storage.length},'
            f'"transforms":{_transforms_json(transforms) if transforms else "[]"}}}')


def _learn(known: dict, value: Hashable, encode: Callable[[Any], str]) -> str:
    """encode(value), kept in `known` for the next time."""
    text = known[value] = encode(value)
    return text


def _int_list_json(values: tuple[int, ...]) -> str:
    return "[" + ",".join(map(str, values)) + "]"


def _transforms_json(transforms: tuple[str, ...] | None) -> str:
    return "[" + ",".join(map(json_string, transforms or ())) + "]"


def _object_json(entry: ObjectEntry) -> str:
    storage = entry.storage
    if storage is None:
        return f'{{"fqn":{json_string(entry.fqn)},"file":null,"stored_bytes":0,"transforms":[]}}'
    return (f'{{"fqn":{json_string(entry.fqn)},"file":{json_string(storage.relative_path)},'
            f'"stored_bytes":{storage.length},'
            f'"transforms":{_transforms_json(storage.transform_descriptors)}}}')

"""The JSON text of an InspectReport, assembled from whole columns of the report.

`json.dumps(report.to_json(), separators=(",", ":"))` is the reference. For a checkpoint of a
hundred thousand tensors, building that dict and encoding it takes longer than reading the
metadata, so the tensors and objects are written here with %-formats mapped over columns of
the report. tests/ops/test_inspect.py holds both texts to the same bytes.
"""

from __future__ import annotations

import json
from itertools import chain
from json.encoder import encode_basestring_ascii as json_string  # json.dumps' own, in C
from operator import attrgetter
from typing import TYPE_CHECKING, Any, Iterable

from dcpctl.columns import join_runs, map_distinct
from dcpctl.format.checkpoint import ObjectEntry, TensorEntry
from dcpctl.format.records import ChunkMetadata, StorageInfo

if TYPE_CHECKING:
    from dcpctl.ops.inspect import InspectReport

_OBJECT = '{"fqn":%s,"file":%s,"stored_bytes":%d,"transforms":%s}'
_FQN, _DTYPE, _NAME, _SHAPE, _CHUNKS = map(attrgetter, ("fqn", "dtype", "name", "shape",
                                                        "chunks"))
_NBYTES, _STORED_BYTES, _STORAGE_OF = map(attrgetter, ("nbytes", "stored_bytes", "storage"))
_OFFSETS, _SIZES, _RELATIVE_PATH = map(attrgetter, ("offsets", "sizes", "relative_path"))
_OFFSET, _LENGTH = attrgetter("offset"), attrgetter("length")
_TRANSFORMS = attrgetter("transform_descriptors")


def compact_json(value: Any) -> str:
    """`value` as compact JSON; what JSON cannot hold is written as its str()."""
    return json.dumps(value, separators=(",", ":"), default=str)


def inspect_report_json_text(report: InspectReport) -> str:
    """The compact JSON text of `report.to_json()`, without building that dict."""
    summary = compact_json(report.summary_json())
    return "".join([summary[:-1], ',"tensors":[', _tensors_json(report.tensors),
                    '],"objects":[', ",".join(map(_object_json, report.objects)),
                    '],"files":', compact_json(report.files_json()), "}"])


def _int_list_json(values: tuple[int, ...]) -> str:
    return "[" + ",".join(map(str, values)) + "]"


def _transforms_json(transforms: tuple[str, ...] | None) -> str:
    return "[" + ",".join(map(json_string, transforms or ())) + "]"


def _escaped(text: str) -> str:
    """text as a literal part of a %-format."""
    return text.replace("%", "%%")


# Most tensors share their dtype and shape with many others, and most chunks their offsets,
# sizes, file and transforms: each such combination becomes one %-format, holding all but the
# fqn and stored bytes of a tensor, or the byte range of a chunk. Metadata checks leave only
# ints in shapes, offsets and sizes, so combinations that compare equal are interchangeable.
def _tensor_format(dtype_shape_nbytes: tuple[str, tuple[int, ...], int]) -> str:
    dtype, shape, nbytes = dtype_shape_nbytes
    return (f'{{"fqn":%s,"dtype":{_escaped(json_string(dtype))},'
            f'"shape":{_int_list_json(shape)},"chunks":[%s],"nbytes":{nbytes},'
            '"stored_bytes":%d}')


def _chunk_format(layout: tuple[tuple[int, ...], tuple[int, ...], str, tuple | None]) -> str:
    offsets, sizes, relative_path, transforms = layout
    return (f'{{"offsets":{_int_list_json(offsets)},"sizes":{_int_list_json(sizes)},'
            f'"file":{_escaped(json_string(relative_path))},"offset":%d,"length":%d,'
            f'"transforms":{_escaped(_transforms_json(transforms))}}}')


def _tensors_json(tensors: list[TensorEntry]) -> str:
    chunk_lists = list(map(_CHUNKS, tensors))
    formats = map_distinct(_tensor_format, zip(map(_NAME, map(_DTYPE, tensors)),
                                               map(_SHAPE, tensors), map(_NBYTES, tensors)))
    chunk_texts = join_runs(",", _chunk_texts(list(chain.from_iterable(chunk_lists))),
                            list(map(len, chunk_lists)))
    values = zip(map(json_string, map(_FQN, tensors)), chunk_texts,
                 map(_STORED_BYTES, tensors))
    return ",".join(map(str.__mod__, formats, values))


def _chunk_texts(chunks: list[ChunkMetadata]) -> Iterable[str]:
    storages = list(map(_STORAGE_OF, chunks))
    if not all(storages):  # chunks the metadata gives no storage: rare, done one by one
        return list(map(_chunk_text, chunks, storages))
    layouts = zip(map(_OFFSETS, chunks), map(_SIZES, chunks), map(_RELATIVE_PATH, storages),
                  map(_TRANSFORMS, storages))
    return map(str.__mod__, map_distinct(_chunk_format, layouts),
               zip(map(_OFFSET, storages), map(_LENGTH, storages)))


def _chunk_text(chunk: ChunkMetadata, storage: StorageInfo | None) -> str:
    if storage is not None:
        layout = (chunk.offsets, chunk.sizes, storage.relative_path,
                  storage.transform_descriptors)
        return _chunk_format(layout) % (storage.offset, storage.length)
    return (f'{{"offsets":{_int_list_json(chunk.offsets)},"sizes":{_int_list_json(chunk.sizes)},'
            '"file":null,"offset":null,"length":null,"transforms":[]}')


def _object_json(entry: ObjectEntry) -> str:
    storage = entry.storage
    if storage is None:
        return _OBJECT % (json_string(entry.fqn), "null", 0, "[]")
    return _OBJECT % (json_string(entry.fqn), json_string(storage.relative_path),
                      storage.length, _transforms_json(storage.transform_descriptors))

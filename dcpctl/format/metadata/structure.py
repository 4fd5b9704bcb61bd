"""Checking that unpickled `.metadata` has the shape of DCP metadata.

Metadata can list millions of chunks. One pass over the records checks their types and
gathers the tuples and numbers they hold; builtins that loop in C (map, chain, min, sets of
types) then check those as whole columns. Only when something breaks a rule does the check
walk the entries again one by one, to name the entry and the rule.
"""

from __future__ import annotations

import dataclasses
import operator
import reprlib
from itertools import chain, starmap
from operator import add, gt
from pathlib import PurePosixPath, PureWindowsPath
from typing import Any, Callable, Iterable

from dcpctl.errors import MetadataError
from dcpctl.format.dtypes import TORCH_INDEX_LIMIT, DType, fits_in_torch
from dcpctl.format.metadata.records import (BytesMetadata, CheckpointMetadata, ChunkMetadata,
                                            MetadataIndex, StorageInfo, StorageMeta, TensorMetadata,
                                            TensorProperties)

_INT_TYPE_SET = {int}

Fail = Callable[[str], MetadataError]
# Values named in messages come from the file: shown shortened, and never recursed into deeply.
_REPR = reprlib.Repr()
_REPR.maxlevel, _REPR.maxstring, _REPR.maxother, _REPR.maxtuple, _REPR.maxlist = 2, 80, 80, 8, 8


def _shown(value: Any) -> str:
    return _REPR.repr(value)


def check_metadata_structure(loaded: Any, source: str) -> None:
    """Raise MetadataError unless `loaded` has the shape of DCP metadata; normalizes in place."""

    def fail(rule: str) -> MetadataError:
        return MetadataError(rule, path=source)

    try:
        _check_records(loaded, fail)
    except AttributeError as error:  # a record that the pickle never gave its fields
        raise fail(f"a metadata record lacks a field ({error})") from None


def _check_records(loaded: Any, fail: Fail) -> None:
    if not isinstance(loaded, CheckpointMetadata):
        raise fail(f"holds a {type(loaded).__name__}, not DCP Metadata")
    _check_attributes(loaded, fail)
    if loaded.version is not None and type(loaded.version) is not str:
        raise fail(f"version is a {type(loaded.version).__name__}, not a string")
    entries = loaded.state_dict_metadata
    if not isinstance(entries, dict):
        raise fail("state_dict_metadata is not a dict")
    _refuse_shared_entries(entries, fail)
    if not _entries_look_sound(entries):
        _check_entries_one_by_one(entries, fail)
    if loaded.storage_data is None:
        loaded.storage_data = {}
    storage_data = loaded.storage_data
    if not isinstance(storage_data, dict):
        raise fail("storage_data is not a dict")
    if not _storage_looks_sound(storage_data, entries):
        for key, info in storage_data.items():
            _check_storage_entry(key, info, entries, fail)
    _normalize_transforms(storage_data.values())
    planner_data = loaded.planner_data
    if _planner_data_looks_sound(planner_data):
        if planner_data:
            _refuse_misnamed_key_paths(planner_data, fail)
    elif _holds_a_key_path(planner_data):
        raise fail("planner_data maps fqns to their key paths, as torch's planner does, but not "
                   "each fqn (a name) to a key path of names and indices")
    else:  # a custom planner's own data
        _check_plain_value(planner_data, "planner_data", fail)
    if loaded.mcore_data is not None:
        if type(loaded.mcore_data) is not dict:
            raise fail(f"mcore_data is a {type(loaded.mcore_data).__name__}, not a dict")
        _check_plain_value(loaded.mcore_data, "mcore_data", fail)
    if loaded.storage_meta is not None:
        if type(loaded.storage_meta) is not StorageMeta:
            raise fail(f"storage_meta is a {type(loaded.storage_meta).__name__}, not torch's "
                       "StorageMeta")
        _check_plain_value(vars(loaded.storage_meta), "storage_meta", fail)
        if type(loaded.storage_meta.modules) is not list or not _only(
                loaded.storage_meta.modules, str):
            raise fail("storage_meta's modules are not a list of names")


_METADATA_FIELDS = frozenset(field.name for field in dataclasses.fields(CheckpointMetadata))
_MEGATRON_SAVE_PLANS = "all_local_plans"


def _check_attributes(loaded: CheckpointMetadata, fail: Fail) -> None:
    """Drop Megatron-Core's save plans (see CheckpointMetadata.mcore_data); refuse any other
    attribute torch's Metadata does not have: a rewrite would drop what a loader may need."""
    attributes = vars(loaded)
    attributes.pop(_MEGATRON_SAVE_PLANS, None)
    unknown = sorted(map(str, attributes.keys() - _METADATA_FIELDS))
    if unknown:
        raise fail(f"Metadata has attributes {_shown(unknown)}, which neither torch nor a "
                   "trainer dcpctl knows writes; refusing rather than dropping them")


def _refuse_shared_entries(entries: dict, fail: Fail) -> None:
    """A pickle can hand one record to many keys at no cost (a memo reference each): a
    million fqns sharing a tensor entry of a million chunks would cost a trillion steps to
    check and as much to write back. DCP metadata never shares them, so it is refused: what is
    left to look at grows with the file."""
    tensors = [entry for entry in entries.values() if type(entry) is TensorMetadata]
    if (len(set(map(id, tensors))) != len(tensors)
            or len({id(tensor.chunks) for tensor in tensors}) != len(tensors)):
        raise fail("gives several fqns one tensor entry or chunk list, which DCP metadata "
                   "never does")


_PLAIN_SCALARS = (type(None), bool, int, float, str, bytes, DType, PurePosixPath, PureWindowsPath)
_PLAIN_CONTAINERS = (tuple, list, dict, set, frozenset)
_MAX_PLAIN_DEPTH = 32


def _planner_data_looks_sound(planner_data: Any) -> bool:
    """The planner_data torch writes, checked in C: fqn -> a key path of strings and ints."""
    if type(planner_data) is not dict:
        return planner_data is None
    paths = planner_data.values()
    return (_only(planner_data, str) and set(map(type, paths)) <= {tuple, list}
            and set(map(type, chain.from_iterable(paths))) <= {str, int}
            and len(set(map(id, paths))) == len(paths))


def _holds_a_key_path(planner_data: Any) -> bool:
    """Whether planner_data is a dict giving some fqn its key path, as torch's planner gives
    each one: the rest of it must then be key paths too, not a custom planner's data."""
    return type(planner_data) is dict and any(
        type(path) in (tuple, list) and all(type(key) in (str, int) for key in path)
        and ".".join(map(str, path)) == fqn for fqn, path in planner_data.items())


def _refuse_misnamed_key_paths(planner_data: dict, fail: Fail) -> None:
    """torch's planner (flatten_state_dict) names each entry by its key path, joined with dots;
    a key path that joins to another name (one damaged string) would nest its entry under a
    name the state dict never had, where torch's own loaders refuse it."""
    for fqn, key_path in planner_data.items():
        joined = ".".join(map(str, key_path))
        if joined != fqn:
            raise fail(f"planner_data gives {_shown(fqn)} the key path {_shown(list(key_path))}, "
                       f"which names {_shown(joined)}: torch names each entry by its key path "
                       "joined with dots")


def _check_plain_value(value: Any, what: str, fail: Fail) -> None:
    """Refuse, in `what`, anything but plain data nested at most _MAX_PLAIN_DEPTH deep, and a
    container met twice (writing shared containers back would repeat each at every use)."""
    seen: set[int] = set()
    pending = [(value, 0)]
    while pending:
        item, depth = pending.pop()
        kind = type(item)
        if kind in _PLAIN_SCALARS:
            continue
        if kind not in _PLAIN_CONTAINERS:
            raise fail(f"{what} holds a {kind.__name__}, which is not plain data")
        if depth >= _MAX_PLAIN_DEPTH or id(item) in seen:
            raise fail(f"{what} nests deeper than {_MAX_PLAIN_DEPTH} levels or holds one "
                       "container twice")
        seen.add(id(item))
        members = [*item.keys(), *item.values()] if kind is dict else item
        pending += [(member, depth + 1) for member in members]


def _only(values: Iterable, kind: type) -> bool:
    return set(map(type, values)) <= {kind}


def _entries_look_sound(entries: dict) -> bool:
    sizes, offsets, extents, tensor_size_of_chunks = [], [], [], []
    shapes = set()
    for entry in entries.values():
        kind = type(entry)
        if kind is TensorMetadata:
            properties, size, chunks = entry.properties, entry.size, entry.chunks
            if (type(properties) is not TensorProperties or type(properties.dtype) is not DType
                    or type(size) is not tuple or type(chunks) is not list):
                return False
            sizes.append(size)
            shapes.add((size, properties.dtype.itemsize))
            for chunk in chunks:
                if type(chunk) is not ChunkMetadata:
                    return False
                offsets.append(chunk.offsets)
                extents.append(chunk.sizes)
                tensor_size_of_chunks.append(size)
        elif kind is not BytesMetadata:
            return False
    return (_only(entries, str)
            and _chunks_look_sound(sizes, offsets, extents, tensor_size_of_chunks)
            and all(starmap(fits_in_torch, shapes)))


def _chunks_look_sound(sizes: list, offsets: list, extents: list,
                       tensor_size_of_chunks: list) -> bool:
    if not (_only(offsets, tuple) and _only(extents, tuple)
            and _only(chain.from_iterable(chain(sizes, offsets, extents)), int)):
        return False
    # Only ints from here on, so equal layouts are interchangeable (unlike 1, 1.0 and True):
    # each distinct (offsets, sizes, tensor size) is checked once.
    layouts = set(zip(offsets, extents, tensor_size_of_chunks))
    return (min(chain.from_iterable(set(sizes)), default=0) >= 0
            and all(starmap(_chunk_lies_inside, layouts)))


def _chunk_lies_inside(offsets: tuple, extents: tuple, size: tuple) -> bool:
    return (len(offsets) == len(extents) == len(size)
            and min(chain(offsets, extents), default=0) >= 0
            and not any(map(gt, map(add, offsets, extents), size)))


def _storage_looks_sound(storage_data: dict, entries: dict) -> bool:
    fqns, key_offsets, paths, byte_numbers, descriptors = [], [], [], [], []
    for key, info in storage_data.items():
        if type(key) is not MetadataIndex or type(info) is not StorageInfo:
            return False
        fqns.append(key.fqn)
        key_offsets.append(key.offset)
        paths.append(info.relative_path)
        byte_numbers.append(info.offset)
        byte_numbers.append(info.length)
        descriptors.append(info.transform_descriptors)
    return (_only(fqns, str) and all(map(entries.__contains__, fqns))
            and set(map(type, key_offsets)) <= {type(None), tuple}
            and _only(chain.from_iterable(filter(None, key_offsets)), int)
            and _only(paths, str) and all(paths)
            and _only(byte_numbers, int) and min(byte_numbers, default=0) >= 0
            and max(byte_numbers, default=0) < TORCH_INDEX_LIMIT
            and set(map(type, descriptors)) <= {type(None), list, tuple}
            and _only(chain.from_iterable(filter(None, descriptors)), str))


def _check_entries_one_by_one(entries: dict, fail: Fail) -> None:
    for fqn, entry in entries.items():
        if not isinstance(fqn, str):
            raise fail(f"state_dict_metadata key {_shown(fqn)} is not a string")
        if isinstance(entry, TensorMetadata):
            _check_tensor_entry(fqn, entry, fail)
        elif not isinstance(entry, BytesMetadata):
            raise fail(f"entry {_shown(fqn)} is a {type(entry).__name__}, not tensor or bytes "
                       "metadata")


def _check_tensor_entry(fqn: str, entry: TensorMetadata, fail: Fail) -> None:
    properties = entry.properties
    if type(properties) is not TensorProperties or type(properties.dtype) is not DType:
        raise fail(f"tensor {_shown(fqn)} has no dtype")
    size = entry.size
    if type(size) is not tuple:
        raise fail(f"tensor {_shown(fqn)} has size {_shown(size)}, not a tuple of sizes")
    rank = len(size)
    chunks = entry.chunks
    if type(chunks) is not list:
        raise fail(f"tensor {_shown(fqn)} has no chunk list")
    numbers = list(size)
    for chunk in chunks:
        if (type(chunk) is not ChunkMetadata or type(chunk.offsets) is not tuple
                or type(chunk.sizes) is not tuple or len(chunk.offsets) != rank
                or len(chunk.sizes) != rank):
            raise fail(f"tensor {_shown(fqn)} has a chunk that is not {rank}-d offsets and sizes")
        numbers += chunk.offsets
        numbers += chunk.sizes
    if numbers and (not set(map(type, numbers)) <= _INT_TYPE_SET or min(numbers) < 0):
        raise fail(f"tensor {_shown(fqn)} has a size, offset or chunk size that is not a "
                   "non-negative integer")
    if not fits_in_torch(size, properties.dtype.itemsize):
        raise fail(f"tensor {_shown(fqn)} of size {_shown(list(size))} is past what torch can "
                   "hold (sizes, elements and bytes below 2**63)")
    for chunk in chunks:
        if any(map(operator.gt, map(operator.add, chunk.offsets, chunk.sizes), size)):
            raise fail(f"tensor {_shown(fqn)}: chunk at {list(chunk.offsets)} of size "
                       f"{list(chunk.sizes)} lies outside the tensor's size {list(size)}")


def _check_storage_entry(key: Any, info: Any, entries: dict, fail: Fail) -> None:
    if not isinstance(key, MetadataIndex) or not isinstance(key.fqn, str):
        raise fail(f"storage_data key {_shown(key)} is not a MetadataIndex")
    if key.fqn not in entries:
        raise fail(f"storage_data names {_shown(key.fqn)}, which state_dict_metadata lacks")
    if key.offset is not None and (type(key.offset) is not tuple
                                   or not all(type(number) is int for number in key.offset)):
        raise fail(f"storage_data key for {_shown(key.fqn)} has offset {_shown(key.offset)}, "
                   "not a tuple of integers")
    if not isinstance(info, StorageInfo):
        raise fail(f"storage_data for {_shown(key.fqn)} is a {type(info).__name__}, not "
                   "_StorageInfo")
    if not isinstance(info.relative_path, str) or not info.relative_path:
        raise fail(f"storage_data for {_shown(key.fqn)} has no file name")
    if (type(info.offset) is not int or type(info.length) is not int
            or min(info.offset, info.length) < 0
            or max(info.offset, info.length) >= TORCH_INDEX_LIMIT):
        raise fail(f"storage_data for {_shown(key.fqn)} has byte range "
                   f"offset={_shown(info.offset)} length={_shown(info.length)}, not two "
                   "non-negative integers below 2**63")
    descriptors = info.transform_descriptors
    if descriptors is not None and (not isinstance(descriptors, (list, tuple)) or not all(
            isinstance(name, str) for name in descriptors)):
        raise fail(f"storage_data for {_shown(key.fqn)} has transforms {_shown(descriptors)}, "
                   "not a list of names")


def _normalize_transforms(infos: Iterable[StorageInfo]) -> None:
    """Transform descriptors as tuples, an empty list as None (no transform)."""
    for info in infos:
        if info.transform_descriptors is not None:
            info.transform_descriptors = tuple(info.transform_descriptors) or None

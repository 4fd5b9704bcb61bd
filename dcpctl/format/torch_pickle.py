"""Pickle dcpctl's metadata records as torch's own classes, without importing torch.

Importing torch.distributed.checkpoint costs seconds and hundreds of MB; writing `.metadata`
needs only the names of torch's classes. The C pickler insists that a global it writes can be
imported, so the records are pickled (protocol 4, as torch does) against stand-in modules
whose names are random strings exactly as long as the real module names, and each stand-in
name is then replaced by the real one in the output: equal lengths keep the pickle's frames
valid. A false match would need a string of the metadata equal to a name drawn at random when
this module loads, after the checkpoint being rewritten was written. Objects are created with
`copyreg._reconstructor(cls, object, None)`, which both torch's unpickling and dcpctl's
allowlist reader accept (the pickler refuses NEWOBJ for a class other than the object's own).
"""

from __future__ import annotations

import copyreg
import io
import pickle
import secrets
import sys
import types
from pathlib import PurePosixPath, PureWindowsPath
from typing import Any

from dcpctl.format.garbage_collection import paused_garbage_collection
from dcpctl.format.records import (BytesMetadata, CheckpointMetadata, ChunkMetadata, ItemKey,
                                   StorageInfo, StorageMeta, TensorMetadata, TensorProperties)

_PROTOCOL = 4
_SHORT_STRING_OPCODE = b"\x8c"
_REAL_MODULES = {
    "metadata": "torch.distributed.checkpoint.metadata",
    "filesystem": "torch.distributed.checkpoint.filesystem",
    "torch": "torch",
    "serialization": "torch.serialization",
    "pathlib": "pathlib",
}


def _stand_in_module(short_name: str) -> types.ModuleType:
    length = len(_REAL_MODULES[short_name])
    module = types.ModuleType(("_" + secrets.token_hex(length))[:length])
    sys.modules[module.__name__] = module
    return module


_MODULES = {short: _stand_in_module(short) for short in _REAL_MODULES}


def _stand_in(short_module: str, name: str) -> Any:
    """An object that pickles as the global `<real module>.<name>`."""
    module = _MODULES[short_module]
    if not hasattr(module, name):
        stand_in = type(name, (), {"__module__": module.__name__, "__qualname__": name})
        setattr(module, name, stand_in)
    return getattr(module, name)


def _new_object(short_module: str, class_name: str, state: Any) -> tuple:
    return (copyreg._reconstructor, (_stand_in(short_module, class_name), object, None), state)


def _size(values: tuple[int, ...]) -> tuple:
    return (_stand_in("torch", "Size"), (tuple(values),))


class _TorchNamePickler(pickle.Pickler):
    """Writes each record the way pickling torch's class would."""

    def reducer_override(self, obj: Any) -> Any:
        kind = type(obj)
        if kind is StorageInfo:
            state = {"relative_path": obj.relative_path, "offset": obj.offset,
                     "length": obj.length}
            if obj.transform_descriptors is not None:
                state["transform_descriptors"] = list(obj.transform_descriptors)
            return _new_object("filesystem", "_StorageInfo", state)
        if kind is ItemKey:
            offset = None if obj.offset is None else _SizeValue(obj.offset)
            return _new_object("metadata", "MetadataIndex",
                               {"fqn": obj.fqn, "offset": offset, "index": obj.index})
        if kind is ChunkMetadata:
            return _new_object("metadata", "ChunkStorageMetadata",
                               {"offsets": _SizeValue(obj.offsets), "sizes": _SizeValue(obj.sizes)})
        if kind is _SizeValue:
            return _size(obj.values)
        if kind is TensorMetadata:
            return _new_object("metadata", "TensorStorageMetadata",
                               {"properties": obj.properties, "size": _SizeValue(obj.size),
                                "chunks": obj.chunks})
        if kind is TensorProperties:
            layout = (_stand_in("serialization", "_get_layout"), (f"torch.{obj.layout}",))
            memory_format = (_stand_in("metadata", "_MEM_FORMAT_ENCODING"),
                             (obj.memory_format_code,))
            # A class object pickles as its global: `torch.<dtype>` after the renaming.
            state = (_stand_in("torch", obj.dtype.name), _Reduced(layout), obj.requires_grad,
                     _Reduced(memory_format), obj.pin_memory)
            return _new_object("metadata", "TensorProperties", state)
        if kind is BytesMetadata:
            return _new_object("metadata", "BytesStorageMetadata", {})
        if kind is StorageMeta:
            return _new_object("metadata", "StorageMeta", {
                "checkpoint_id": obj.checkpoint_id, "save_id": obj.save_id,
                "load_id": obj.load_id, "modules": list(obj.modules)})
        if kind is CheckpointMetadata:
            return _new_object("metadata", "Metadata", {
                "state_dict_metadata": obj.state_dict_metadata, "planner_data": obj.planner_data,
                "storage_data": obj.storage_data, "storage_meta": obj.storage_meta,
                "version": obj.version})
        if kind in (PurePosixPath, PureWindowsPath):
            real = "PosixPath" if kind is PurePosixPath else "WindowsPath"
            return (_stand_in("pathlib", real), tuple(obj.parts))
        if kind is _Reduced:
            return obj.reduction
        return NotImplemented


class _SizeValue:
    """A torch.Size to be."""

    def __init__(self, values: tuple[int, ...]) -> None:
        self.values = values


class _Reduced:
    """A value given directly as its pickle reduction."""

    def __init__(self, reduction: tuple) -> None:
        self.reduction = reduction


def pickle_as_torch(metadata: CheckpointMetadata) -> bytes:
    """The `.metadata` bytes for these records, loadable by torch's own unpickling."""
    buffer = io.BytesIO()
    with paused_garbage_collection():
        _TorchNamePickler(buffer, protocol=_PROTOCOL).dump(metadata)
    data = buffer.getvalue()
    for short_name, real_name in _REAL_MODULES.items():
        stand_in = _MODULES[short_name].__name__
        prefix = _SHORT_STRING_OPCODE + bytes([len(real_name)])
        data = data.replace(prefix + stand_in.encode(), prefix + real_name.encode())
    return data

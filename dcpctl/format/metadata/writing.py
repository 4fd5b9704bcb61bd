"""Pickle dcpctl's metadata records as torch's own classes, without importing torch.

Importing torch.distributed.checkpoint costs seconds and hundreds of MB; writing `.metadata`
needs only the names of torch's classes. So the pickle (protocol 4, as torch writes it) is
emitted opcode by opcode: each record as pickling torch's dataclass makes it (`NEWOBJ` of the
class, then `BUILD` with its state), sizes as `torch.Size(tuple)`, dtypes as `torch.<name>`
globals. Only globals and strings are memoized, by value: memory stays at the output's size plus
one entry per distinct string, where the C pickler would pin every object it wrote until the
end, hundreds of MB for a checkpoint with a hundred thousand chunks.

A `.metadata` of a million chunks holds a million chunk records and as many storage records,
each the same opcodes around a few numbers and memoized names. Once a record's names are
memoized, its fixed opcodes are joined into templates (_PickleWriter.template), and each
run of sizes or offsets is encoded once (_PickleWriter.encoded_ints): a record costs a few
appends, not a call per field. The bytes are the same either way.
"""

from __future__ import annotations

import pickle
import struct
from pathlib import PurePosixPath, PureWindowsPath
from typing import Any, Callable

from dcpctl.errors import MetadataError
from dcpctl.format.dtypes import DType
from dcpctl.format.metadata.records import (BytesMetadata, CheckpointMetadata, ChunkMetadata,
                                            MetadataIndex, StorageInfo, StorageMeta, TensorMetadata,
                                            TensorProperties)

_PROTOCOL = 4
_BATCH = 1000  # items per APPENDS / SETITEMS / ADDITEMS, as the pickle module writes them
_METADATA = "torch.distributed.checkpoint.metadata"
_FILESYSTEM = "torch.distributed.checkpoint.filesystem"
_PACK_INT = struct.Struct("<i").pack
_PACK_UINT = struct.Struct("<I").pack
_PACK_UINT64 = struct.Struct("<Q").pack
_PACK_FLOAT = struct.Struct(">d").pack
_SMALL_INTS = [pickle.BININT1 + bytes([value]) for value in range(256)]
_NEW_OBJECT = pickle.EMPTY_TUPLE + pickle.NEWOBJ
_BEGIN_FIELDS = _NEW_OBJECT + pickle.EMPTY_DICT + pickle.MARK
_END_FIELDS = pickle.SETITEMS + pickle.BUILD
_END_SIZE = pickle.TUPLE + pickle.TUPLE1 + pickle.REDUCE
_SIZE = ("torch", "Size")
_INT_TYPE_ONLY = frozenset({int})
_MAX_ENCODED_INT_RUNS = 1 << 16


class _PickleWriter:
    """Appends protocol-4 opcodes for plain values and metadata records to a buffer."""

    def __init__(self) -> None:
        self.out = bytearray(pickle.PROTO + bytes([_PROTOCOL]))
        self._memo_gets: dict[Any, bytes] = {}  # by key: the opcode that gets its memo slot
        self._open_containers: set[int] = set()
        self._templates: dict[str, tuple[bytes, ...]] = {}
        self._encoded_int_runs: dict[tuple[int, ...], bytes] = {}

    def template(self, name: str, parts: tuple[tuple[Any, ...], ...]
                 ) -> tuple[bytes, ...] | None:
        """The template called name: each part's opcodes joined, where a part is a sequence
        of opcodes (bytes) and memo keys (a string, or a (module, name) global), each key
        standing for the get of its memo slot. None until every key has a memo slot (written
        once by the general path); then kept."""
        made = self._templates.get(name)
        if made is None:
            gets = self._memo_gets
            if not all(isinstance(item, bytes) or item in gets for part in parts for item in part):
                return None
            made = self._templates[name] = tuple(
                b"".join(item if isinstance(item, bytes) else gets[item] for item in part)
                for part in parts)
        return made

    def encoded_ints(self, values: tuple[int, ...]) -> bytes | None:
        """The opcodes of integers values, as size() writes them between MARK and TUPLE; None
        unless values is a tuple of ints. Runs met again (every tensor's chunks start at the
        same few offsets) are encoded once; at most _MAX_ENCODED_INT_RUNS are kept."""
        if type(values) is not tuple or not _INT_TYPE_ONLY.issuperset(map(type, values)):
            return None  # a list is no key; and no 1.0 or True may stand for 1
        runs = self._encoded_int_runs
        encoded = runs.get(values)
        if encoded is None:
            if len(runs) >= _MAX_ENCODED_INT_RUNS:
                runs.clear()
            encoded = runs[values] = b"".join(map(_integer_opcodes, values))
        return encoded

    def _get_memoized(self, key: Any) -> bool:
        """Emit a get of key's memo slot and return True; False when key has none yet."""
        get = self._memo_gets.get(key)
        if get is None:
            return False
        self.out += get
        return True

    def _memoize(self, key: Any) -> None:
        index = len(self._memo_gets)
        self._memo_gets[key] = (pickle.BINGET + bytes([index]) if index < 256
                                else pickle.LONG_BINGET + _PACK_UINT(index))
        self.out += pickle.MEMOIZE

    def global_name(self, module: str, name: str) -> None:
        key = (module, name)
        if not self._get_memoized(key):
            self.string(module)
            self.string(name)
            self.out += pickle.STACK_GLOBAL
            self._memoize(key)

    def string(self, text: str) -> None:
        get = self._memo_gets.get(text)
        if get is not None:
            self.out += get
            return
        encoded = text.encode("utf-8", "surrogatepass")
        if len(encoded) < 256:
            self.out += pickle.SHORT_BINUNICODE + bytes([len(encoded)])
        else:
            self.out += pickle.BINUNICODE8 + _PACK_UINT64(len(encoded))
        self.out += encoded
        self._memoize(text)

    def integer(self, value: int) -> None:
        self.out += _integer_opcodes(value)

    def size(self, values: tuple[int, ...]) -> None:
        """torch.Size(values)."""
        self.global_name(*_SIZE)
        self.out += pickle.MARK
        encoded = self.encoded_ints(values)
        if encoded is not None:
            self.out += encoded
        else:  # written as it is; reading it back refuses it
            for value in values:
                self.value(value)
        self.out += _END_SIZE

    def begin_fields(self, module: str, class_name: str) -> None:
        """Start an instance of module.class_name as pickling a dataclass makes it (NEWOBJ,
        then its fields as a dict for BUILD); write each field as a string key and a value,
        then call end_fields."""
        self.global_name(module, class_name)
        self.out += _BEGIN_FIELDS

    def end_fields(self) -> None:
        self.out += _END_FIELDS

    def fields(self, module: str, class_name: str, values: dict[str, Any]) -> None:
        """An instance of module.class_name whose fields hold plain values or records."""
        self.begin_fields(module, class_name)
        for key, field_value in values.items():
            self.string(key)
            self.value(field_value)
        self.end_fields()

    def size_or_none(self, values: tuple[int, ...] | None) -> None:
        if values is None:
            self.out += pickle.NONE
        else:
            self.size(values)

    def value(self, value: Any) -> None:
        """Any value a `.metadata` can hold: plain data, records, dtypes and pure paths."""
        _value_writer(value)(self, value)

    def container(self, value: Any, empty: bytes, items: list, end: bytes) -> None:
        """A list, dict or set: `empty`, then MARK-delimited batches of items, each closed by
        `end`."""
        self._enter(value)
        self.out += empty
        writers = _VALUE_WRITERS
        for start in range(0, len(items), _BATCH):
            self.out += pickle.MARK
            for item in items[start:start + _BATCH]:  # value(item), spared a call
                (writers.get(type(item)) or _value_writer(item))(self, item)
            self.out += end
        self._open_containers.discard(id(value))

    def marked(self, value: Any, items: list, end: bytes) -> None:
        """A tuple or frozenset: MARK, its items, `end`."""
        self._enter(value)
        self.out += pickle.MARK
        for item in items:
            self.value(item)
        self.out += end
        self._open_containers.discard(id(value))

    def _enter(self, value: Any) -> None:
        """Refuse a container that contains itself (a pickle can build one); the caller leaves
        it by discarding its id. A failure anywhere ends the whole pickle, so no
        try/finally is needed."""
        if id(value) in self._open_containers:
            raise MetadataError("metadata holds a container that contains itself")
        self._open_containers.add(id(value))


def _value_writer(value: Any) -> Callable[[_PickleWriter, Any], None]:
    write = _VALUE_WRITERS.get(type(value))
    if write is None:
        raise MetadataError(f"cannot write a {type(value).__name__} into .metadata")
    return write


def _integer_opcodes(value: int) -> bytes:
    if 0 <= value < 256:
        return _SMALL_INTS[value]
    if -(1 << 31) <= value < (1 << 31):
        return pickle.BININT + _PACK_INT(value)
    encoded = pickle.encode_long(value)
    return pickle.LONG1 + bytes([len(encoded)]) + encoded


_STORAGE_INFO_PARTS = (((_FILESYSTEM, "_StorageInfo"), _BEGIN_FIELDS, "relative_path"),
                       ("offset",), ("length",))


def _write_storage_info(writer: _PickleWriter, info: StorageInfo) -> None:
    template = writer.template("storage info", _STORAGE_INFO_PARTS)
    if template is None:  # the first: written field by field, which memoizes its names
        writer.begin_fields(_FILESYSTEM, "_StorageInfo")
        writer.string("relative_path")
        writer.string(info.relative_path)
        writer.string("offset")
        writer.integer(info.offset)
        writer.string("length")
        writer.integer(info.length)
    else:
        opening, offset_key, length_key = template
        out = writer.out
        out += opening
        writer.string(info.relative_path)
        out += offset_key
        out += _integer_opcodes(info.offset)
        out += length_key
        out += _integer_opcodes(info.length)
    if info.transform_descriptors is not None:
        writer.string("transform_descriptors")
        writer.value(list(info.transform_descriptors))
    writer.out += _END_FIELDS


_ITEM_KEY_PARTS = (((_METADATA, "MetadataIndex"), _BEGIN_FIELDS, "fqn"),
                   ("offset", _SIZE, pickle.MARK), (_END_SIZE, "index"))


def _write_item_key(writer: _PickleWriter, key: MetadataIndex) -> None:
    template = writer.template("item key", _ITEM_KEY_PARTS)
    offset = None if key.offset is None else writer.encoded_ints(key.offset)
    if template is None or offset is None:  # the first, no offset, or not all ints
        writer.begin_fields(_METADATA, "MetadataIndex")
        writer.string("fqn")
        writer.string(key.fqn)
        writer.string("offset")
        writer.size_or_none(key.offset)
        writer.string("index")
    else:
        opening, offset_opening, index_key = template
        out = writer.out
        out += opening
        writer.string(key.fqn)
        out += offset_opening
        out += offset
        out += index_key
    index = key.index
    if type(index) is int:
        writer.out += _integer_opcodes(index)
    else:
        writer.value(index)
    writer.out += _END_FIELDS


_CHUNK_PARTS = (((_METADATA, "ChunkStorageMetadata"), _BEGIN_FIELDS, "offsets", _SIZE,
                 pickle.MARK),
                (_END_SIZE, "sizes", _SIZE, pickle.MARK))


def _write_chunk(writer: _PickleWriter, chunk: ChunkMetadata) -> None:
    template = writer.template("chunk", _CHUNK_PARTS)
    offsets, sizes = writer.encoded_ints(chunk.offsets), writer.encoded_ints(chunk.sizes)
    if template is None or offsets is None or sizes is None:  # the first, or not all ints
        writer.begin_fields(_METADATA, "ChunkStorageMetadata")
        writer.string("offsets")
        writer.size(chunk.offsets)
        writer.string("sizes")
        writer.size(chunk.sizes)
        writer.end_fields()
        return
    opening, middle = template
    out = writer.out
    out += opening
    out += offsets
    out += middle
    out += sizes
    out += _END_SIZE
    out += _END_FIELDS


def _write_tensor(writer: _PickleWriter, tensor: TensorMetadata) -> None:
    writer.begin_fields(_METADATA, "TensorStorageMetadata")
    writer.string("properties")
    writer.value(tensor.properties)
    writer.string("size")
    writer.size(tensor.size)
    writer.string("chunks")
    writer.value(tensor.chunks)
    writer.end_fields()


def _write_tensor_properties(writer: _PickleWriter, properties: TensorProperties) -> None:
    """TensorProperties pickles its state as a tuple (its __getstate__)."""
    writer.global_name(_METADATA, "TensorProperties")
    writer.out += _NEW_OBJECT + pickle.MARK
    writer.global_name("torch", properties.dtype.name)
    writer.global_name("torch.serialization", "_get_layout")
    writer.string(f"torch.{properties.layout}")
    writer.out += pickle.TUPLE1 + pickle.REDUCE
    writer.value(properties.requires_grad)
    writer.global_name(_METADATA, "_MEM_FORMAT_ENCODING")
    writer.integer(properties.memory_format_code)
    writer.out += pickle.TUPLE1 + pickle.REDUCE
    writer.value(properties.pin_memory)
    writer.out += pickle.TUPLE + pickle.BUILD


def _write_storage_meta(writer: _PickleWriter, meta: StorageMeta) -> None:
    writer.fields(_METADATA, "StorageMeta", {
        "checkpoint_id": meta.checkpoint_id, "save_id": meta.save_id, "load_id": meta.load_id,
        "modules": list(meta.modules)})


def _write_checkpoint_metadata(writer: _PickleWriter, metadata: CheckpointMetadata) -> None:
    """As torch's Metadata (Megatron-Core's mcore_data an attribute of it, as 0.14 writes it:
    any torch reads that without Megatron's classes)."""
    fields = {"state_dict_metadata": metadata.state_dict_metadata,
              "planner_data": metadata.planner_data, "storage_data": metadata.storage_data,
              "storage_meta": metadata.storage_meta, "version": metadata.version}
    if metadata.mcore_data is not None:
        fields["mcore_data"] = metadata.mcore_data
    writer.fields(_METADATA, "Metadata", fields)


def _write_pure_path(writer: _PickleWriter, path: PurePosixPath | PureWindowsPath) -> None:
    writer.global_name("pathlib", "PosixPath" if type(path) is PurePosixPath else "WindowsPath")
    writer.value(tuple(path.parts))
    writer.out += pickle.REDUCE


def _write_opcode(code: Callable[[Any], bytes]) -> Callable[[_PickleWriter, Any], None]:
    def write(writer: _PickleWriter, value: Any) -> None:
        writer.out += code(value)
    return write


def _write_bytes(writer: _PickleWriter, data: bytes) -> None:
    header = (pickle.SHORT_BINBYTES + bytes([len(data)]) if len(data) < 256
              else pickle.BINBYTES8 + _PACK_UINT64(len(data)))
    writer.out += header + data


_VALUE_WRITERS: dict[type, Callable[[_PickleWriter, Any], None]] = {
    type(None): _write_opcode(lambda _: pickle.NONE),
    bool: _write_opcode(lambda value: pickle.NEWTRUE if value else pickle.NEWFALSE),
    int: _PickleWriter.integer,
    float: _write_opcode(lambda value: pickle.BINFLOAT + _PACK_FLOAT(value)),
    str: _PickleWriter.string,
    bytes: _write_bytes,
    tuple: lambda writer, values: writer.marked(values, list(values), pickle.TUPLE),
    list: lambda writer, values: writer.container(values, pickle.EMPTY_LIST, values,
                                                  pickle.APPENDS),
    dict: lambda writer, values: writer.container(
        values, pickle.EMPTY_DICT, [item for pair in values.items() for item in pair],
        pickle.SETITEMS),
    set: lambda writer, values: writer.container(values, pickle.EMPTY_SET, list(values),
                                                 pickle.ADDITEMS),
    frozenset: lambda writer, values: writer.marked(values, list(values), pickle.FROZENSET),
    DType: lambda writer, dtype: writer.global_name("torch", dtype.name),
    PurePosixPath: _write_pure_path,
    PureWindowsPath: _write_pure_path,
    StorageInfo: _write_storage_info,
    MetadataIndex: _write_item_key,
    ChunkMetadata: _write_chunk,
    TensorMetadata: _write_tensor,
    TensorProperties: _write_tensor_properties,
    BytesMetadata: lambda writer, _: writer.fields(_METADATA, "BytesStorageMetadata", {}),
    StorageMeta: _write_storage_meta,
    CheckpointMetadata: _write_checkpoint_metadata,
}


def serialize_metadata(metadata: CheckpointMetadata) -> bytes:
    """`.metadata` bytes that torch's DCP reads as this metadata (torch is not imported)."""
    writer = _PickleWriter()
    writer.value(metadata)
    writer.out += pickle.STOP
    return bytes(writer.out)

"""The layout of a `torch.save` archive holding one tensor, read without torch and without
running code from it.

DCP's TORCH_SAVE serialization stores each tensor item as a complete torch.save zip archive:
`<prefix>/data.pkl` (a pickle naming the dtype, shape, stride and storage of the tensor),
`<prefix>/data/<key>` (the raw storage bytes, 64-byte aligned) and a few small records. The
pickle is read with an allowlist that maps the few globals torch writes for a dense tensor
onto plain values; a storage is a persistent id, recorded rather than loaded.
"""

from __future__ import annotations

import functools
import io
import math
import pickle
from dataclasses import dataclass
from typing import Any, Sequence, TypeVar

from dcpctl.errors import DataError, UnsupportedLayoutError, name_and_message
from dcpctl.format.dtypes import DTYPES_BY_NAME, LEGACY_STORAGE_TYPES, DType
from dcpctl.format.torch_save.loadable_pickle import refuse_unloadable_pickle
from dcpctl.format.torch_save.zip_records import (LOCAL_HEADER_BYTES, LOCAL_SIGNATURE,
                                                  CentralDirectory, CentralEntry, ReadRange,
                                                  ZipRecord, crc_field_at, local_record_in,
                                                  locate_record, read_central_directory,
                                                  whole_record_in, with_fields_zeroed)

PICKLE_RECORD_SUFFIX = "/data.pkl"
_FIRST_STORAGE_SUFFIX = "/data/0"
_RECORDS_ROOM_BYTES = 64 << 10
_MAX_PICKLE_BYTES = 1 << 20
_LAYOUT_WINDOW_BYTES = 4096

RecordT = TypeVar("RecordT")
_DTYPES_BY_LEGACY_STORAGE = {storage: DTYPES_BY_NAME[name]
                             for name, storage in LEGACY_STORAGE_TYPES.items()}


@dataclass(frozen=True)
class SavedTensor:
    """The tensor a torch.save archive holds: a view (shape, stride, storage_offset, all in
    elements) of the storage kept in record `storage_record`, and the bits torch keeps beside
    a view (`x.conj()`, `x.conj().imag`): its values are then the storage's conjugated or
    negated, not the stored bytes."""

    dtype: DType
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    storage_offset: int
    storage_record: str
    storage_numel: int
    conjugated: bool = False
    negated: bool = False

    @property
    def numel(self) -> int:
        """Number of elements."""
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        """Bytes of the tensor's elements."""
        return self.numel * self.dtype.itemsize

    @property
    def is_contiguous(self) -> bool:
        """Whether the elements lie in row-major order with no gaps (dims of size 1 aside)."""
        expected = 1
        for size, stride in zip(reversed(self.shape), reversed(self.stride)):
            if size != 1 and stride != expected:
                return self.numel == 0
            expected *= size
        return True


@dataclass(slots=True)
class TorchSaveLayout:
    """Where the tensor of a torch.save archive of one tensor lies (offsets within the item)."""

    tensor: SavedTensor
    storage: ZipRecord

    @property
    def payload_offset(self) -> int:
        """Offset in the archive of the tensor's first element."""
        return self.storage.data_offset + self.tensor.storage_offset * self.tensor.dtype.itemsize


def find_payload_start(head: bytes) -> int | None:
    """Where the bytes of the first storage record (`<prefix>/data/0`) begin in the head of a
    torch.save archive read front to back, or None if the head does not show them (yet).
    torch.save's local headers carry no sizes, so records are walked by name: each record of
    the head is a local header, found by its signature."""
    if _FIRST_STORAGE_SUFFIX.encode() not in head:  # the cheap test, while the head grows
        return None
    position = head.find(LOCAL_SIGNATURE)
    while position >= 0:
        record = local_record_in(head, position)
        if record is None:
            return None
        name, data_offset = record
        if name.endswith(_FIRST_STORAGE_SUFFIX):
            return data_offset
        position = head.find(LOCAL_SIGNATURE, position + len(LOCAL_SIGNATURE))
    return None


def saved_tensor_in_head(head: bytes) -> SavedTensor | None:
    """The tensor of a torch.save archive read front to back, from its head (its records up to
    where find_payload_start finds the storage's bytes): the first record must be an intact
    data.pkl of one plain tensor whose storage is that first storage record. None otherwise, as
    for any archive of something else."""
    if not head.startswith(LOCAL_SIGNATURE):
        return None
    record = whole_record_in(head, 0)
    if record is None or not record[0].endswith(PICKLE_RECORD_SUFFIX):
        return None
    name, pickle_bytes = record
    prefix = name[:-len(PICKLE_RECORD_SUFFIX)]
    try:
        tensor = parse_tensor_pickle(pickle_bytes, f"{prefix}/data/")
    except DataError:
        return None
    return tensor if tensor.storage_record == prefix + _FIRST_STORAGE_SUFFIX else None


def max_tensor_archive_bytes(tensor_nbytes: int) -> int:
    """The most bytes the torch.save archive of a chunk of tensor_nbytes may hold: torch's
    FileSystemWriter saves a tensor with a storage of its own bytes (it clones views), and the
    records around them take about 1 KiB. A compressed item that decodes past this is damaged
    or hostile (a few stored bytes can decode to terabytes)."""
    return tensor_nbytes + _RECORDS_ROOM_BYTES


def read_torch_save_layout(read_range: ReadRange, item_length: int) -> TorchSaveLayout:
    """The tensor of a torch.save archive of `item_length` bytes and where it lies. Reads only
    the archive's last and first few KiB (central directory, the local headers it needs,
    data.pkl and byteorder, whose CRC-32s it checks), never the tensor data. Tensor bytes are
    taken as little-endian: an archive whose byteorder record says otherwise is refused."""
    read_cached = cache_ends(read_range, item_length, _LAYOUT_WINDOW_BYTES)
    for template in _layout_templates.get(item_length, ()):
        layout = template.layout_of(read_cached)
        if layout is not None:
            return layout
    directory = read_central_directory(read_cached, item_length)
    entries = directory.entries
    check_torch_save_records(entries)
    located: list[ZipRecord] = []
    checked: dict[str, bytes] = {}

    def locate(entry: CentralEntry) -> ZipRecord:
        located.append(locate_record(read_cached, entry, directory.offset))
        return located[-1]

    def checked_data(entry: CentralEntry) -> tuple[ZipRecord, bytes]:
        record = locate(entry)
        data = checked[entry.name] = read_cached(record.data_offset, record.size_bytes)
        record.check_crc(data)
        return record, data

    prefix = entries[0].name.partition("/")[0]
    byteorder = next((entry for entry in entries if entry.name == f"{prefix}/byteorder"), None)
    if byteorder is not None and checked_data(byteorder)[1] != b"little":
        raise UnsupportedLayoutError("the archive was saved big-endian (its byteorder record "
                                     "is not 'little'), which dcpctl does not read")
    pickle_record, pickle_bytes = checked_data(find_pickle_record(entries))
    tensor = _tensor_of_pickle_record(pickle_record, pickle_bytes)
    storage_entry = next((entry for entry in entries if entry.name == tensor.storage_record),
                         None)
    layout = _join_storage(tensor, storage_entry and locate(storage_entry))
    _remember_layout(read_cached, item_length, directory, located, checked, layout)
    return layout


@dataclass(frozen=True)
class _LayoutTemplate:
    """An archive's layout, and the bytes it followed from: the archive's tail from its central
    directory on (with the CRC-32 fields of records whose data was not read zeroed), the local
    headers read and the records whose data was checked. An archive of the same length with
    the same bytes there has the same layout, its storage record's CRC-32 its own."""

    tail_start: int
    masked_tail: bytes
    masked_positions: tuple[int, ...]  # in the tail
    storage_crc_position: int  # in the tail
    head_ranges: tuple[tuple[int, bytes], ...]
    head_end: int
    layout: TorchSaveLayout

    def layout_of(self, read_cached: ReadRange) -> TorchSaveLayout | None:
        """The layout of an archive of this template's length, None where its bytes differ."""
        tail = read_cached(self.tail_start, len(self.masked_tail))
        if with_fields_zeroed(tail, self.masked_positions) != self.masked_tail:
            return None
        head = read_cached(0, self.head_end)
        for start, expected in self.head_ranges:
            if head[start:start + len(expected)] != expected:
                return None
        storage = self.layout.storage
        return TorchSaveLayout(self.layout.tensor, ZipRecord(
            storage.name, storage.data_offset, storage.size_bytes,
            crc_field_at(tail, self.storage_crc_position), storage.header_offset))


# The tensor items of a checkpoint are archives of a few layouts (a chunk shape and dtype each):
# each is parsed once, and the items like it are matched against it.
_layout_templates: dict[int, list[_LayoutTemplate]] = {}
_MAX_TEMPLATE_LENGTHS = 1024
_MAX_TEMPLATES_PER_LENGTH = 4


def _remember_layout(read_cached: ReadRange, item_length: int, directory: CentralDirectory,
                     located: list[ZipRecord], checked: dict[str, bytes],
                     layout: TorchSaveLayout) -> None:
    tail_start = directory.structure_start
    if item_length - tail_start > _LAYOUT_WINDOW_BYTES:
        return  # past the windows read anyway: rare, and comparing would cost more
    tail = read_cached(tail_start, item_length - tail_start)
    crc_positions = {entry.name: offset - tail_start
                     for entry, offset in zip(directory.entries, directory.crc_field_offsets)}
    masked = tuple(position for name, position in crc_positions.items() if name not in checked)
    head_ranges = [(record.header_offset, read_cached(record.header_offset, LOCAL_HEADER_BYTES))
                   for record in located]
    head_ranges += [(record.data_offset, checked[record.name]) for record in located
                    if record.name in checked]
    head_end = max(start + len(expected) for start, expected in head_ranges)
    if head_end > _LAYOUT_WINDOW_BYTES:
        return
    templates = _layout_templates.setdefault(item_length, [])
    if len(_layout_templates) > _MAX_TEMPLATE_LENGTHS:
        _layout_templates.clear()
    if len(templates) >= _MAX_TEMPLATES_PER_LENGTH:
        del templates[0]
    templates.append(_LayoutTemplate(
        tail_start, with_fields_zeroed(tail, masked), masked,
        crc_positions[layout.storage.name], tuple(head_ranges), head_end, layout))


def cache_ends(read_range: ReadRange, length: int, window_bytes: int) -> ReadRange:
    """read_range, serving reads within the first or last window_bytes from one read of each."""
    windows: dict[int, bytes] = {}

    def read_cached(start: int, count: int) -> bytes:
        for window_start in (0, max(0, length - window_bytes)):
            window_end = min(length, window_start + window_bytes)
            if window_start <= start and start + count <= window_end:
                if window_start not in windows:
                    windows[window_start] = read_range(window_start, window_end - window_start)
                window = windows[window_start]
                return window[start - window_start:start - window_start + count]
        return read_range(start, count)

    return read_cached


def find_pickle_record(records: Sequence[RecordT]) -> RecordT:
    """The `<prefix>/data.pkl` record (a ZipRecord or a central directory entry) of a tensor's
    archive."""
    record = pickle_record_of(records)
    if record.size_bytes > _MAX_PICKLE_BYTES:
        raise DataError(f"zip record {record.name!r} holds {record.size_bytes} bytes, far more "
                        "than the pickle of one tensor")
    return record


def pickle_record_of(records: Sequence[RecordT]) -> RecordT:
    """The `<prefix>/data.pkl` record of a torch.save archive's records."""
    for record in records:
        if record.name.endswith(PICKLE_RECORD_SUFFIX) and record.name.count("/") == 1:
            return record
    raise DataError("no data.pkl record: not a torch.save archive")


_VERSION_RECORD_NAMES = (".data/version", "version")


def check_torch_save_records(records: Sequence[RecordT]) -> None:
    """Refuse records (ZipRecords or central directory entries) that torch's reader could not
    load: every record in the one top-level directory the first names (the archive's name),
    a data.pkl and a version record among them."""
    first = records[0].name if records else ""
    prefix, slash, _ = first.partition("/")
    if not (prefix and slash):
        raise DataError(f"the first zip record {first!r} is not in a directory named for the "
                        "archive, as torch.save puts every record")
    stray = next((record.name for record in records
                  if not record.name.startswith(f"{prefix}/")), None)
    if stray is not None:
        raise DataError(f"zip record {stray!r} lies outside the archive's directory {prefix!r}")
    pickle_record_of(records)
    names = {record.name for record in records}
    if not any(f"{prefix}/{name}" in names for name in _VERSION_RECORD_NAMES):
        raise DataError(f"no {prefix}/version record, which torch's reader needs")


def build_torch_save_layout(records: Sequence[ZipRecord], pickle_bytes: bytes) -> TorchSaveLayout:
    """Join the archive's records with its data.pkl and check that they agree."""
    tensor = _tensor_of_pickle_record(find_pickle_record(records), pickle_bytes)
    return _join_storage(tensor, next((r for r in records if r.name == tensor.storage_record),
                                      None))


def _tensor_of_pickle_record(pickle_record: ZipRecord, pickle_bytes: bytes) -> SavedTensor:
    prefix = pickle_record.name[:-len(PICKLE_RECORD_SUFFIX)]
    return parse_tensor_pickle(pickle_bytes, f"{prefix}/data/")


def last_element_index(shape: Sequence[int], stride: Sequence[int], storage_offset: int = 0
                       ) -> int:
    """Where in its storage a non-empty strided view's last element lies, worked out in Python
    ints (torch works it out in int64, where values near 2**63 wrap around)."""
    return storage_offset + sum((size - 1) * step for size, step in zip(shape, stride))


def _join_storage(tensor: SavedTensor, storage: ZipRecord | None) -> TorchSaveLayout:
    """The layout of the tensor in its storage record, once both are checked to agree."""
    if storage is None:
        raise DataError(f"data.pkl names storage record {tensor.storage_record!r}, which the "
                        "archive lacks")
    storage_bytes = tensor.storage_numel * tensor.dtype.itemsize
    if storage.size_bytes != storage_bytes:
        raise DataError(f"zip record {storage.name!r} holds {storage.size_bytes} bytes, but "
                        f"data.pkl says {tensor.storage_numel} elements of {tensor.dtype.name} "
                        f"({storage_bytes} bytes)")
    if tensor.numel:
        last_element = last_element_index(tensor.shape, tensor.stride, tensor.storage_offset)
        if last_element >= tensor.storage_numel or min(tensor.stride, default=0) < 0:
            raise DataError(f"data.pkl describes a tensor of shape {list(tensor.shape)}, stride "
                            f"{list(tensor.stride)} and offset {tensor.storage_offset} that "
                            f"reaches outside its storage of {tensor.storage_numel} elements")
    return TorchSaveLayout(tensor, storage)


@dataclass(frozen=True)
class _StorageType:
    dtype: DType | None  # None: an UntypedStorage, whose dtype comes with the tensor


@dataclass(frozen=True)
class _StorageReference:
    key: str
    storage_type: _StorageType
    numel: int


def _is_sizes(value: Any) -> bool:
    return isinstance(value, tuple) and all(type(item) is int and item >= 0 for item in value)


def _rebuild_tensor(storage: Any, storage_offset: Any, size: Any, stride: Any, dtype: Any,
                    metadata: Any, storage_record_prefix: str) -> SavedTensor:
    if not isinstance(storage, _StorageReference):
        raise DataError("data.pkl rebuilds a tensor from something that is not a storage")
    if not (type(storage_offset) is int and storage_offset >= 0 and _is_sizes(size)
            and _is_sizes(stride) and len(size) == len(stride)):
        raise DataError(f"data.pkl has a malformed tensor view: offset {storage_offset!r}, "
                        f"size {size!r}, stride {stride!r}")
    if not isinstance(dtype, DType):
        raise DataError(f"data.pkl gives dtype {dtype!r}, not a torch dtype")
    numel = storage.numel
    if storage.storage_type.dtype is None:  # an untyped storage counts bytes
        numel, remainder = divmod(numel, dtype.itemsize)
        if remainder:
            raise DataError(f"storage of {storage.numel} bytes is not a whole number of "
                            f"{dtype.name} elements")
    bits = _view_bits(metadata)
    return SavedTensor(dtype, size, stride, storage_offset, storage_record_prefix + storage.key,
                       numel, bits.get("conj", False), bits.get("neg", False))


def _view_bits(metadata: Any) -> dict[str, bool]:
    """The tensor metadata torch pickles (torch._utils.get_tensor_metadata): only the conj
    and neg bits, each a bool."""
    if metadata is None:
        return {}
    if (type(metadata) is not dict or not set(metadata) <= {"conj", "neg"}
            or not all(type(value) is bool for value in metadata.values())):
        raise DataError(f"data.pkl gives the tensor metadata {metadata!r:.200}, not torch's "
                        "conj and neg bits")
    return metadata


class _TensorUnpickler(pickle.Unpickler):
    """Resolves only the globals torch.save writes for a plain dense tensor."""

    def __init__(self, data: bytes, storage_record_prefix: str) -> None:
        super().__init__(io.BytesIO(data))
        prefix = storage_record_prefix

        def rebuild_v2(storage, offset, size, stride, requires_grad, hooks, metadata=None):
            return _rebuild_tensor(storage, offset, size, stride, storage.storage_type.dtype
                                   if isinstance(storage, _StorageReference) else None,
                                   metadata, prefix)

        def rebuild_v3(storage, offset, size, stride, requires_grad, hooks, dtype, metadata=None):
            return _rebuild_tensor(storage, offset, size, stride, dtype, metadata, prefix)

        self._globals = {("torch._utils", "_rebuild_tensor_v2"): rebuild_v2,
                         ("torch._utils", "_rebuild_tensor_v3"): rebuild_v3}

    def find_class(self, module: str, name: str) -> Any:
        found = self._globals.get((module, name))
        if found is not None:
            return found
        if (module, name) == ("collections", "OrderedDict"):
            return dict
        if module in ("torch", "torch.storage") and name == "UntypedStorage":
            return _StorageType(None)
        if module == "torch" and name in _DTYPES_BY_LEGACY_STORAGE:
            return _StorageType(_DTYPES_BY_LEGACY_STORAGE[name])
        if module == "torch" and name in DTYPES_BY_NAME:
            return DTYPES_BY_NAME[name]
        raise DataError(f"data.pkl refers to {module}.{name}, which the pickle of a plain dense "
                        "tensor never does; refusing to unpickle it")

    def persistent_load(self, pid: Any) -> Any:
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"
                and isinstance(pid[1], _StorageType) and isinstance(pid[2], str)
                and type(pid[4]) is int and pid[4] >= 0):
            raise DataError(f"data.pkl has a malformed storage reference {pid!r:.200}")
        return _StorageReference(pid[2], pid[1], pid[4])


def parse_tensor_pickle(data: bytes, storage_record_prefix: str = "archive/data/") -> SavedTensor:
    """The tensor described by a torch.save data.pkl; raises DataError for anything else."""
    return _parse_tensor_pickle(bytes(data), storage_record_prefix)


# Every chunk of one shape and dtype has the same data.pkl: parse each distinct one once.
@functools.lru_cache(maxsize=1024)
def _parse_tensor_pickle(data: bytes, storage_record_prefix: str) -> SavedTensor:
    refuse_unloadable_pickle(data)
    try:
        loaded = _TensorUnpickler(data, storage_record_prefix).load()
    except DataError:
        raise
    except Exception as error:  # a damaged pickle fails in many ways; all mean the same
        raise DataError(f"data.pkl does not unpickle ({name_and_message(error)})") from None
    if not isinstance(loaded, SavedTensor):
        raise DataError(f"data.pkl holds a {type(loaded).__name__}, not one tensor")
    return loaded

"""DCP to one torch.save file, as torch's `dcp_to_torch_save` writes it, streaming.

The archive is laid out the way torch.save lays it out: `data.pkl` (the nested state, each
tensor pickled as torch pickles it, naming a storage record by key), the small format records,
then each tensor's storage record, then the central directory. Every record's place is known
before a tensor is read, so the tensors' records are written at their places by one process
or several (placed_tensors.py), each tensor's bytes assembled from the checkpoint's chunks on
the way and its CRC-32 computed as they pass. Memory holds a few chunks, never the state. The
nesting follows the checkpoint's planner_data, the keys of the state dict that was saved, as
`dcp_to_torch_save` nests it.
"""

from __future__ import annotations

import collections
import functools
import io
import math
import os
import pickle
import time
import zlib
from dataclasses import dataclass
from pathlib import Path

from dcpctl.errors import DcpctlError, UnsupportedLayoutError
from dcpctl.format.checkpoint.items import read_item
from dcpctl.format.checkpoint.locations import locate_object
from dcpctl.format.checkpoint.rank_metadata import replicated_keys
from dcpctl.execution.running import checked_job_source, threads_per_worker
from dcpctl.format.checkpoint.view import Checkpoint, ObjectEntry
from dcpctl.format.dtypes import LEGACY_STORAGE_TYPES, DType
from dcpctl.format.torch_save.plain_objects import NotPlainData, load_plain_object
from dcpctl.format.torch_save.writer import ARCHIVE_PREFIX, ZipStreamWriter
from dcpctl.ops.convert.key_selection import KeySelection, select_and_rename
from dcpctl.ops.convert.placed_tensors import (FileLayout, TensorSlot,
                                               placed_tensors_planning, threads_holding_pieces,
                                               write_placed_tensors)
from dcpctl.ops.convert.report import (ConvertReport, OutputTensor, ProgressCallback, WrittenFile,
                                       cast_dtype)
from dcpctl.storage.paths import StoragePath, storage_path
from dcpctl.storage.staging import staged_output
from dcpctl.wording import listed

_PICKLE_PROTOCOL = 2  # torch.save's default


@dataclass
class TorchSavePlan:
    """The entries to write, in checkpoint order, each with its key path in the nested dict."""

    tensors: list[OutputTensor]
    objects: list[ObjectEntry]
    paths: dict[str, tuple]
    tensors_left_out: int
    objects_left_out: int


@dataclass(frozen=True)
class _TorchGlobal:
    """A function, class or dtype of torch's, as a pickle names it (`module name`): written by
    name, so a conversion imports torch only to load objects or cast dtypes."""

    module: str
    name: str

    def __call__(self, *arguments):  # a pickle's reduce calls it: it is only ever named
        raise TypeError(f"{self.module}.{self.name} stands for torch's, by name only")


@functools.cache
def _torch_global(module: str, name: str) -> _TorchGlobal:
    """One object per name, so that the pickle names it once and refers back to it after, as
    torch's pickler does with torch's own objects."""
    return _TorchGlobal(module, name)


class _StatePickler(pickle._Pickler):
    """Pickles the state as torch.save does: protocol 2, through Python's pure-Python pickler
    (the opcodes and memo of the C one torch.save uses, and a say in how torch's objects are
    named); each OutputTensor as a tensor whose storage is the persistent id torch writes
    ('storage', type, key, 'cpu', size). Keys are numbered in the order the pickle meets the
    tensors, and `stored` lists the tensors in that order, the order torch writes their records
    in (torch.load(map_location="meta") relies on it)."""

    dispatch = pickle._Pickler.dispatch.copy()

    def __init__(self, file) -> None:
        super().__init__(file, protocol=_PICKLE_PROTOCOL)
        self.stored: list[OutputTensor] = []

    def reducer_override(self, value):
        if not isinstance(value, OutputTensor):
            return NotImplemented
        shape = value.entry.shape
        stride = tuple(math.prod(shape[dimension + 1:]) for dimension in range(len(shape)))
        arguments = (_StorageOf(value), 0, shape, stride, False, collections.OrderedDict())
        if value.dtype.name in LEGACY_STORAGE_TYPES:
            return _torch_global("torch._utils", "_rebuild_tensor_v2"), arguments
        return (_torch_global("torch._utils", "_rebuild_tensor_v3"),
                arguments + (_torch_global("torch", value.dtype.name),))

    def persistent_id(self, value):
        if not isinstance(value, _StorageOf):
            return None
        key = str(len(self.stored))
        self.stored.append(value.tensor)
        legacy_type = LEGACY_STORAGE_TYPES.get(value.tensor.dtype.name)
        if legacy_type is not None:
            return ("storage", _torch_global("torch", legacy_type), key, "cpu",
                    math.prod(value.tensor.entry.shape))
        return ("storage", _torch_global("torch.storage", "UntypedStorage"), key, "cpu",
                value.tensor.nbytes)

    def _save_torch_global(self, value: _TorchGlobal) -> None:
        self.write(pickle.GLOBAL + f"{value.module}\n{value.name}\n".encode())
        self.memoize(value)

    dispatch[_TorchGlobal] = _save_torch_global


@dataclass(frozen=True)
class _StorageOf:
    """Stands for a tensor's storage in the pickle."""

    tensor: OutputTensor


def plan_torch_save(checkpoint: Checkpoint, selection: KeySelection,
                    cast_to: DType | None) -> TorchSavePlan:
    """What goes into the file; every entry unless selection says otherwise."""
    order = list(checkpoint.metadata.state_dict_metadata)
    names = select_and_rename(order, selection)
    tensors = [OutputTensor(entry, entry.fqn, cast_dtype(entry, cast_to, checkpoint.path))
               for entry in checkpoint.tensors if entry.fqn in names]
    objects = [entry for entry in checkpoint.objects if entry.fqn in names]
    planner_data = checkpoint.metadata.planner_data or {}
    if not isinstance(planner_data, dict):
        raise UnsupportedLayoutError("planner_data is not a mapping of fqns to key paths, so the "
                                     "nesting of the state is unknown", path=checkpoint.path)
    paths = {fqn: tuple(planner_data.get(fqn) or (fqn,)) for fqn in order if fqn in names}
    check_key_paths(paths, checkpoint.path, entry_count=len(order))
    return TorchSavePlan(tensors, objects, paths, len(checkpoint.tensors) - len(tensors),
                         len(checkpoint.objects) - len(objects))


def torch_save_layout(plan: TorchSavePlan, checkpoint: Checkpoint, path: StoragePath,
                      replacing: bool) -> FileLayout:
    """The archive laid out: the records before the tensors, a record per tensor (its CRC-32
    in its data descriptor and directory entry, filled in as it is written), then the last
    records and the central directory; replacing: it may replace a file standing at path."""
    stored, state_pickle = _pickle_state(plan, checkpoint)
    archive = ZipStreamWriter()
    front = b"".join(archive.record(ARCHIVE_PREFIX + name, data) for name, data in (
        ("data.pkl", state_pickle), (".format_version", b"1"), (".storage_alignment", b"64"),
        ("byteorder", b"little")))
    first_tensor_record = archive.record_count()
    slots = []
    for key, tensor in enumerate(stored):
        offset = archive.position
        header = archive.local_header(f"{ARCHIVE_PREFIX}data/{key}", tensor.nbytes)
        archive.position += tensor.nbytes
        archive.data_descriptor(0, tensor.nbytes)
        slots.append(TensorSlot(tensor.entry.fqn, tensor.dtype, str(path), offset, header,
                                tensor.nbytes, described=True))

    def tail(crcs: list[int]) -> bytes:
        for record, crc in enumerate(crcs, start=first_tensor_record):
            archive.set_crc(record, crc)
        serialization_id = f"{zlib.crc32(state_pickle):040d}".encode()
        return (archive.record(ARCHIVE_PREFIX + "version", b"3\n")
                + archive.record(ARCHIVE_PREFIX + ".data/serialization_id", serialization_id)
                + archive.directory())

    return FileLayout(path, front, slots, tail, replacing)


def _pickle_state(plan: TorchSavePlan, checkpoint: Checkpoint) -> tuple[list[OutputTensor], bytes]:
    """data.pkl for the nested state, and its tensors in storage key order."""
    values = _load_objects(checkpoint, plan.objects)
    values.update((tensor.entry.fqn, tensor) for tensor in plan.tensors)
    state: dict = {}
    for fqn, key_path in plan.paths.items():
        set_nested(state, key_path, values[fqn])
    buffer = io.BytesIO()
    pickler = _StatePickler(buffer)
    try:
        pickler.dump(state)
    except RecursionError:  # a key path thousands of keys long, or an object nested as deep
        raise UnsupportedLayoutError("the state nests deeper than Python's pickler can write "
                                     "(planner_data's key paths with the objects' own nesting)",
                                     path=checkpoint.path) from None
    return pickler.stored, buffer.getvalue()


def convert_to_torch_save(source: str | os.PathLike, output: str | os.PathLike,
                          selection: KeySelection, cast_to: DType | None = None,
                          threads: int | None = None, overwrite: bool = False,
                          on_progress: ProgressCallback | None = None,
                          workers: int = 1) -> ConvertReport:
    """Convert the DCP checkpoint at source into the torch.save file output, on `workers`
    processes of `threads` threads each."""
    started = time.perf_counter()
    with checked_job_source(source, placed_tensors_planning(source), threads, workers,
                            on_progress) as checkpoint:
        threads = threads_per_worker(threads, checkpoint.path, workers)
        try:
            plan = plan_torch_save(checkpoint, selection, cast_to)
        except DcpctlError as error:  # the selection's refusals name the source
            raise error.located(path=checkpoint.path) from None
        threads = threads_holding_pieces(threads, plan.tensors)
        staged = staged_output(storage_path(output), overwrite, checkpoint.path,
                               is_directory=False)
        try:
            layout = torch_save_layout(plan, checkpoint, staged.path, replacing=overwrite)
            sizes = write_placed_tensors([layout], checkpoint, staged.path, threads, workers,
                                         on_progress)
            size_bytes = sizes[str(staged.path)]
            staged.publish()
        except BaseException:
            staged.abort()
            raise
    report = ConvertReport(str(source), str(output), "dcp", "torch",
                           objects=len(plan.objects),
                           cast_to=cast_to.name if cast_to else None,
                           tensors_left_out=plan.tensors_left_out,
                           objects_left_out=plan.objects_left_out, threads=threads,
                           workers=workers,
                           files=[WrittenFile(Path(output).name, size_bytes, len(plan.tensors))])
    report.count_tensors(tensor.nbytes for tensor in plan.tensors)
    report.items_several_ranks_saved = len(replicated_keys(checkpoint.replicas))
    report.seconds = time.perf_counter() - started
    return report


_REFUSALS_SHOWN = 5


class _NotWeightsOnly(Exception):
    """Why torch's weights_only loader refused an object."""


def _load_objects(checkpoint: Checkpoint, objects: list[ObjectEntry]) -> dict[str, object]:
    """Each non-tensor entry's value by fqn; those torch's weights_only loader refuses are
    named together, in one refusal."""
    values, refusals = {}, {}
    for entry in objects:
        try:
            values[entry.fqn] = _load_object(checkpoint, entry)
        except _NotWeightsOnly as refusal:
            refusals[entry.fqn] = str(refusal)
    if len(refusals) == 1:
        (fqn, reason), = refusals.items()
        raise UnsupportedLayoutError(f"object {fqn!r} cannot be loaded with weights_only=True "
                                     f"({reason}); leave it out with --exclude",
                                     path=checkpoint.path)
    if refusals:
        shown = listed([f"{fqn!r} ({reason})" for fqn, reason in refusals.items()],
                       _REFUSALS_SHOWN, separator="; ")
        raise UnsupportedLayoutError(f"{len(refusals)} objects cannot be loaded with "
                                     f"weights_only=True: {shown}; leave them out with "
                                     "--exclude", path=checkpoint.path)
    return values


def _load_object(checkpoint: Checkpoint, entry: ObjectEntry):
    """A non-tensor entry: plain data without torch (plain_objects.py), anything else
    unpickled with torch's weights_only loader (no code runs either way)."""
    location = locate_object(checkpoint, entry)
    archive = read_item(location)
    try:
        return load_plain_object(archive)
    except NotPlainData:
        pass
    import torch  # loading what is more than plain data needs torch's weights_only unpickler

    from dcpctl.format.torch_save.skeleton import refuse_tensors_in_object, weights_only_refusal

    try:
        value = torch.load(io.BytesIO(archive), weights_only=True)
    except Exception as error:  # the weights_only loader refuses in many ways
        raise _NotWeightsOnly(weights_only_refusal(error)) from None
    refuse_tensors_in_object(location.path, entry.fqn, value)
    return value


def check_key_paths(paths: dict[str, tuple], source: Path, entry_count: int) -> None:
    """Refuse key paths that cannot all hold their values in one nested state: a path that is
    another's, or runs through another's value, a container both a dict (str keys) and a list
    (int keys), a key that is neither, a list index past the checkpoint's entry_count (an
    honest list holds each of its elements' entries, selected or not), or a root that is not
    a dict."""
    def refuse(fqn: str, rule: str) -> UnsupportedLayoutError:
        return UnsupportedLayoutError(f"planner_data gives {fqn!r} the key path "
                                      f"{list(paths[fqn])[:8]}, which {rule}", path=source)

    root: dict = {}
    kinds = {id(root): str}
    for fqn, path in paths.items():
        node = root
        for depth, key in enumerate(path):
            if type(key) not in (str, int) or (type(key) is int and not 0 <= key < entry_count):
                raise refuse(fqn, f"holds key {key!r}, not a name or an index below "
                                  f"{entry_count}")
            if type(key) is not kinds.setdefault(id(node), type(key)):
                raise refuse(fqn, "makes one container both a dict and a list")
            child = node.get(key)
            if depth == len(path) - 1:
                if child is not None:
                    raise refuse(fqn, "another entry's value is at or under")
                node[key] = fqn
            elif isinstance(child, str):
                raise refuse(fqn, f"runs through the value of {child!r}")
            else:
                node = node.setdefault(key, {})


def set_nested(root: dict, key_path: tuple, value) -> None:
    """Put value at key_path, creating dicts for str keys and lists for int keys (padded with
    None), as torch's set_element does when dcp_to_torch_save rebuilds a state dict."""
    container = root
    for key, next_key in zip(key_path, key_path[1:]):
        empty = [] if isinstance(next_key, int) else {}
        if isinstance(container, list):
            container.extend([None] * (key + 1 - len(container)))
            if container[key] is None:
                container[key] = empty
            container = container[key]
        else:
            container = container.setdefault(key, empty)
    last = key_path[-1]
    if isinstance(container, list):
        container.extend([None] * (last + 1 - len(container)))
    container[last] = value

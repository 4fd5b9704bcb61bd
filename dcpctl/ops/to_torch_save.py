"""DCP to one torch.save file, as torch's `dcp_to_torch_save` writes it, in bounded memory.

torch.save has no streaming writer, so the file is written in two passes: torch.save writes the
whole archive with every tensor's bytes left out (`torch.serialization.skip_data`, placeholder
tensors that own no memory), then each tensor is assembled from its chunks straight into its
place in the archive and its CRC-32 is filled in. The nesting follows the checkpoint's
planner_data, the keys of the state dict that was saved, as `dcp_to_torch_save` nests it.
"""

from __future__ import annotations

import io
import os
import struct
import time
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import torch

from dcpctl.errors import DataError, UnsupportedLayoutError
from dcpctl.format.checkpoint import Checkpoint, ObjectEntry, open_checkpoint
from dcpctl.format.dtypes import DType
from dcpctl.format.items import locate_item, read_item
from dcpctl.format.zip_archive import ZipRecord, crc32_field_offsets, read_zip_records
from dcpctl.ops.conversion import (ConvertReport, OutputTensor, ProgressCallback, WrittenFile,
                                   cast_dtype, run_in_order, sync_and_close)
from dcpctl.ops.key_selection import KeySelection, select_and_rename
from dcpctl.ops.tensor_bytes import iter_tensor_bytes, torch_dtype
from dcpctl.ops.torch_save_files import load_skeleton, refuse_tensors_in_object, storage_file_offset
from dcpctl.pipeline import default_thread_count
from dcpctl.staging import StagedOutput


@dataclass
class TorchSavePlan:
    """The entries to write, in checkpoint order, each with its key path in the nested dict."""

    tensors: list[OutputTensor]
    objects: list[ObjectEntry]
    paths: dict[str, tuple]
    tensors_left_out: int
    objects_left_out: int


@dataclass(frozen=True)
class _Fill:
    """A storage record of the archive, where its CRC-32 goes, and where its bytes come from."""

    record: ZipRecord
    crc32_offsets: tuple[int, ...]
    source: OutputTensor


def plan_torch_save(checkpoint: Checkpoint, selection: KeySelection,
                    cast_to: DType | None) -> TorchSavePlan:
    """What goes into the file; every entry unless selection says otherwise."""
    order = list(checkpoint.metadata.state_dict_metadata)
    names = select_and_rename(order, selection)
    tensors = [OutputTensor(entry, entry.fqn, cast_dtype(entry.dtype, cast_to))
               for entry in checkpoint.tensors if entry.fqn in names]
    objects = [entry for entry in checkpoint.objects if entry.fqn in names]
    planner_data = checkpoint.metadata.planner_data or {}
    paths = {fqn: tuple(planner_data.get(fqn) or (fqn,)) for fqn in order if fqn in names}
    return TorchSavePlan(tensors, objects, paths, len(checkpoint.tensors) - len(tensors),
                         len(checkpoint.objects) - len(objects))


def write_torch_save(plan: TorchSavePlan, checkpoint: Checkpoint, path: Path, threads: int,
                     on_progress: ProgressCallback | None = None) -> None:
    """Write the planned entries into one torch.save file at path."""
    _save_without_data(plan, checkpoint, path)
    fills = _match_records(path, plan)
    total_bytes = sum(fill.record.size_bytes for fill in fills)
    with open(path, "r+b") as stream:
        def write(fill: _Fill, pieces: Iterator) -> None:
            stream.seek(fill.record.data_offset)
            crc = written = 0
            for piece in pieces:
                stream.write(piece)
                crc = zlib.crc32(piece, crc)
                written += len(piece)
                if on_progress is not None:
                    on_progress(len(piece), total_bytes)
            if written != fill.record.size_bytes:
                raise DataError(f"{checkpoint.path}: {fill.record.name} got {written} bytes, "
                                f"not {fill.record.size_bytes}")
            for offset in fill.crc32_offsets:
                stream.seek(offset)
                stream.write(struct.pack("<I", crc))

        run_in_order(lambda fill: iter_tensor_bytes(checkpoint, fill.source.entry,
                                                    fill.source.dtype),
                     fills, write, threads)
        sync_and_close(stream)


def convert_to_torch_save(source: str | os.PathLike, output: str | os.PathLike,
                          selection: KeySelection, cast_to: DType | None = None,
                          threads: int | None = None, overwrite: bool = False,
                          on_progress: ProgressCallback | None = None) -> ConvertReport:
    """Convert the DCP checkpoint at source into the torch.save file output."""
    started = time.perf_counter()
    threads = threads or default_thread_count()
    checkpoint = open_checkpoint(source)
    plan = plan_torch_save(checkpoint, selection, cast_to)
    staged = StagedOutput(Path(output), overwrite, is_directory=False)
    try:
        write_torch_save(plan, checkpoint, staged.path, threads, on_progress)
        size_bytes = staged.path.stat().st_size
        staged.publish()
    except BaseException:
        staged.abort()
        raise
    report = ConvertReport(str(source), str(output), "dcp", "torch",
                           objects=len(plan.objects),
                           cast_to=cast_to.name if cast_to else None,
                           tensors_left_out=plan.tensors_left_out,
                           objects_left_out=plan.objects_left_out, threads=threads,
                           files=[WrittenFile(Path(output).name, size_bytes, len(plan.tensors))])
    report.count_tensors(tensor.nbytes for tensor in plan.tensors)
    report.seconds = time.perf_counter() - started
    return report


def _save_without_data(plan: TorchSavePlan, checkpoint: Checkpoint, path: Path) -> None:
    """torch.save the nested state with placeholder tensors that own no memory and no tensor
    bytes written."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    values: dict[str, object] = {entry.fqn: _load_object(checkpoint, entry)
                                 for entry in plan.objects}
    with FakeTensorMode():
        for tensor in plan.tensors:
            values[tensor.entry.fqn] = torch.empty(tensor.entry.shape,
                                                   dtype=torch_dtype(tensor.dtype))
    state: dict = {}
    for fqn, key_path in plan.paths.items():
        set_nested(state, key_path, values[fqn])
    with torch.serialization.skip_data(materialize_fake_tensors=True):
        torch.save(state, path)


def _match_records(path: Path, plan: TorchSavePlan) -> list[_Fill]:
    """Pair every storage record of the archive with the bytes it needs, in file order."""
    with open(path, "rb") as stream:
        def read_range(start: int, length: int) -> bytes:
            stream.seek(start)
            return stream.read(length)

        records = {record.data_offset: record
                   for record in read_zip_records(read_range, path.stat().st_size)}
        skeleton = load_skeleton(path)
        fills = {}
        for tensor in plan.tensors:
            placeholder = get_nested(skeleton, plan.paths[tensor.entry.fqn])
            record = records[storage_file_offset(placeholder)]
            fills[record.data_offset] = _Fill(record, crc32_field_offsets(read_range, record),
                                              tensor)
    return [fills[offset] for offset in sorted(fills)]


def _load_object(checkpoint: Checkpoint, entry: ObjectEntry):
    """A non-tensor entry, unpickled with torch's weights_only loader (no code runs)."""
    if entry.storage is None:
        raise DataError(f"{checkpoint.path}: object {entry.fqn!r} has no storage entry")
    location = locate_item(checkpoint, entry.fqn, entry.storage, is_tensor=False)
    try:
        value = torch.load(io.BytesIO(read_item(location)), weights_only=True)
    except Exception as error:  # the weights_only loader refuses in many ways
        raise UnsupportedLayoutError(
            f"{location.path}: object {entry.fqn!r} cannot be loaded with weights_only=True "
            f"({str(error).splitlines()[0]}); leave it out with --exclude") from None
    refuse_tensors_in_object(location.path, entry.fqn, value)
    return value


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


def get_nested(root, key_path: tuple):
    """The value at key_path."""
    for key in key_path:
        root = root[key]
    return root

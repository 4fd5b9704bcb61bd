"""Safetensors files or a torch.save file to a DCP checkpoint laid out for N ranks.

Each tensor is split by rows as an N-rank FSDP2 save splits it (format/checkpoint/sharding.py)
and each rank's chunks go into its own file `__{rank}_0.distcp`, every item the torch.save of the
chunk that torch's FileSystemWriter would write (format/torch_save/writer.py); non-tensor
entries go to rank 0. Sources are read a chunk at a time from the byte ranges their headers name
(for a torch.save file, found by loading it with every tensor on the meta device), never loaded
whole. A safetensors source needs no torch at all.
"""

from __future__ import annotations

import io
import math
import os
import time
import uuid
from collections import Counter
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING, Any, Callable, Iterator

from dcpctl.errors import DataError, InvalidOptionError, UnsupportedLayoutError, truncated_error
from dcpctl.execution.running import plan_ahead, run_job, threads_per_worker
from dcpctl.format.checkpoint.hf_storage import is_hf_storage_shards, refuse_unconsolidated_save
from dcpctl.format.checkpoint.publishing import (CheckpointOutput, DataFileSet, WrittenShare,
                                                 merge_shares)
from dcpctl.format.checkpoint.sharding import (RankChunk, check_world_size, place_like_a_save,
                                               shard_dim0_chunks)
from dcpctl.format.checkpoint.view import open_checkpoint
from dcpctl.format.dtypes import LEGACY_STORAGE_TYPES, DType, dtype_by_name, fits_in_torch
from dcpctl.format.file_names import rank_file_name
from dcpctl.format.metadata.records import (BytesMetadata, CheckpointMetadata, ChunkMetadata,
                                            MetadataIndex, StorageInfo, StorageMeta, TensorMetadata,
                                            TensorProperties)
from dcpctl.format.safetensors import SafetensorsTensor, read_safetensors_model
from dcpctl.format.torch_save.layout import last_element_index
from dcpctl.format.torch_save.writer import iter_torch_save_archive
from dcpctl.format.torch_save.zip_records import ZipRecord
from dcpctl.ops.convert.report import ConvertReport, ProgressCallback, WrittenFile, run_in_order
from dcpctl.ops.convert.tensor_bytes import torch_dtype
from dcpctl.storage.locks import locked_checkpoint
from dcpctl.storage.paths import StoragePath, is_remote, open_ranged, storage_path

if TYPE_CHECKING:
    import torch

DCP_VERSION = "1.0.0"


@dataclass(frozen=True)
class SourceEntry:
    """A tensor or object to carry into the checkpoint, with its key path in the state dict.
    A tensor gives a chunk's row-major bytes through read_chunk; an object is its value."""

    key_path: tuple
    dtype: DType | None = None
    shape: tuple[int, ...] = ()
    read_chunk: Callable[[RankChunk], bytearray] | None = None
    value: Any = None

    @property
    def fqn(self) -> str:
        """The flattened key, as DCP joins a key path."""
        return ".".join(map(str, self.key_path))

    @property
    def is_tensor(self) -> bool:
        """Whether this is a tensor (else a pickled object)."""
        return self.read_chunk is not None


@dataclass(frozen=True)
class _Item:
    """One item of a rank's file: an object, or a tensor's chunk."""

    entry: SourceEntry
    chunk: RankChunk | None
    chunk_index: int | None


def prefix_key_path(prefix: str) -> tuple[str, ...]:
    """The keys --prefix nests every entry under: `model.` (or `model`) is ("model",), `a.b.`
    is ("a", "b"); a key left empty (`a..b.`, `.model.`) is refused, not dropped."""
    keys = tuple(prefix.removesuffix(".").split(".")) if prefix else ()
    if "" in keys:
        raise InvalidOptionError(f"--prefix {prefix!r} leaves a key empty: give keys joined by "
                                 "dots, such as `model.`")
    return keys


def read_source(source: Path, prefix: str) -> tuple[str, list[SourceEntry]]:
    """The source's format (`safetensors` or `torch`) and its entries, nested under prefix
    (`model.` puts every key under `model`)."""
    prefix_path = prefix_key_path(prefix)
    if not source.exists():
        raise DataError("no such file or directory", path=source)
    if source.is_dir() or source.suffix == ".safetensors":
        return "safetensors", [_safetensors_entry(path, tensor, prefix_path)
                               for path, tensor in read_safetensors_model(source)]
    if is_remote(source):  # torch's loader reads a local file
        raise UnsupportedLayoutError("a torch.save file is read from a local path only; copy "
                                     "it out of the object store first", path=source)
    return "torch", _torch_save_entries(source, prefix_path)


def _safetensors_entry(path: Path, tensor: SafetensorsTensor, prefix_path: tuple) -> SourceEntry:
    def read_chunk(chunk: RankChunk) -> bytearray:
        return _read_rows(path, tensor.start, tensor.dtype, tensor.shape, chunk)

    return SourceEntry(prefix_path + (tensor.name,), tensor.dtype, tensor.shape, read_chunk)


def _read_rows(path: Path, start: int, dtype: DType, shape: tuple[int, ...],
               chunk: RankChunk) -> bytearray:
    """The bytes of a chunk of whole rows of a row-major tensor stored in a file from byte
    start."""
    first_element = chunk.offsets[0] * math.prod(shape[1:]) if chunk.offsets else 0
    length = math.prod(chunk.sizes) * dtype.itemsize
    buffer = bytearray(length)
    offset = start + first_element * dtype.itemsize
    with open_ranged(path) as reader:
        count = reader.readinto(buffer, offset)
    if count != length:
        raise truncated_error(path, None, offset, offset + length, offset + count)
    return buffer


def _torch_save_entries(path: Path, prefix_path: tuple) -> list[SourceEntry]:
    """The entries of a torch.save file, flattened as dcp.save flattens a state dict; tensor
    bytes are read from the file a chunk at a time."""
    import torch
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict

    from dcpctl.format.torch_save.skeleton import open_torch_save, refuse_tensors_in_object

    state, records = open_torch_save(path)
    if not isinstance(state, dict):
        raise UnsupportedLayoutError(f"holds a {type(state).__name__}, not a state dict", path=path)
    try:
        flat, key_paths = flatten_state_dict(state)
    except ValueError as error:  # two keys flatten to one fqn
        raise DataError(f"{error}", path=path) from None
    entries = []
    for fqn, value in flat.items():
        key_path = prefix_path + tuple(key_paths[fqn])
        if isinstance(value, torch.Tensor):
            entries.append(_torch_tensor_entry(path, key_path, value, records))
        else:
            refuse_tensors_in_object(path, fqn, value)
            entries.append(SourceEntry(key_path, value=value))
    return entries


def _torch_tensor_entry(path: Path, key_path: tuple, placeholder: torch.Tensor,
                        records: dict[int, ZipRecord]) -> SourceEntry:
    """A tensor of a torch.save file, from its meta-device placeholder."""
    import torch

    from dcpctl.format.torch_save.skeleton import storage_file_offset
    from dcpctl.ops.convert.tensor_bytes import bytes_of

    name = '.'.join(map(str, key_path))
    if (type(placeholder) not in (torch.Tensor, torch.nn.Parameter)
            or placeholder.layout != torch.strided):
        raise UnsupportedLayoutError(f"{name!r} is a {type(placeholder).__name__} "
                                     f"({placeholder.layout}), not a plain tensor", path=path)
    if placeholder.is_conj() or placeholder.is_neg():
        raise UnsupportedLayoutError(f"{name!r} was saved as a conjugate or negative view "
                                     "(torch's conj/neg bit): its values are not its stored "
                                     "bytes; save it with .resolve_conj().resolve_neg() first",
                                     path=path)
    try:
        dtype = dtype_by_name(str(placeholder.dtype))
    except UnsupportedLayoutError:
        raise UnsupportedLayoutError(f"{name!r} has dtype {placeholder.dtype}, which dcpctl "
                                     "does not convert", path=path) from None
    shape = tuple(placeholder.shape)
    _refuse_view_past_its_storage(path, name, placeholder, dtype)
    start = (storage_file_offset(path, name, placeholder, records)
             + placeholder.storage_offset() * dtype.itemsize)
    if placeholder.is_contiguous():
        def read_chunk(chunk: RankChunk) -> bytearray:
            return _read_rows(path, start, dtype, shape, chunk)
    else:  # a view saved with its strides: read the span it covers, then take the rows
        stride = placeholder.stride()
        span = last_element_index(shape, stride) + 1 if placeholder.numel() else 0

        def read_chunk(chunk: RankChunk) -> bytearray:
            whole = _read_rows(path, start, dtype, (span,), RankChunk((0,), (span,), range(1)))
            rows = torch.frombuffer(whole, dtype=torch_dtype(dtype)).as_strided(shape, stride)
            rows = rows.narrow(0, chunk.offsets[0], chunk.sizes[0]) if chunk.sizes else rows
            return bytearray(bytes_of(rows))
    return SourceEntry(key_path, dtype, shape, read_chunk)


def _refuse_view_past_its_storage(path: Path, name: str, placeholder, dtype: DType) -> None:
    """torch works a view's extent out in int64, so one of sizes, strides or offset near 2**63
    wraps around to fit its storage; worked out here without wrapping, it must."""
    shape, strides = tuple(placeholder.shape), placeholder.stride()
    offset, storage_bytes = placeholder.storage_offset(), placeholder.untyped_storage().nbytes()
    last = last_element_index(shape, strides, offset) if math.prod(shape) else -1
    end = (last + 1) * dtype.itemsize
    if (not fits_in_torch(shape, dtype.itemsize) or offset < 0 or min(strides, default=0) < 0
            or end > storage_bytes):
        raise DataError(f"{name!r} is a view of shape {list(shape)}, strides {list(strides)} "
                        f"and offset {offset} that does not lie inside its storage of "
                        f"{storage_bytes} bytes", path=path)


def plan_items(entries: list[SourceEntry], ranks: int) -> list[list[_Item]]:
    """Each rank's items in file order, objects first, then tensor chunks, on the rank files
    a real save of that many ranks puts them (sharding.py: objects and 0-d tensors once, where
    torch's deduplication puts them)."""
    planned = [(entry, chunk, index) for entry in entries
               for index, chunk in (enumerate(shard_dim0_chunks(entry.shape, ranks))
                                    if entry.is_tensor else [(None, None)])]
    placed = place_like_a_save(
        [(chunk.holders, math.prod(entry.shape) * entry.dtype.itemsize) if chunk is not None
         else (range(ranks), 0) for entry, chunk, _ in planned], ranks)
    items: list[list[_Item]] = [[] for _ in range(ranks)]
    for (entry, chunk, index), rank in zip(planned, placed):
        if chunk is None:
            items[rank].append(_Item(entry, None, None))
    for (entry, chunk, index), rank in zip(planned, placed):
        if chunk is not None:
            items[rank].append(_Item(entry, chunk, index))
    return items


def _item_bytes(item: _Item) -> Iterator[bytes]:
    """The item as torch's FileSystemWriter stores it: a torch.save of the chunk or object."""
    if item.chunk is not None and item.entry.dtype.name in LEGACY_STORAGE_TYPES:
        yield from iter_torch_save_archive(item.entry.dtype, item.chunk.sizes,
                                           [item.entry.read_chunk(item.chunk)])
        return
    import torch  # objects, and dtypes newer than the archive writer knows

    value = item.entry.value
    if item.chunk is not None:
        data = item.entry.read_chunk(item.chunk)
        dtype = torch_dtype(item.entry.dtype)
        value = (torch.frombuffer(data, dtype=dtype) if data else torch.empty(0, dtype=dtype)
                 ).reshape(item.chunk.sizes)
    buffer = io.BytesIO()
    torch.save(value, buffer)
    yield buffer.getbuffer()


def _item_nbytes(item: _Item) -> int:
    """The tensor bytes of an item (0 for an object)."""
    return 0 if item.chunk is None else math.prod(item.chunk.sizes) * item.entry.dtype.itemsize


@dataclass(frozen=True)
class DcpWritePlanning:
    """What the plan of a conversion to DCP is a pure function of (execution/jobs.py): each
    worker reads the source's entries again."""

    source: str
    prefix: str
    ranks: int

    def plan(self) -> list[list[_Item]]:
        return plan_items(read_source(storage_path(self.source), self.prefix)[1], self.ranks)


@dataclass(frozen=True)
class DcpWriteJob:
    """Writing the rank files of a conversion to DCP (execution/jobs.py): its lanes are the
    rank files, by tensor bytes."""

    planning: DcpWritePlanning
    files: DataFileSet
    threads: int

    def lane_sizes(self, plan: list[list[_Item]]) -> list[int]:
        return [sum(map(_item_nbytes, items)) for items in plan]

    def run_share(self, plan: list[list[_Item]], lanes: list[int],
                  advance: Callable[[int], None]) -> WrittenShare:
        storage_data: dict[MetadataIndex, StorageInfo] = {}
        for rank in lanes:
            name = rank_file_name(rank)
            writer = self.files.data_file(name)

            def write(item: _Item, pieces) -> None:
                start = writer.size_bytes
                for piece in pieces:
                    writer.write(piece)
                offsets = None if item.chunk is None else item.chunk.offsets
                storage_data[MetadataIndex(item.entry.fqn, offsets, item.chunk_index)] = \
                    StorageInfo(name, start, writer.size_bytes - start)
                advance(_item_nbytes(item))

            run_in_order(_item_bytes, plan[rank], write, self.threads)
            self.files.finish_data_file(name)
        return WrittenShare(storage_data, self.files.finish_data_files())


def write_dcp(source: str, prefix: str, entries: list[SourceEntry], ranks: int,
              output: CheckpointOutput, threads: int, workers: int = 1,
              on_progress: ProgressCallback | None = None) -> list[WrittenFile]:
    """Write every rank's file, on `workers` processes, and publish the metadata naming
    them."""
    plan = plan_items(entries, ranks)
    names = [rank_file_name(rank) for rank in range(ranks)]
    job = DcpWriteJob(DcpWritePlanning(source, prefix, ranks), output.data_files(names),
                      threads)
    storage_data, digests = merge_shares(run_job(job, plan, workers, on_progress))
    output.publish(_metadata(entries, ranks, storage_data, output.destination), digests)
    sizes = {name: 0 for name in names}
    for info in storage_data.values():
        sizes[info.relative_path] = max(sizes[info.relative_path], info.offset + info.length)
    return [WrittenFile(name, sizes[name], sum(item.chunk is not None for item in items))
            for name, items in zip(names, plan, strict=True)]


def _metadata(entries: list[SourceEntry], ranks: int, storage_data: dict,
              destination: Path) -> CheckpointMetadata:
    state_dict_metadata = {}
    for entry in entries:
        if entry.is_tensor:
            chunks = [ChunkMetadata(chunk.offsets, chunk.sizes)
                      for chunk in shard_dim0_chunks(entry.shape, ranks)]
            state_dict_metadata[entry.fqn] = TensorMetadata(TensorProperties(entry.dtype),
                                                            entry.shape, chunks)
        else:
            state_dict_metadata[entry.fqn] = BytesMetadata()
    return CheckpointMetadata(
        state_dict_metadata, planner_data={entry.fqn: entry.key_path for entry in entries},
        storage_data=storage_data,
        storage_meta=StorageMeta(_checkpoint_id(destination), str(uuid.uuid4())),
        version=DCP_VERSION)


def _checkpoint_id(destination: StoragePath) -> str | PurePosixPath:
    """What torch's writers record as the checkpoint's id: its absolute path, or its URL."""
    if is_remote(destination):
        return str(destination)
    return PurePosixPath(os.path.abspath(destination))


def convert_to_dcp(source: str | os.PathLike, output: str | os.PathLike, ranks: int = 1,
                   prefix: str = "", threads: int | None = None, overwrite: bool = False,
                   on_progress: ProgressCallback | None = None,
                   workers: int = 1) -> ConvertReport:
    """Convert safetensors files (a file, or a directory with an index) or a torch.save file
    into a DCP checkpoint at output, laid out for `ranks` ranks, on `workers` processes of
    `threads` threads each (each process writes whole rank files)."""
    started = time.perf_counter()
    threads = threads_per_worker(threads, storage_path(source), workers)
    check_world_size(ranks)
    refuse_unconsolidated_save(storage_path(source), "no safetensors model to convert")
    if is_hf_storage_shards(storage_path(source)):
        return _convert_shards(source, output, ranks, prefix, threads, overwrite, on_progress,
                               workers, started)
    with locked_checkpoint(source, exclusive=False):  # not replaced while it is read
        return _convert_file_or_files(source, output, ranks, prefix, threads, overwrite,
                                      on_progress, workers, started)


def _convert_file_or_files(source: str | os.PathLike, output: str | os.PathLike, ranks: int,
                           prefix: str, threads: int, overwrite: bool,
                           on_progress: ProgressCallback | None, workers: int,
                           started: float) -> ConvertReport:
    plan_ahead(DcpWritePlanning(str(source), prefix, ranks))  # workers read it as this does
    source_format, entries = read_source(storage_path(source), prefix)
    output_path = storage_path(output)
    checkpoint_output = CheckpointOutput(output_path, in_place=False, source=storage_path(source),
                                         overwrite=overwrite)
    try:
        files = write_dcp(str(source), prefix, entries, ranks, checkpoint_output, threads,
                          workers, on_progress)
    except BaseException:
        checkpoint_output.abort()
        raise
    report = ConvertReport(str(source), str(output), source_format, "dcp",
                           objects=sum(not entry.is_tensor for entry in entries), ranks=ranks,
                           threads=threads, workers=workers, files=files)
    report.count_tensors(math.prod(entry.shape) * entry.dtype.itemsize
                         for entry in entries if entry.is_tensor)
    report.seconds = time.perf_counter() - started
    return report


def _convert_shards(source: str | os.PathLike, output: str | os.PathLike, ranks: int,
                    prefix: str, threads: int, overwrite: bool,
                    on_progress: ProgressCallback | None, workers: int,
                    started: float) -> ConvertReport:
    """A directory of the ranks' files of torch's HuggingFaceStorageWriter: its tensors are in
    chunks, which a reshard lays out for `ranks` ranks as they are."""
    from dcpctl.ops.reshard.execution import reshard_checkpoint

    if prefix:
        raise InvalidOptionError(
            f"--prefix does not apply to {source}, the ranks' files of torch's "
            "HuggingFaceStorageWriter: their keys are kept as they are")
    resharded = reshard_checkpoint(source, ranks, str(output), threads=threads,
                                   overwrite=overwrite, on_progress=on_progress, workers=workers)
    written = open_checkpoint(output)
    tensors_by_file = Counter(chunk.storage.relative_path for tensor in written.tensors
                              for chunk in tensor.chunks)
    report = ConvertReport(
        str(source), str(output), "safetensors (HuggingFaceStorageWriter shards)", "dcp",
        objects=resharded.objects, ranks=ranks, threads=threads, workers=workers,
        files=[WrittenFile(name, data_file.size_bytes or 0, tensors_by_file[name])
               for name, data_file in sorted(written.files.items())])
    report.count_tensors(tensor.nbytes for tensor in written.tensors)
    report.seconds = time.perf_counter() - started
    return report

"""torch `StorageReader`s that `dcp.load` uses to load a checkpoint dcpctl can read: locally
torch's own FileSystemReader (with dcpctl's transforms registered), in an object store one that
fetches only the byte ranges this rank's load plan needs, several at once.

The remote reader sorts the stored items the plan needs by file and offset, joins neighbours
into ranges of at most MERGED_RANGE_BYTES and fetches up to RANGES_IN_FLIGHT of them at once,
handing each item to torch as its range arrives; memory stays bounded by the ranges in flight.
Either way `.metadata` is read once and refused unless dcpctl's allowlist reader accepts it,
before torch unpickles it (torch's own reader runs whatever a hostile one names), and every
item is checked against the CRC-32s of its torch.save archive before torch loads it
(CheckedTransforms).
"""

from __future__ import annotations

import collections
import contextlib
import io
import os
import pickle
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Callable, Iterable, Iterator, Sequence, cast

import torch
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.futures import Future as TorchFuture

from dcpctl.errors import DataError, DcpctlError
from dcpctl.format.checkpoint.view import resolve_inside
from dcpctl.format.codecs.base import PieceStream
from dcpctl.format.codecs.torch_extension import extension_registry
from dcpctl.format.file_names import METADATA_FILE_NAME, rank_metadata_file_name
from dcpctl.format.metadata.reading import parse_metadata
from dcpctl.format.torch_save.archive_check import (ArchiveCheck, ArchiveStreamCheck,
                                                    check_archive, spooled_read_range)
from dcpctl.format.torch_save.zip_records import LOCAL_SIGNATURE
from dcpctl.storage.objects import ObjectPath
from dcpctl.storage.paths import StoragePath, read_whole, storage_path

MERGED_RANGE_BYTES = 16 << 20
RANGES_IN_FLIGHT = 8


def storage_reader(path: str | os.PathLike) -> FileSystemReader:
    """A torch StorageReader for the checkpoint at path (a local directory or a URL) that
    decodes every transform dcpctl writes."""
    location = storage_path(path)
    if isinstance(location, ObjectPath):
        return ObjectStoreReader(location)
    return LocalReader(location)


def torch_metadata(data: bytes, path: StoragePath, load_id: str) -> Metadata:
    """The metadata file at path, read as data, as torch's reader makes it, once dcpctl's
    allowlist reader accepted the pickle (torch's own reader unpickles whatever it finds,
    running what it names) and every data file it names lies inside its directory (torch's
    reader opens whatever path it is given: `../other/__0_0.distcp`, an absolute path, a
    symlink out)."""
    parse_metadata(data, str(path))  # refuses anything but DCP metadata, running nothing
    metadata = pickle.loads(data)  # what the allowlist reader accepted: torch's classes
    for relative_path in {info.relative_path for info in metadata.storage_data.values()}:
        resolve_inside(path.parent, relative_path)
    if getattr(metadata, "storage_meta", None) is None:
        metadata.storage_meta = StorageMeta()
    metadata.storage_meta.load_id = load_id
    return metadata


class CheckedTransforms:
    """A reader's transforms (torch's `_StorageReaderTransforms`), each item's stream checked
    as every dcpctl command checks what it reads: the torch.save archive it holds matches the
    CRC-32 of each of its records. torch.load checks none, and neither a plain item nor torch's
    zstd frames nor a floatsplit stream of plain bytes (an integer tensor, an object, a small
    float tensor) keeps a check of its own: a flipped bit loaded as a wrong value."""

    def __init__(self, transforms: Any) -> None:
        self._transforms = transforms

    def transform_load_stream(self, read_item: ReadItem, transform_descriptors: Sequence[str],
                              raw_stream: IO[bytes]) -> IO[bytes]:
        fqn = read_item.storage_index.fqn
        if not transform_descriptors:  # checked where it lies, then read by torch as it was
            with _named_item(fqn):
                _check_archive_at(raw_stream)
            return raw_stream

        def decoded() -> Iterator[bytes]:
            stream = self._transforms.transform_load_stream(read_item, transform_descriptors,
                                                            raw_stream)
            if isinstance(stream, PieceStream):  # floatsplit's: its pieces as they come
                return stream.iter_pieces()
            return iter(lambda: stream.read(_DECODED_PIECE_BYTES), b"")

        def decoded_again() -> Iterator[bytes]:
            raw_stream.seek(0)
            return decoded()

        return PieceStream(_checked_as_archive(decoded(), decoded_again, fqn))


@contextlib.contextmanager
def _named_item(fqn: str) -> Iterator[None]:
    """A failure to read an item, named with the item (torch's message names no item)."""
    try:
        yield
    except DcpctlError as error:
        raise error.located(fqn=fqn)


_DECODED_PIECE_BYTES = 4 << 20


def _check_archive_at(stream: IO[bytes]) -> None:
    """Check the archive a seekable stream holds from its start; leave it at its start."""
    stream.seek(0, os.SEEK_END)
    length_bytes = stream.tell()

    def read_range(start: int, count: int) -> bytes:
        stream.seek(start)
        return stream.read(count)

    try:
        if read_range(0, len(LOCAL_SIGNATURE)) == LOCAL_SIGNATURE:
            _refuse_mismatches(lambda: check_archive(read_range, length_bytes,
                                                     expect_tensor=False))
    finally:
        stream.seek(0)


def _checked_as_archive(pieces: Iterator[bytes], reread: Callable[[], Iterable[bytes]],
                        fqn: str) -> Iterator[bytes]:
    """pieces, the decoded bytes of the item fqn, passed on as they come and checked at their
    end; reread gives them again, for the rare archive whose records a streamed check cannot
    reach."""
    with _named_item(fqn):
        check = ArchiveStreamCheck()
        for piece in pieces:
            check.update(piece)
            yield piece
        if check.starts_with(LOCAL_SIGNATURE):
            _refuse_mismatches(lambda: check.finish(
                expect_tensor=False, open_random_access=lambda: spooled_read_range(reread())))


def _refuse_mismatches(check: Callable[[], ArchiveCheck]) -> None:
    """Run check; raise DataError where the archive is not intact or a record's bytes do not
    match its CRC-32. (Bytes that are no archive, a tensor's bare bytes in a SAFETENSORS
    checkpoint, are never checked: they carry no CRC-32.)"""
    try:
        checked = check()
    except DataError as error:
        raise DataError(f"damaged: the item is no intact torch.save archive: "
                        f"{error.message}") from None
    for record, actual_crc in checked.crc_mismatches[:1]:
        raise DataError(f"damaged: record {record.name!r} (bytes {record.data_offset}.."
                        f"{record.data_end} of the item as torch reads it) has CRC-32 "
                        f"{actual_crc:08x}, its archive says {record.crc32:08x}")


class LocalReader(FileSystemReader):
    """torch's FileSystemReader, `.metadata` read through torch_metadata and every item
    checked (CheckedTransforms)."""

    def __init__(self, path: StoragePath) -> None:
        super().__init__(path, _extension_registry=extension_registry())
        self.transforms = CheckedTransforms(self.transforms)

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as stream:
            data = stream.read()
        return torch_metadata(data, Path(path), self.load_id)


@dataclass
class _Range:
    """Neighbouring stored items of one file, fetched with one ranged read."""

    relative_path: str
    start: int
    end: int
    requests: list[ReadItem] = field(default_factory=list)


class ObjectStoreReader(FileSystemReader):
    """Loads a checkpoint from an object store (see module docstring)."""

    def __init__(self, path: ObjectPath) -> None:
        super().__init__(str(path), _extension_registry=extension_registry())
        self.transforms = CheckedTransforms(self.transforms)
        self.location: StoragePath = path

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        self.storage_data = {}
        if checkpoint_id:
            self.location = storage_path(checkpoint_id)
        self.load_id = uuid.uuid4().hex

    @property
    def checkpoint_id(self) -> str:
        return str(self.location)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return "://" in str(checkpoint_id)

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        rank = kwargs.get("rank")  # a save with use_collectives=False: each rank reads its own
        path = self.location / (METADATA_FILE_NAME if rank is None
                                else rank_metadata_file_name(rank))
        path.store.list_tree(self.location.key, pin_current=True)  # this load reads them now
        return torch_metadata(read_whole(path), path, self.load_id)

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> TorchFuture:
        ranges = self._merged_ranges(plan.items)
        with ThreadPoolExecutor(max_workers=RANGES_IN_FLIGHT,
                                thread_name_prefix="dcpctl-load") as pool:
            pending: collections.deque = collections.deque()
            for merged in ranges:
                pending.append((merged, pool.submit(self._fetch, merged)))
                if len(pending) >= RANGES_IN_FLIGHT:
                    self._load_range(*pending.popleft(), planner)
            while pending:
                self._load_range(*pending.popleft(), planner)
        done: TorchFuture = TorchFuture()
        done.set_result(None)
        return done

    def _merged_ranges(self, requests: list[ReadItem]) -> list[_Range]:
        by_item: dict[tuple[str, int, int], list[ReadItem]] = {}
        for request in requests:
            info = self.storage_data[request.storage_index]
            by_item.setdefault((info.relative_path, info.offset, info.length), []).append(request)
        ranges: list[_Range] = []
        for (relative_path, offset, length), item_requests in sorted(by_item.items()):
            last = ranges[-1] if ranges else None
            if (last is not None and last.relative_path == relative_path
                    and offset == last.end and offset + length - last.start <= MERGED_RANGE_BYTES):
                last.end = offset + length
            else:
                last = _Range(relative_path, offset, offset + length)
                ranges.append(last)
            last.requests += item_requests
        return ranges

    def _fetch(self, merged: _Range) -> bytes:
        path = cast(ObjectPath, resolve_inside(self.location, merged.relative_path))
        data = path.store.read_range(path.key, merged.start, merged.end)
        if len(data) != merged.end - merged.start:
            raise OSError(f"{path}: truncated: bytes {merged.start}..{merged.end} wanted, the "
                          f"object ends at byte {merged.start + len(data)}")
        return data

    def _load_range(self, merged: _Range, fetched: Future, planner: LoadPlanner) -> None:
        data = memoryview(fetched.result())
        for request in merged.requests:
            info = self.storage_data[request.storage_index]
            stored = io.BytesIO(data[info.offset - merged.start:
                                     info.offset - merged.start + info.length])
            stream = self.transforms.transform_load_stream(
                request, info.transform_descriptors or (), stored)
            if request.type == LoadItemType.BYTE_IO:
                planner.load_bytes(request, io.BytesIO(stream.read(-1)))
                continue
            seekable = stream if stream.seekable() else io.BytesIO(stream.read(-1))
            tensor = cast(torch.Tensor, torch.load(seekable, map_location="cpu",
                                                   weights_only=True))
            tensor = narrow_tensor_by_index(tensor, request.storage_offsets, request.lengths)
            target = planner.resolve_tensor(request).detach()
            if target.size() != tensor.size():
                raise AssertionError(f"req {request.storage_index} mismatch sizes "
                                     f"{target.size()} vs {tensor.size()}")
            target.copy_(tensor)
            planner.commit_tensor(request, target)

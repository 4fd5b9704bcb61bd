"""What the metadata and the file sizes alone show to be wrong: the structure checks.

`verify` lists every problem they find; every command that moves data opens a checkpoint with
open_checked_checkpoint, which refuses one that has any (what `verify --quick` calls damaged):
nothing is planned from metadata that cannot be right.
"""

from __future__ import annotations

import contextlib
import math
import os
from collections import defaultdict
from itertools import accumulate, chain, compress, islice, repeat
from operator import attrgetter, eq, is_, itemgetter, le
from dataclasses import dataclass
from typing import Callable, Iterator

from dcpctl.cycle_collector import paused_cycle_collector
from dcpctl.format.checkpoint.checksums import (absent_listed_files, read_sha256sums,
                                                refuse_sha256sums_mismatch)
from dcpctl.format.checkpoint.locations import ExpectedTensor
from dcpctl.format.checkpoint.problems import Problem, Rule, problems_error
from dcpctl.format.checkpoint.rewrites import rewrite_named
from dcpctl.format.checkpoint.side_files import (misplaced_side_files, side_file_problems,
                                                 side_files_of)
from dcpctl.format.checkpoint.view import (SAFETENSORS, Checkpoint, TensorEntry, find_file_problems,
                                           open_checkpoint)
from dcpctl.format.codecs.base import max_decoded_bytes
from dcpctl.format.metadata.records import ChunkMetadata, StorageInfo
from dcpctl.storage.locks import locked_checkpoint
from dcpctl.storage.paths import storage_path


@dataclass(slots=True)
class StoredItem:
    """One item of the metadata: an fqn's stored bytes, with its chunk if it is a tensor's
    (one per chunk, so not frozen: README, Layout of the source)."""

    fqn: str
    storage: StorageInfo
    tensor: TensorEntry | None = None
    chunk: ChunkMetadata | None = None

    @property
    def end(self) -> int:
        """Offset one past the item's last byte in its file."""
        return self.storage.offset + self.storage.length

    @property
    def expected(self) -> ExpectedTensor | None:
        """What a tensor item must hold; None for an object."""
        if self.tensor is None or self.chunk is None:
            return None
        return ExpectedTensor(self.tensor.dtype, tuple(self.chunk.sizes))

    @property
    def chunk_nbytes(self) -> int:
        """Bytes of the chunk's elements (0 for objects)."""
        expected = self.expected
        return 0 if expected is None else expected.nbytes


def list_stored_items(checkpoint: Checkpoint) -> list[StoredItem]:
    """Every item the metadata locates: tensor chunks and objects with storage, and the
    replicas of a checkpoint read from its ranks' own metadata (rank_metadata.py)."""
    items = [StoredItem(tensor.fqn, chunk.storage, tensor, chunk)
             for tensor in checkpoint.tensors for chunk in tensor.chunks
             if chunk.storage is not None]
    items += [StoredItem(entry.fqn, entry.storage) for entry in checkpoint.objects
              if entry.storage is not None]
    if checkpoint.replicas:
        tensors = {tensor.fqn: tensor for tensor in checkpoint.tensors}
        items += [StoredItem(replica.key.fqn, replica.storage,
                             tensors.get(replica.key.fqn) if replica.tensor is None else
                             TensorEntry(replica.key.fqn, replica.tensor.properties.dtype,
                                         tuple(replica.tensor.size), [replica.chunk]),
                             replica.chunk) for replica in checkpoint.replicas]
    return items


def safetensors_files(checkpoint: Checkpoint) -> set[str]:
    """The names of the checkpoint's SAFETENSORS-serialized data files."""
    return {name for name, data_file in checkpoint.files.items()
            if data_file.serialization == SAFETENSORS}


def is_safetensors_tensor(item: StoredItem, safetensors_file_names: set[str]) -> bool:
    """Whether the item is a tensor inside a SAFETENSORS-serialized file (located through the
    file's safetensors header, not by its own byte range); safetensors_file_names as
    safetensors_files gives them."""
    return item.tensor is not None and item.storage.relative_path in safetensors_file_names


@contextlib.contextmanager
def checked_checkpoint(path: str | os.PathLike, exclusive: bool = False, check_sums: bool = True,
                       threads: int | None = None,
                       on_progress: Callable[[int, int], None] | None = None,
                       once_held: Callable[[], None] | None = None) -> Iterator[Checkpoint]:
    """open_checked_checkpoint(path), the checkpoint held while the block runs: exclusively to
    change it, shared to read its data (storage/locks.py). With check_sums, when it holds
    SHA256SUMS, every file it lists is hashed first, on `threads` threads, and must match (a
    file of a few bytes whose CRC-32 happens to hold is caught, and so are the bytes no CRC
    covers); on_progress(bytes_done, total_bytes) follows that hashing. once_held() is called
    once the checkpoint is held, before it is read (to have workers plan ahead from there).
    A failure that came of another run rewriting it meanwhile, in an object store, is said as
    such (rewrites.rewrite_named)."""
    with locked_checkpoint(path, exclusive), rewrite_named(storage_path(path)):
        if once_held is not None:
            once_held()
        checkpoint = open_checked_checkpoint(path)
        if check_sums:
            refuse_sha256sums_mismatch(checkpoint, threads, on_progress)
        yield checkpoint


def open_checked_checkpoint(path: str | os.PathLike) -> Checkpoint:
    """Open a checkpoint to move its data, refusing it if the metadata and file sizes already
    show it damaged, or a side file's name holds no regular file (what `verify --quick`
    reports, SHA256SUMS aside)."""
    checkpoint = open_checkpoint(path, check_files=False)  # check_structure words those too
    with paused_cycle_collector():
        problems = check_structure(checkpoint)
    problems += misplaced_side_files(checkpoint)
    if problems:
        raise problems_error(problems, checkpoint.path)
    return checkpoint


def open_quickly_verified(path: str | os.PathLike) -> Checkpoint:
    """open_checked_checkpoint, refused also where its SHA256SUMS lists a file that is gone, or
    a side file is cut short (side_file_problems, not deep): all that `verify --quick` reports
    short of hashing and of files no one knows (what ls and prune call damage)."""
    checkpoint = open_checked_checkpoint(path)
    problems = absent_listed_files(checkpoint.path, read_sha256sums(checkpoint.path) or {})
    problems += side_file_problems(checkpoint.path, side_files_of(checkpoint), deep=False)
    if problems:
        raise problems_error(problems, checkpoint.path)
    return checkpoint


def check_structure(checkpoint: Checkpoint) -> list[Problem]:
    """Missing and truncated files, overlapping items, chunks that do not tile their tensor,
    entries without storage, and stored lengths that contradict dtype and shape."""
    problems = find_file_problems(checkpoint)
    problems += _overlapping_items(checkpoint)
    problems += _storage_link_problems(checkpoint)
    for tensor in checkpoint.tensors:
        problems += _chunk_cover_problems(tensor)
    problems += _stored_length_problems(checkpoint)
    return problems


def _overlapping_items(checkpoint: Checkpoint) -> list[Problem]:
    """Items that share bytes of a file. Where every chunk and object has a storage entry of
    its own (Checkpoint.joined_one_to_one), the items are the storage entries: they are looked
    for only in files whose entries the metadata does not list in order and apart
    (DataFile.items_apart). Elsewhere two chunks may hold one entry, and every file is."""
    unordered = {name for name, data_file in checkpoint.files.items()
                 if not (data_file.items_apart and checkpoint.joined_one_to_one)}
    if not unordered:
        return []
    items = list_stored_items(checkpoint)
    safetensors_names = safetensors_files(checkpoint)
    spans_by_file: dict[str, list[tuple[int, int, int]]] = defaultdict(list)  # offset, index, end
    for index, item in enumerate(items):
        storage = item.storage
        if (storage.length and storage.relative_path in unordered
                and not (safetensors_names and is_safetensors_tensor(item, safetensors_names))):
            spans_by_file[storage.relative_path].append(
                (storage.offset, index, storage.offset + storage.length))
    problems = []
    for name, spans in sorted(spans_by_file.items()):
        spans.sort()
        _, furthest, furthest_end = spans[0]
        for offset, index, end in spans[1:]:
            if offset < furthest_end:
                problems.append(Problem(
                    Rule.ITEM_OVERLAP, f"items share bytes {offset}..{min(end, furthest_end)}",
                    name, offset, min(end, furthest_end), (items[furthest].fqn, items[index].fqn)))
            if end > furthest_end:
                furthest_end, furthest = end, index
    return problems


def _storage_link_problems(checkpoint: Checkpoint) -> list[Problem]:
    """Chunks and objects without storage, and storage entries that no chunk or object has."""
    if checkpoint.joined_one_to_one:
        return []
    problems = []
    linked = list(chain.from_iterable(map(_storages_of_chunks, checkpoint.tensors)))
    linked += map(_STORAGE, checkpoint.objects)
    if any(map(is_, linked, repeat(None))):
        problems += _unlinked_entries(checkpoint)
    storage_data = checkpoint.metadata.storage_data or {}
    # Opening the checkpoint gave each chunk and object the entry of its key, so when every
    # entry is a record of its own, an entry no key reached is one that no chunk has.
    unlinked = set(map(id, storage_data.values()))
    shared = len(unlinked) != len(storage_data)
    unlinked.difference_update(map(id, linked))
    if shared or unlinked:
        problems += _orphan_entries(checkpoint)
    return problems


_STORAGE = attrgetter("storage")


def _storages_of_chunks(tensor: TensorEntry) -> Iterator[StorageInfo | None]:
    return map(_STORAGE, tensor.chunks)


def _unlinked_entries(checkpoint: Checkpoint) -> list[Problem]:
    problems = []
    for tensor in checkpoint.tensors:
        for chunk in tensor.chunks:
            if chunk.storage is None:
                problems.append(Problem(Rule.NO_STORAGE, f"chunk at offsets {list(chunk.offsets)} "
                                        "has no storage_data entry", fqns=(tensor.fqn,)))
    for entry in checkpoint.objects:
        if entry.storage is None:
            problems.append(Problem(Rule.NO_STORAGE, "object has no storage_data entry",
                                    fqns=(entry.fqn,)))
    return problems


def _orphan_entries(checkpoint: Checkpoint) -> list[Problem]:
    expected_keys = {(tensor.fqn, chunk.offsets)
                     for tensor in checkpoint.tensors for chunk in tensor.chunks}
    expected_keys.update((entry.fqn, None) for entry in checkpoint.objects)
    return [Problem(Rule.ORPHAN_STORAGE, f"storage_data entry at offsets {key.offset} matches no "
                    "chunk of the entry", info.relative_path, info.offset,
                    info.offset + info.length, (key.fqn,))
            for key, info in (checkpoint.metadata.storage_data or {}).items()
            if (key.fqn, key.offset) not in expected_keys]


def _chunk_cover_problems(tensor: TensorEntry) -> list[Problem]:
    """The chunks must tile the tensor: no two overlap, and together they hold every element."""
    if len(tensor.chunks) >= _MANY_CHUNKS and (_tiles_by_rows(tensor) or _tiles_as_grid(tensor)):
        return []
    boxes = [(chunk.offsets, chunk.sizes) for chunk in tensor.chunks if math.prod(chunk.sizes)]
    overlap = find_overlapping_boxes(boxes)
    if overlap is not None:
        (offsets_a, sizes_a), (offsets_b, sizes_b) = overlap
        return [Problem(Rule.CHUNK_OVERLAP, f"chunks at offsets {list(offsets_a)} (sizes "
                        f"{list(sizes_a)}) and {list(offsets_b)} (sizes {list(sizes_b)}) overlap",
                        fqns=(tensor.fqn,))]
    covered = sum(math.prod(sizes) for _, sizes in boxes)
    volume = math.prod(tensor.shape)
    if covered != volume:
        return [Problem(Rule.CHUNK_GAP, f"chunks hold {covered} of the {volume} elements of shape "
                        f"{list(tensor.shape)}", fqns=(tensor.fqn,))]
    if not volume and tensor.chunks:  # no elements to count: the chunks must span each dim
        for dim, extent in enumerate(tensor.shape):
            spans = sorted((chunk.offsets[dim], chunk.offsets[dim] + chunk.sizes[dim])
                           for chunk in tensor.chunks)
            reached = 0
            for start, end in spans:
                if start > reached:
                    break
                reached = max(reached, end)
            if reached < extent:
                return [Problem(Rule.CHUNK_GAP, f"chunks of the empty tensor of shape "
                                f"{list(tensor.shape)} span {reached} of the {extent} places of "
                                f"dim {dim}", fqns=(tensor.fqn,))]
    return []


def _tiles_by_rows(tensor: TensorEntry) -> bool:
    """Whether the chunks split the tensor's rows (dim 0) into consecutive runs, each whole in
    every other dim, as FSDP2 and most savers lay tensors out: the common case, told with loops
    in C that make no object per chunk where the chunks come in row order. False does not mean
    they fail to tile (find_overlapping_boxes decides)."""
    shape = tensor.shape
    if not shape:
        return False
    offsets, sizes = list(map(_OFFSETS, tensor.chunks)), list(map(_SIZES, tensor.chunks))
    rank = len(shape)
    if not (all(map(eq, map(len, offsets), repeat(rank)))
            and all(map(eq, map(len, sizes), repeat(rank)))):
        return False
    for dim in range(1, rank):
        at = itemgetter(dim)
        if not (all(map(eq, map(at, offsets), repeat(0)))
                and all(map(eq, map(at, sizes), repeat(shape[dim])))):
            return False
    first = itemgetter(0)
    starts, lengths = list(map(first, offsets)), list(map(first, sizes))
    if 0 in lengths:  # empty chunks hold no rows
        starts, lengths = list(compress(starts, lengths)), list(filter(None, lengths))
    if not all(map(le, starts, islice(starts, 1, None))):  # not in row order
        rows = sorted(zip(starts, lengths))
        starts, lengths = list(map(first, rows)), list(map(itemgetter(1), rows))
    ends = list(accumulate(lengths))
    return bool(starts) and ends[-1] == shape[0] and starts == [0, *ends[:-1]]


def _tiles_as_grid(tensor: TensorEntry) -> bool:
    """Whether the chunks are the cells of a grid over the tensor, as a tensor sharded along
    two dims is (data-parallel rows by tensor-parallel columns): in each dim, the chunks'
    (offset, size) pairs cut it into consecutive runs, and no two chunks start at the same
    place, as many as the grid has cells. Then each chunk is its own cell and every cell has
    one: they tile it, told in about k log k steps where the sweep of find_overlapping_boxes
    keeps a band of the grid open and takes about k times the square root of k. False does
    not mean they fail to tile."""
    shape = tensor.shape
    chunks = [chunk for chunk in tensor.chunks if math.prod(chunk.sizes)]
    if not shape or not chunks or not math.prod(shape):
        return False
    cells = 1
    for dim, extent in enumerate(shape):
        runs = sorted({(chunk.offsets[dim], chunk.sizes[dim]) for chunk in chunks})
        reached = 0
        for start, length in runs:
            if start != reached:  # a gap, an overlap, or one start with two lengths
                return False
            reached += length
        if reached != extent:
            return False
        cells *= len(runs)
    return cells == len(chunks) == len({tuple(chunk.offsets) for chunk in chunks})


_OFFSETS, _SIZES = attrgetter("offsets"), attrgetter("sizes")
_MANY_CHUNKS = 8  # below this, the general check costs less than setting up the C loops

Box = tuple[tuple[int, ...], tuple[int, ...]]


def find_overlapping_boxes(boxes: list[Box]) -> tuple[Box, Box] | None:
    """Two boxes (offsets, sizes) that share an element, or None. Sweeps along the dimension
    with the most distinct offsets, comparing each box only with those still open there, so
    row, column and grid shardings of k chunks take about k log k steps, not k squared."""
    if len(boxes) < 2:
        return None
    rank = len(boxes[0][0])
    if rank == 0:
        return boxes[0], boxes[1]
    dim = max(range(rank), key=lambda d: len({offsets[d] for offsets, _ in boxes}))
    open_boxes: list[Box] = []
    for box in sorted(boxes, key=lambda b: b[0][dim]):
        start = box[0][dim]
        open_boxes = [other for other in open_boxes if other[0][dim] + other[1][dim] > start]
        for other in open_boxes:
            if all(o1 < o2 + s2 and o2 < o1 + s1
                   for o1, s1, o2, s2 in zip(box[0], box[1], other[0], other[1])):
                return other, box
        open_boxes.append(box)
    return None


def _stored_length_problems(checkpoint: Checkpoint) -> list[Problem]:
    """SAFETENSORS items hold exactly the chunk's bytes; a plain torch.save archive at least;
    an item under a codec no more than the codec can decode its stored bytes to."""
    safetensors_names = safetensors_files(checkpoint)
    elements_of_sizes: dict[tuple[int, ...], int] = {}
    problems = []
    for tensor in checkpoint.tensors:
        itemsize = tensor.dtype.itemsize
        for chunk in tensor.chunks:
            storage = chunk.storage
            if storage is None:
                continue
            sizes = chunk.sizes
            elements = elements_of_sizes.get(sizes)
            if elements is None:
                elements = elements_of_sizes[sizes] = math.prod(sizes)
            nbytes = elements * itemsize
            if storage.transform_descriptors:
                wrong = nbytes > max_decoded_bytes(storage.length)
            elif safetensors_names and storage.relative_path in safetensors_names:
                wrong = storage.length != nbytes
            else:
                wrong = storage.length < nbytes
            if wrong:
                problems.append(Problem(
                    Rule.STORED_LENGTH, f"item of {storage.length} bytes cannot hold a "
                    f"{tensor.dtype.name} chunk of sizes {list(sizes)} ({nbytes} bytes)",
                    storage.relative_path, storage.offset, storage.offset + storage.length,
                    (tensor.fqn,)))
    return problems

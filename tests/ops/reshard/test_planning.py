"""The reshard plan's sources: each output chunk is read from exactly the input chunks that
hold any of its elements, in the metadata's order, however the input was split."""

from __future__ import annotations

import pickle
import random
from pathlib import Path

import pytest

from dcpctl.format.checkpoint.view import open_checkpoint
from dcpctl.ops.reshard.planning import ChunkTask, plan_reshard

_ITEM_BYTES = 100  # nothing here reads the items: planning only places them


def _row_splits(rows: int, parts: int, rng: random.Random) -> list[tuple[int, int]]:
    """rows cut into `parts` (first row, row count) pieces of random sizes, some empty."""
    cuts = sorted(rng.randint(0, rows) for _ in range(parts - 1))
    bounds = [0, *cuts, rows]
    return [(low, high - low) for low, high in zip(bounds, bounds[1:])]


def _write_metadata(directory: Path, layouts: dict[str, tuple[tuple[int, int], list]]) -> None:
    """`.metadata` (torch's classes) of 2-D bf16 tensors with the given chunks, every chunk an
    item of its own in one sparse data file."""
    import torch
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, Metadata,
                                                       MetadataIndex, TensorProperties,
                                                       TensorStorageMetadata)

    entries, storage_data, offset = {}, {}, 0
    for fqn, (shape, chunks) in layouts.items():
        chunk_entries = []
        for index, (offsets, sizes) in enumerate(chunks):
            chunk_entries.append(ChunkStorageMetadata(torch.Size(offsets), torch.Size(sizes)))
            storage_data[MetadataIndex(fqn, torch.Size(offsets), index)] = _StorageInfo(
                "__0_0.distcp", offset, _ITEM_BYTES)
            offset += _ITEM_BYTES
        entries[fqn] = TensorStorageMetadata(TensorProperties(dtype=torch.bfloat16),
                                             torch.Size(shape), chunk_entries)
    directory.mkdir()
    (directory / ".metadata").write_bytes(pickle.dumps(Metadata(entries, None, storage_data)))
    with open(directory / "__0_0.distcp", "wb") as stream:
        stream.truncate(offset)


def _holds_any_of(chunk: tuple, offsets: tuple, sizes: tuple) -> bool:
    chunk_offsets, chunk_sizes = chunk
    return all(chunk_size > 0 and size > 0 and chunk_offset < offset + size
               and offset < chunk_offset + chunk_size for chunk_offset, chunk_size, offset, size
               in zip(chunk_offsets, chunk_sizes, offsets, sizes))


@pytest.mark.parametrize("seed", range(6))
def test_each_output_chunk_reads_exactly_the_input_chunks_it_overlaps(tmp_path, seed):
    rng = random.Random(seed)
    layouts = {}
    for tensor in range(8):
        rows, columns = rng.randint(1, 60), rng.randint(1, 9)
        row_parts = _row_splits(rows, rng.randint(1, 12), rng)
        column_parts = _row_splits(columns, rng.randint(1, 3), rng) if tensor % 2 else [
            (0, columns)]
        chunks = [((row, column), (row_count, column_count)) for row, row_count in row_parts
                  for column, column_count in column_parts]
        rng.shuffle(chunks)  # the metadata need not list chunks by row
        layouts[f"layer{tensor}.weight"] = ((rows, columns), chunks)
    _write_metadata(tmp_path / "ckpt", layouts)
    checkpoint = open_checkpoint(tmp_path / "ckpt", check_files=False)
    for world_size in (1, 3, 7, 16):
        plan = plan_reshard(checkpoint, world_size)
        plan.locate_sources()
        for task in plan.tasks:
            assert isinstance(task, ChunkTask)
            expected = [chunk for chunk in layouts[task.fqn][1]
                        if _holds_any_of(chunk, task.offsets, task.sizes)]
            assert [(source.offsets, source.sizes) for source in task.sources] == expected


def test_a_share_locates_only_its_own_files_sources_and_the_same_ones(tmp_path):
    rng = random.Random(7)
    layouts = {f"layer{tensor}.weight": ((40, 4), [((row, 0), (count, 4)) for row, count
                                                   in _row_splits(40, 5, rng)])
               for tensor in range(4)}
    _write_metadata(tmp_path / "ckpt", layouts)
    checkpoint = open_checkpoint(tmp_path / "ckpt", check_files=False)
    whole, shared = plan_reshard(checkpoint, 6), plan_reshard(checkpoint, 6)
    whole.locate_sources()
    mine = set(list(shared.output_file_bytes)[:3])
    shared.locate_sources(mine)
    for located, task in zip(whole.tasks, shared.tasks, strict=True):
        assert task.sources == (located.sources if task.output_file in mine else None)


def test_rank_files_are_the_lanes_in_rank_order(tmp_path):
    """Workers share neighbouring lanes, and neighbouring ranks are cut from the same input
    chunks: the lanes go by rank (`__2_0` before `__10_0`), not by name."""
    _write_metadata(tmp_path / "source", {"w": ((1200, 8), [((0, 0), (1200, 8))])})
    plan = plan_reshard(open_checkpoint(tmp_path / "source"), 12)
    assert list(plan.output_file_bytes) == [f"__{rank}_0.distcp" for rank in range(12)]

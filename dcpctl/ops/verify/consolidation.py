"""verify's check of a torch HuggingFaceStorageWriter save consolidated with its ranks' files kept
beside it (`enable_consolidation=True` leaves them in `sharded/`): the consolidated tensors,
which Hugging Face loaders and dcpctl read, must hold what the ranks saved. (torch 2.13's
consolidation writes every 0-dim tensor as zero, and safetensors has no checksum that would
tell.) Every tensor must be in both, of one dtype and shape; a deep check also compares every
rank's chunk with its part of the consolidated tensor, a few MiB at a time."""

from __future__ import annotations

import math
from pathlib import Path

import numpy

from dcpctl.errors import DcpctlError
from dcpctl.format.checkpoint.hf_storage import (CONSOLIDATED_FROM_DIRECTORY, is_hf_storage_shards,
                                                 saving_ranks)
from dcpctl.format.checkpoint.problems import Problem, Rule
from dcpctl.format.checkpoint.view import Checkpoint, TensorEntry, open_checkpoint
from dcpctl.format.safetensors import safetensors_tensor_range
from dcpctl.storage.paths import RangedFile, open_ranged

_PIECE_BYTES = 4 << 20


def consolidation_problems(checkpoint: Checkpoint, deep: bool) -> tuple[list[Problem], int]:
    """The problems of a consolidated save against the ranks' files beside it, and the bytes
    read to find them; none for any other checkpoint."""
    rank_files = checkpoint.path / CONSOLIDATED_FROM_DIRECTORY
    if not checkpoint.hf_storage or saving_ranks(checkpoint.files) or (
            isinstance(rank_files, Path) and rank_files.is_symlink()):  # not torch's: not read
        return [], 0
    try:
        if not is_hf_storage_shards(rank_files):
            return [], 0
        ranks_save = open_checkpoint(rank_files)
    except (DcpctlError, OSError) as error:
        return [Problem(Rule.CONSOLIDATION, f"the ranks' files it was consolidated from do not "
                        f"read: {error}", CONSOLIDATED_FROM_DIRECTORY)], 0
    consolidated = {tensor.fqn: tensor for tensor in checkpoint.tensors}
    problems, bytes_read = [], 0
    for saved in ranks_save.tensors:
        tensor = consolidated.pop(saved.fqn, None)
        if tensor is None:
            problems.append(_problem(f"the ranks saved it ({saved.dtype.name} "
                                     f"{list(saved.shape)}, in {CONSOLIDATED_FROM_DIRECTORY}/), "
                                     "but no consolidated file holds it", saved.fqn))
        elif (tensor.dtype, tensor.shape) != (saved.dtype, saved.shape):
            problems.append(_problem(f"consolidated as {tensor.dtype.name} "
                                     f"{list(tensor.shape)}; the ranks saved "
                                     f"{saved.dtype.name} {list(saved.shape)} (in "
                                     f"{CONSOLIDATED_FROM_DIRECTORY}/)", saved.fqn,
                                     _file_of(tensor)))
        elif deep:
            found, read = _compare_values(checkpoint, tensor, ranks_save, saved)
            problems += found
            bytes_read += read
    problems += [_problem(f"no rank saved it (in {CONSOLIDATED_FROM_DIRECTORY}/)", fqn,
                          _file_of(tensor))
                 for fqn, tensor in consolidated.items()]
    return problems, bytes_read


def _problem(message: str, fqn: str, file: str | None = None) -> Problem:
    return Problem(Rule.CONSOLIDATION, message, file, fqns=(fqn,))


def _file_of(tensor: TensorEntry) -> str | None:
    storage = tensor.chunks[0].storage if tensor.chunks else None
    return storage.relative_path if storage is not None else None


def _compare_values(checkpoint: Checkpoint, tensor: TensorEntry, ranks_save: Checkpoint,
                    saved: TensorEntry) -> tuple[list[Problem], int]:
    """Each rank's chunk of the tensor against its part of the consolidated tensor."""
    whole_file, bytes_read = _file_of(tensor), 0
    part_file = CONSOLIDATED_FROM_DIRECTORY
    try:
        whole_path = checkpoint.data_path(whole_file)
        whole_start, _ = safetensors_tensor_range(whole_path, 0, tensor.fqn)
        with open_ranged(whole_path) as whole:
            for chunk in saved.chunks:
                if not math.prod(chunk.sizes) or chunk.storage is None:
                    continue
                part_file = f"{CONSOLIDATED_FROM_DIRECTORY}/{chunk.storage.relative_path}"
                part_path = ranks_save.data_path(chunk.storage.relative_path)
                part_start, _ = safetensors_tensor_range(part_path, 0, saved.fqn)
                with open_ranged(part_path) as part:
                    differs, read = _chunk_differs(whole, whole_start, part, part_start,
                                                   tensor.shape, chunk.offsets, chunk.sizes,
                                                   tensor.dtype.itemsize)
                bytes_read += read
                if differs is not None:
                    what = f"element {differs}" if differs else "its value"
                    return [_problem(f"{what} differs from what {part_file} holds (the ranks' "
                                     f"files in {CONSOLIDATED_FROM_DIRECTORY}/ read as a "
                                     "checkpoint of their own)", tensor.fqn, whole_file)
                            ], bytes_read
    except (OSError, DcpctlError, ValueError) as error:  # a file cut short meanwhile, say
        return [Problem(Rule.READ_ERROR, f"cannot compare with {part_file}: {error}",
                        whole_file, fqns=(tensor.fqn,))], bytes_read
    return [], bytes_read


def _chunk_differs(whole: RangedFile, whole_start: int, part: RangedFile, part_start: int,
                   shape: tuple[int, ...], offsets: tuple[int, ...], sizes: tuple[int, ...],
                   itemsize: int) -> tuple[list[int] | None, int]:
    """The index (in the full tensor) of the first element of the chunk that differs between
    the two, None where none does; and the bytes read. Read a block of whole rows (along dim
    0) of the full tensor at a time, the chunk's part of them cut out."""
    if not shape:  # a 0-dim tensor: one element
        return (None if whole.read(whole_start, itemsize) == part.read(part_start, itemsize)
                else []), 2 * itemsize
    row_bytes = math.prod(shape[1:]) * itemsize
    chunk_row_bytes = math.prod(sizes[1:]) * itemsize
    rows_per_piece = max(1, _PIECE_BYTES // max(row_bytes, 1))
    inner = tuple(slice(offset, offset + size) for offset, size in zip(offsets[1:], sizes[1:]))
    bytes_read = 0
    for first in range(0, sizes[0], rows_per_piece):
        rows = min(rows_per_piece, sizes[0] - first)
        whole_rows = numpy.frombuffer(
            whole.read(whole_start + (offsets[0] + first) * row_bytes, rows * row_bytes),
            dtype=numpy.uint8).reshape(rows, *shape[1:], itemsize)[(slice(None), *inner)]
        part_rows = numpy.frombuffer(
            part.read(part_start + first * chunk_row_bytes, rows * chunk_row_bytes),
            dtype=numpy.uint8).reshape(rows, *sizes[1:], itemsize)
        bytes_read += rows * (row_bytes + chunk_row_bytes)
        unequal = numpy.flatnonzero((whole_rows != part_rows).any(axis=-1))
        if len(unequal):
            index = numpy.unravel_index(unequal[0], (rows, *sizes[1:]))
            return [int(at) + offset + (first if dim == 0 else 0)
                    for dim, (at, offset) in enumerate(zip(index, offsets))], bytes_read
    return None, bytes_read

"""Converted tensors written at their planned places in output files, by this process, local
worker processes or torchrun ranks (execution/).

A conversion to safetensors or torch.save lays out each output file before it reads a tensor
(FileLayout): the bytes before the tensors (a header, a pickle and small zip records), where
each tensor's bytes go (TensorSlot) and what follows them. The coordinator creates each file
and writes its front; the tensors are the job's lanes, shared out by bytes; whoever has a
tensor writes its bytes at its place (with the zip local header and data descriptor of a
torch.save record), computing their CRC-32 where the archive needs it, and returns the CRCs;
the coordinator then writes each file's tail (a zip central directory needs every CRC). The
output bytes are the same whoever wrote which tensor. Local files take writers in any order
(storage/placed_files.py); an object store takes one file front to back from this process, so
there each file is finished as soon as its last tensor is written.
"""

from __future__ import annotations

import os
import zlib
from dataclasses import dataclass, field
from typing import Callable, Iterable

from dcpctl.errors import DataError, InvalidOptionError
from dcpctl.execution.running import run_job, sharing_processes
from dcpctl.format.checkpoint.payloads import BytesWithCrc, open_payload_reader
from dcpctl.format.checkpoint.view import Checkpoint, open_checkpoint
from dcpctl.format.dtypes import DType
from dcpctl.format.torch_save.crc32 import crc32_of_concatenation
from dcpctl.format.torch_save.writer import data_descriptor
from dcpctl.ops.convert.report import OutputTensor, ProgressCallback, run_in_order
from dcpctl.ops.convert.tensor_bytes import iter_tensor_bytes, largest_piece_bytes
from dcpctl.storage.local import scratch_directory_beside
from dcpctl.storage.paths import StoragePath, storage_path
from dcpctl.storage.placed_files import (LocalPlacedFile, can_share_placed_files,
                                         new_placed_file)
from dcpctl.storage.claims import OutputClaim


@dataclass(frozen=True)
class TensorSlot:
    """Where one checkpoint tensor goes: into file, at offset, after header (a zip local header,
    or nothing), as nbytes of dtype; `described` records end with a zip data descriptor that
    carries their CRC-32."""

    fqn: str
    dtype: DType
    file: str
    offset: int
    header: bytes
    nbytes: int
    described: bool

    @property
    def data_offset(self) -> int:
        """Where the tensor's bytes start."""
        return self.offset + len(self.header)

    @property
    def end(self) -> int:
        """Where the slot ends."""
        end = self.data_offset + self.nbytes
        return end + len(data_descriptor(0, self.nbytes)) if self.described else end


@dataclass
class FileLayout:
    """One output file: its front, its tensors' slots in file order, and tail(crcs), what
    follows the last slot given the CRC-32 of each described slot in order."""

    path: StoragePath
    front: bytes
    slots: list[TensorSlot]
    tail: Callable[[list[int]], bytes] = field(default=lambda crcs: b"")
    replacing: bool = False
    """A file output that may stand there, replaced whole (--overwrite); the files of a
    directory output are new (storage/paths.py, ObjectOutputFile)."""

    @property
    def tensors_end(self) -> int:
        """Where the tail starts."""
        return self.slots[-1].end if self.slots else len(self.front)


class _CoordinatorFiles:
    """The coordinator's open output files, each finished (tail written, synced or completed)
    once every slot of it is written; given the claim of an object store output, one taken
    over meanwhile is never completed (ObjectOutputFile, then discard())."""

    def __init__(self, layouts: list[FileLayout], claim: OutputClaim | None = None) -> None:
        self.layouts = {str(layout.path): layout for layout in layouts}
        self.first_slot: dict[str, int] = {}
        self.files = {}
        self.sizes: dict[str, int] = {}
        slots = 0
        for name, layout in self.layouts.items():
            self.first_slot[name], slots = slots, slots + len(layout.slots)
            self.files[name] = new_placed_file(layout.path, layout.replacing, claim)
            self.files[name].write_at(0, layout.front)

    def holds_all_slots(self, name: str, crcs: dict[int, int]) -> bool:
        """Whether crcs (by job slot index) has every slot of file `name`."""
        first = self.first_slot[name]
        return all(index in crcs for index in range(first, first + len(self.layouts[name].slots)))

    def finish(self, name: str, crcs: dict[int, int]) -> None:
        """Write the tail of file `name`, given the CRC of each of its slots by job index, and
        finish it."""
        layout, first = self.layouts[name], self.first_slot[name]
        file_crcs = [crcs[first + index] for index, slot in enumerate(layout.slots)
                     if slot.described]
        tail = layout.tail(file_crcs)
        self.files[name].write_at(layout.tensors_end, tail)
        self.files[name].finish()
        self.sizes[name] = layout.tensors_end + len(tail)

    def finish_the_rest(self, crcs: dict[int, int]) -> None:
        """Finish every file not finished yet, given every slot's CRC by job index."""
        for name in self.layouts:
            if name not in self.sizes:
                self.finish(name, crcs)

    def discard(self) -> None:
        """Close every unfinished file after a failure."""
        for name, file in self.files.items():
            if name not in self.sizes:
                file.discard()


@dataclass
class PlacedTensorsPlan:
    """The checkpoint the tensors come from and, in the coordinator's own process, its open
    files (a worker opens the files itself)."""

    checkpoint: Checkpoint
    coordinator: _CoordinatorFiles | None = None


@dataclass(frozen=True)
class PlacedTensorsPlanning:
    """What the plan of writing placed tensors is a pure function of (execution/jobs.py): the
    checkpoint they come from, which a worker opens."""

    source: str

    def plan(self) -> PlacedTensorsPlan:
        return PlacedTensorsPlan(open_checkpoint(self.source, check_files=False))


def placed_tensors_planning(source: str | os.PathLike | StoragePath) -> PlacedTensorsPlanning:
    """The planning of tensors read from the checkpoint at source: what a conversion sends its
    workers ahead (execution/running.py, plan_ahead) and what its job carries, the same."""
    return PlacedTensorsPlanning(str(storage_path(source)))


PIECES_IN_HAND_BYTES = 128 << 20
"""Each thread holds a piece of a tensor at a time (a chunk, or a whole tensor not split by
rows): threads stop at as many of the largest piece as fit in this, or two where it is larger
(one reads while one writes), so that memory stays near the largest tensor whatever --threads
(at 8 threads, 8 tensors of 64 MiB took 0.49 GB)."""


def threads_holding_pieces(threads: int, tensors: Iterable[OutputTensor]) -> int:
    """How many of `threads` write these tensors: as many of the largest piece one is read in
    as fit in PIECES_IN_HAND_BYTES, or two where it is larger."""
    largest = max((largest_piece_bytes(tensor.entry, tensor.dtype) for tensor in tensors),
                  default=0)
    return max(1, min(threads, max(PIECES_IN_HAND_BYTES, 2 * largest) // max(largest, 1)))


@dataclass(frozen=True)
class PlacedTensorsJob:
    """Writing every slot's tensor (execution/jobs.py): its lanes are the slots, by bytes. A
    share returns the CRC-32 of each described slot it wrote, by index."""

    planning: PlacedTensorsPlanning
    scratch: str
    """The scratch directory for payloads decoded whole (storage/local.py)."""
    slots: tuple[TensorSlot, ...]
    threads: int
    """Threads of each share, as threads_holding_pieces gives them."""

    def lane_sizes(self, plan: PlacedTensorsPlan) -> list[int]:
        return [slot.nbytes for slot in self.slots]

    def run_share(self, plan: PlacedTensorsPlan, lanes: list[int],
                  advance: Callable[[int], None]) -> dict[int, int]:
        tensors = {tensor.fqn: tensor for tensor in plan.checkpoint.tensors}
        last_in_share = {self.slots[index].file: index for index in lanes}
        own_files: dict[str, LocalPlacedFile] = {}
        crcs: dict[int, int] = {}

        def file_for(name: str):
            if plan.coordinator is not None:
                return plan.coordinator.files[name]
            if name not in own_files:
                own_files[name] = LocalPlacedFile(storage_path(name), create=False)
            return own_files[name]

        def write(index: int, pieces) -> None:
            slot = self.slots[index]
            file = file_for(slot.file)
            if slot.header:
                file.write_at(slot.offset, slot.header)
            crcs[index] = _write_tensor_bytes(file, slot, pieces, self.planning.source, advance)
            if index != last_in_share[slot.file]:
                return
            if plan.coordinator is None:  # files stay few at a time open
                own_files.pop(slot.file).finish()
            elif plan.coordinator.holds_all_slots(slot.file, crcs):
                plan.coordinator.finish(slot.file, crcs)

        try:
            with open_payload_reader(self.scratch) as payloads:
                run_in_order(lambda index: iter_tensor_bytes(
                    payloads, plan.checkpoint, tensors[self.slots[index].fqn],
                    self.slots[index].dtype), lanes, write, self.threads)
        except BaseException:
            for file in own_files.values():
                file.discard()
            raise
        return {index: crc for index, crc in crcs.items() if self.slots[index].described}


def _write_tensor_bytes(file, slot: TensorSlot, pieces: Iterable[BytesWithCrc], source: str,
                        advance: Callable[[int], None]) -> int:
    """Write the slot's tensor bytes (and data descriptor); their CRC-32 (0 where the slot
    needs none), joined from the pieces' own where they come with one. Pieces that do not add
    up to the slot's size fail it."""
    received, crc = 0, 0
    for piece in pieces:
        start, received = received, received + len(piece)
        if received > slot.nbytes:
            break
        file.write_at(slot.data_offset + start, piece.data)
        if slot.described:
            crc = (zlib.crc32(piece.data, crc) if piece.crc is None
                   else crc32_of_concatenation(crc, piece.crc, len(piece)))
        advance(len(piece))
    if received != slot.nbytes:
        more = "more than " if received > slot.nbytes else ""
        raise DataError(f"tensor {slot.fqn!r} gave {more}{received} bytes, not the "
                        f"{slot.nbytes} its shape needs", path=source)
    if slot.described:
        file.write_at(slot.data_offset + slot.nbytes, data_descriptor(crc, slot.nbytes))
    return crc


def write_placed_tensors(layouts: list[FileLayout], checkpoint: Checkpoint, output: StoragePath,
                         threads: int, workers: int = 1,
                         on_progress: ProgressCallback | None = None,
                         claim: OutputClaim | None = None) -> dict[str, int]:
    """Write every file laid out, its tensors on `workers` processes (or a torchrun job's
    ranks); each file's size by path. Files are left for the caller's staging to remove on
    failure; claim: an object store output's (_CoordinatorFiles)."""
    if sharing_processes(workers) > 1 and not can_share_placed_files(output):
        raise InvalidOptionError(
            f"{output}: several processes write parts of each converted file, which an object "
            "store cannot take (an object is uploaded front to back by one writer); convert "
            "with --workers 1 and not under torchrun, or into a local directory")
    slots = tuple(slot for layout in layouts for slot in layout.slots)
    files = _CoordinatorFiles(layouts, claim)
    try:
        with scratch_directory_beside(output) as scratch:
            job = PlacedTensorsJob(placed_tensors_planning(checkpoint.path), str(scratch),
                                   slots, threads)
            crcs: dict[int, int] = {}
            for share in run_job(job, PlacedTensorsPlan(checkpoint, files), workers,
                                 on_progress):
                crcs.update(share)
        files.finish_the_rest(crcs)
    except BaseException:
        files.discard()
        raise
    return files.sizes

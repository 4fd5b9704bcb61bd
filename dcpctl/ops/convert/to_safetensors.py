"""DCP to Hugging Face style safetensors shards, streaming in bounded memory.

Every file's header is computed from the metadata before any data is read; each tensor is then
assembled from its chunks and written at its place, so memory holds a few chunks (a whole
tensor only for layouts that are not split by rows), never the checkpoint.
"""

from __future__ import annotations

import fnmatch
import os
import re
import time
from dataclasses import dataclass

from dcpctl.execution.running import checked_job_source, threads_per_worker
from dcpctl.errors import DcpctlError, UnsupportedLayoutError
from dcpctl.format.checkpoint.items import read_item
from dcpctl.format.checkpoint.locations import ItemLocation, locate_object
from dcpctl.format.checkpoint.rank_metadata import replicated_keys
from dcpctl.format.checkpoint.view import Checkpoint
from dcpctl.format.dtypes import DType
from dcpctl.format.file_names import HF_INDEX_FILE_NAME
from dcpctl.format.safetensors import (DEFAULT_MAX_SHARD_BYTES, SafetensorsTensor,
                                       check_tensor_name, encode_header, encode_index, plan_shards,
                                       refuse_what_it_cannot_store, shard_file_name)
from dcpctl.format.torch_save.zip_records import holds_storages, read_central_directory
from dcpctl.ops.convert.key_selection import (KeySelection, is_selected, prefix_to_strip,
                                              select_and_rename)
from dcpctl.ops.convert.placed_tensors import (FileLayout, TensorSlot,
                                               placed_tensors_planning, threads_holding_pieces,
                                               write_placed_tensors)
from dcpctl.ops.convert.report import (ConvertReport, OutputTensor, ProgressCallback, WrittenFile,
                                       cast_dtype)
from dcpctl.storage.paths import StoragePath, new_output_file, open_ranged, storage_path
from dcpctl.storage.claims import OutputClaim
from dcpctl.storage.staging import staged_output


@dataclass
class SafetensorsPlan:
    """The files to write, each with its tensors in file order, and what is left out."""

    files: list[tuple[str, list[OutputTensor]]]
    tensors_left_out: int
    objects_left_out: int
    stripped_prefix: str
    """What came off every name taken that starts with it (key_selection.prefix_to_strip)."""

    @property
    def tensors(self) -> list[OutputTensor]:
        """Every tensor written, in writing order."""
        return [tensor for _, tensors in self.files for tensor in tensors]


def plan_safetensors(checkpoint: Checkpoint, selection: KeySelection, cast_to: DType | None,
                     max_shard_bytes: int) -> SafetensorsPlan:
    """Which tensors go into which file under which name. Shards are filled in checkpoint
    order; inside a file tensors are sorted by element size, then name, as safetensors does,
    which keeps every tensor aligned to its element size."""
    names = select_and_rename([tensor.fqn for tensor in checkpoint.tensors], selection,
                              objects=[entry.fqn for entry in checkpoint.objects])
    for name in names.values():
        check_tensor_name(name)
    tensors = [OutputTensor(entry, names[entry.fqn], cast_dtype(entry, cast_to, checkpoint.path))
               for entry in checkpoint.tensors if entry.fqn in names]
    refuse_what_it_cannot_store((tensor.name, tensor.dtype, tensor.entry.shape)
                                for tensor in tensors)
    shards = plan_shards([tensor.nbytes for tensor in tensors], max_shard_bytes)
    files = []
    for number, indexes in enumerate(shards, start=1):
        in_file = sorted((tensors[index] for index in indexes),
                         key=lambda tensor: (-tensor.dtype.itemsize, tensor.name))
        files.append((shard_file_name(number, len(shards)), in_file))
    return SafetensorsPlan(files, len(checkpoint.tensors) - len(tensors), len(checkpoint.objects),
                           prefix_to_strip(list(names), selection))


def safetensors_layouts(plan: SafetensorsPlan, directory: StoragePath) -> list[FileLayout]:
    """Each planned file laid out: its header, then its tensors back to back."""
    layouts = []
    for file_name, tensors in plan.files:
        header = encode_header([SafetensorsTensor(tensor.name, tensor.dtype, tensor.entry.shape,
                                                  nbytes=tensor.nbytes) for tensor in tensors])
        path, offset, slots = directory / file_name, len(header), []
        for tensor in tensors:
            slots.append(TensorSlot(tensor.entry.fqn, tensor.dtype, str(path), offset, b"",
                                    tensor.nbytes, described=False))
            offset += tensor.nbytes
        layouts.append(FileLayout(path, header, slots))
    return layouts


def write_safetensors(plan: SafetensorsPlan, checkpoint: Checkpoint, directory: StoragePath,
                      threads: int, workers: int = 1,
                      on_progress: ProgressCallback | None = None,
                      claim: OutputClaim | None = None) -> list[WrittenFile]:
    """Write every planned file (and the index when there are several) into directory, the
    tensors on `workers` processes; claim: an object store output's, checked as each file is
    written."""
    sizes = write_placed_tensors(safetensors_layouts(plan, directory), checkpoint, directory,
                                 threads, workers, on_progress, claim)
    written_files = [WrittenFile(file_name, sizes[str(directory / file_name)], len(tensors))
                     for file_name, tensors in plan.files]
    if len(plan.files) > 1:
        weight_map = {tensor.name: file_name for file_name, tensors in plan.files
                      for tensor in tensors}
        index = encode_index(sum(tensor.nbytes for tensor in plan.tensors), weight_map)
        with new_output_file(directory / HF_INDEX_FILE_NAME, claim) as stream:
            stream.write(index)
            stream.finish()
        written_files.append(WrittenFile(HF_INDEX_FILE_NAME, len(index), 0))
    return written_files


def convert_to_safetensors(source: str | os.PathLike, output: str | os.PathLike,
                           selection: KeySelection, cast_to: DType | None = None,
                           max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
                           threads: int | None = None, overwrite: bool = False,
                           on_progress: ProgressCallback | None = None,
                           workers: int = 1) -> ConvertReport:
    """Convert the DCP checkpoint at source into safetensors files in the directory output,
    on `workers` processes of `threads` threads each."""
    started = time.perf_counter()
    with checked_job_source(source, placed_tensors_planning(source), threads, workers,
                            on_progress) as checkpoint:
        threads = threads_per_worker(threads, checkpoint.path, workers)
        _refuse_objects_holding_tensors(checkpoint, selection)
        try:
            plan = plan_safetensors(checkpoint, selection, cast_to, max_shard_bytes)
        except DcpctlError as error:  # the selection's refusals name the source
            raise error.located(path=checkpoint.path) from None
        threads = threads_holding_pieces(threads, plan.tensors)
        staged = staged_output(storage_path(output), overwrite, checkpoint.path)
        try:
            files = write_safetensors(plan, checkpoint, staged.path, threads, workers,
                                      on_progress, staged.claim)
            staged.confirm([file.name for file in files],
                           {file.name: file.size_bytes for file in files})
            staged.publish()
        except BaseException:
            staged.abort()
            raise
    report = ConvertReport(str(source), str(output), "dcp", "safetensors",
                           cast_to=cast_to.name if cast_to else None,
                           tensors_left_out=plan.tensors_left_out,
                           objects_left_out=plan.objects_left_out, threads=threads, workers=workers,
                           files=files, stripped_prefix=plan.stripped_prefix)
    report.count_tensors(tensor.nbytes for tensor in plan.tensors)
    report.items_several_ranks_saved = len(replicated_keys(checkpoint.replicas))
    report.seconds = time.perf_counter() - started
    return report


def _refuse_objects_holding_tensors(checkpoint: Checkpoint, selection: KeySelection) -> None:
    """A save with flatten_state_dict=False keeps each nested dict of tensors as one object,
    and objects are left out: refuse one that the selection takes and that holds tensors,
    rather than write the model without them."""
    for entry in checkpoint.objects:
        if (_may_take(entry.fqn, selection)
                and _holds_tensors(locate_object(checkpoint, entry))):
            raise UnsupportedLayoutError(
                f"{entry.fqn!r} is an object holding tensors (a save with "
                "flatten_state_dict=False keeps each nested dict of tensors as one object), "
                "which convert --to safetensors does not take apart; leave it out with "
                "--exclude", path=checkpoint.path)


def _may_take(fqn: str, selection: KeySelection) -> bool:
    """Whether the selection takes fqn, or, given include globs, one of them could name
    something inside it (`layers.*` for the tensors an object `layers` holds) unless an
    exclude glob leaves fqn out."""
    if is_selected(fqn, selection.include, selection.exclude):
        return True
    if selection.include is None or any(fnmatch.fnmatchcase(fqn, glob)
                                        for glob in selection.exclude):
        return False
    inside = fqn + "."
    literals = (re.split(r"[*?\[]", glob, maxsplit=1)[0] for glob in selection.include)
    return any(inside.startswith(literal) or literal.startswith(inside) for literal in literals)


def _holds_tensors(location: ItemLocation) -> bool:
    """Whether the object's torch.save archive holds tensor storages, from its central
    directory alone where it is stored plain; a DcpctlError it raises names the item."""
    try:
        if location.codec.descriptors:
            archive = read_item(location)
            directory = read_central_directory(
                lambda start, count: archive[start:start + count], len(archive))
        else:
            with open_ranged(location.path) as file:
                directory = read_central_directory(
                    lambda start, count: file.read(location.start + start, count),
                    location.length)
    except DcpctlError as error:
        raise error.located(**location.place) from None
    return holds_storages(directory)

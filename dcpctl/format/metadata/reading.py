"""Safe reading of a DCP `.metadata` file, without importing torch.

Reading never runs code from the file: the pickle is
loaded with an allowlist that maps each class DCP metadata uses onto a plain record of ours.
Writing them back is writing.py's job.
"""

from __future__ import annotations

import contextlib
import io
import os
import pickle
import sys
import threading
from pathlib import PurePosixPath, PureWindowsPath
from typing import Any, BinaryIO, Callable, Iterator

from dcpctl.cycle_collector import paused_cycle_collector
from dcpctl.errors import (MetadataError, MetadataReadError, UnknownClassError,
                           UnsafeMetadataError)
from dcpctl.format.dtypes import DTYPE_ALIASES, DTYPES_BY_NAME, DType
from dcpctl.format.file_names import METADATA_FILE_NAME
from dcpctl.format.metadata.records import (MEMORY_FORMAT_CODES, TORCH_LAYOUTS, BytesMetadata,
                                            CheckpointMetadata, ChunkMetadata, MetadataIndex,
                                            StorageInfo, StorageMeta, TensorMetadata,
                                            TensorProperties)
from dcpctl.format.metadata.structure import check_metadata_structure
from dcpctl.storage.local import NotARegularFileError, open_for_reading
from dcpctl.storage.objects import ObjectPath
from dcpctl.storage.paths import StoragePath, read_whole, storage_path
from dcpctl.storage.planned_from import note_planned_from
from dcpctl.unpickling_memory import bounded_memory, memory_budget_bytes

_TORCH_METADATA_MODULE = "torch.distributed.checkpoint.metadata"
_TORCH_FILESYSTEM_MODULE = "torch.distributed.checkpoint.filesystem"
_TORCH_PLANNER_MODULE = "torch.distributed.checkpoint.planner"
_MEGATRON_MODULE = "megatron.core.dist_checkpointing.strategies.torch"


def _make_dtype(name: str) -> DType:
    return DTYPES_BY_NAME[DTYPE_ALIASES.get(name, name)]


def _layout_by_qualified_name(qualified_name: Any) -> str:
    """Stands in for torch.serialization._get_layout, which torch pickles layouts through."""
    name = qualified_name.removeprefix("torch.") if isinstance(qualified_name, str) else None
    if name not in TORCH_LAYOUTS:
        raise UnsafeMetadataError(f"names an unknown tensor layout {qualified_name!r}")
    return name


_MAX_PATH_PARTS, _MAX_PATH_CHARACTERS = 256, 4096


def _pure_path(path_class: type) -> Any:
    """Stands in for a pathlib class: builds the pure path, if it is of a sane size (a memoized
    long string repeated as parts would join into gigabytes)."""
    def make(*parts: Any) -> PurePosixPath | PureWindowsPath:
        if (len(parts) > _MAX_PATH_PARTS or not all(type(part) is str for part in parts)
                or sum(map(len, parts)) > _MAX_PATH_CHARACTERS):
            raise UnsafeMetadataError("holds a path that is not a few short strings")
        return path_class(*parts)
    return make


_RECORD_CLASSES = frozenset({CheckpointMetadata, TensorMetadata, BytesMetadata, ChunkMetadata,
                             TensorProperties, MetadataIndex, StorageMeta, StorageInfo})


def _reconstruct_record(cls: Any, base: Any, state: Any) -> Any:
    """Stands in for copyreg._reconstructor, restricted to `object.__new__` of our records
    (`.metadata` written by dcpctl 0.1 builds records this way)."""
    if cls not in _RECORD_CLASSES or base is not object or state is not None:
        raise UnsafeMetadataError("uses copyreg._reconstructor on something other than a DCP "
                                  "metadata class")
    return cls.__new__(cls)


class _SavePlanPart:
    """Stands in for the classes of the save plans Megatron-Core keeps in `.metadata`
    (`all_local_plans`: SavePlan, WriteItem, ...): built with no code run, checked by nothing,
    dropped once the pickle is read (check_metadata_structure)."""


_WRITE_ITEM_TYPES = (1, 2, 3)  # torch's WriteItemType: TENSOR, SHARD, BYTE_IO


def _write_item_type(value: Any) -> int:
    """Stands in for torch's WriteItemType enum, which pickles as a call with its value."""
    if type(value) is not int or value not in _WRITE_ITEM_TYPES:
        raise UnsafeMetadataError(f"names an unknown WriteItemType {value!r}")
    return value


def _memory_format_encoding(value: Any) -> int:
    """Stands in for torch's _MEM_FORMAT_ENCODING enum, which pickles as a call with its
    value: an int of the enum, as torch's own reading takes only those (not `int(1.5)`)."""
    if type(value) is not int or value not in MEMORY_FORMAT_CODES:
        raise UnsafeMetadataError(f"names an unknown memory format encoding {value!r:.40}")
    return value


_ALLOWED_CLASSES: dict[tuple[str, str], Any] = {
    (_TORCH_METADATA_MODULE, "Metadata"): CheckpointMetadata,
    (_MEGATRON_MODULE, "MCoreMetadata"): CheckpointMetadata,  # Metadata plus mcore_data
    (_TORCH_METADATA_MODULE, "TensorStorageMetadata"): TensorMetadata,
    (_TORCH_METADATA_MODULE, "BytesStorageMetadata"): BytesMetadata,
    (_TORCH_METADATA_MODULE, "ChunkStorageMetadata"): ChunkMetadata,
    (_TORCH_METADATA_MODULE, "TensorProperties"): TensorProperties,
    (_TORCH_METADATA_MODULE, "MetadataIndex"): MetadataIndex,
    (_TORCH_METADATA_MODULE, "StorageMeta"): StorageMeta,
    (_TORCH_METADATA_MODULE, "_MEM_FORMAT_ENCODING"): _memory_format_encoding,
    (_TORCH_FILESYSTEM_MODULE, "_StorageInfo"): StorageInfo,
    # Megatron-Core's save plans, dropped once read
    **{(_TORCH_PLANNER_MODULE, name): _SavePlanPart
       for name in ("SavePlan", "WriteItem", "TensorWriteData")},
    (_TORCH_PLANNER_MODULE, "WriteItemType"): _write_item_type,
    (_TORCH_FILESYSTEM_MODULE, "_StoragePrefix"): _SavePlanPart,
    (_MEGATRON_MODULE, "MCoreSavePlan"): _SavePlanPart,
    # What these stand for must not copy their arguments: a short pickle could make each
    # rebuild a long memoized string or list into a fresh object, hundreds of times. torch.Size
    # of a tuple is that tuple (`().__add__` returns it, in C, and refuses anything else); an
    # OrderedDict starts empty (`{}.copy` takes no arguments) and SETITEMS fills it.
    ("torch", "Size"): ().__add__,
    ("torch.serialization", "_get_layout"): _layout_by_qualified_name,
    ("collections", "OrderedDict"): {}.copy,
    ("copyreg", "_reconstructor"): _reconstruct_record,
    ("builtins", "object"): object,
    # Pure paths only: building one touches no file system.
    **{(module, name): _pure_path(PurePosixPath)
       for module in ("pathlib", "pathlib._local") for name in ("PosixPath", "PurePosixPath")},
    **{(module, name): _pure_path(PureWindowsPath)
       for module in ("pathlib", "pathlib._local") for name in ("WindowsPath", "PureWindowsPath")},
    **{("torch", name): _make_dtype(name) for name in [*DTYPES_BY_NAME, *DTYPE_ALIASES]},
    **{("torch", name): name for name in TORCH_LAYOUTS},
}


class _AllowlistUnpickler(pickle.Unpickler):
    """Resolves only the globals DCP metadata uses, each to a plain record of ours."""

    def find_class(self, module: str, name: str) -> Any:
        try:
            return _ALLOWED_CLASSES[(module, name)]
        except KeyError:
            raise UnknownClassError(
                f"refers to {module}.{name}, which is not a DCP metadata class; "
                "refusing to unpickle it"
            ) from None

    def persistent_load(self, pid: Any) -> Any:
        raise UnsafeMetadataError("uses pickle persistent ids, which DCP metadata never does")


def parse_metadata(data: bytes, source: str = METADATA_FILE_NAME) -> CheckpointMetadata:
    """Unpickle `.metadata` bytes with the allowlist and check that they are DCP metadata."""
    return _parse_stream(io.BytesIO(data), len(data), source)


def _parse_stream(stream: BinaryIO, size: int, source: str) -> CheckpointMetadata:
    """parse_metadata of the size bytes that stream holds, read as the unpickler goes."""
    if not size:
        raise MetadataError("file is empty", path=source)
    with paused_cycle_collector():
        return _run_with_stack_for(size, lambda: _load_and_check(stream, size, source))


def _load_and_check(stream: BinaryIO, size: int, source: str) -> CheckpointMetadata:
    loaded = _load_with_allowlist(stream, size, source)
    try:
        check_metadata_structure(loaded, source)
    except RecursionError:
        raise MetadataError("nests deeper than any DCP metadata does", path=source) from None
    return loaded


def _load_with_allowlist(stream: BinaryIO, size: int, source: str) -> Any:
    try:
        with bounded_memory(size), _without_cpython_bytearray_noise():
            return _AllowlistUnpickler(stream).load()
    except MetadataError as error:  # a class off the allowlist, a record's fields not torch's
        raise error.located(path=source) from None
    except RecursionError:
        raise MetadataError("nests deeper than any DCP metadata does", path=source) from None
    except MemoryError:  # a memo index far past the file's (unpickling_memory.py), say
        raise MetadataError(f"asks for more memory than a pickle of {size} bytes can "
                            f"honestly take (over {memory_budget_bytes(size) >> 20} MiB)",
                            path=source) from None
    except OSError as error:  # the file, not the pickle
        raise _unread(error, source) from None
    except Exception as error:  # a damaged pickle fails in many ways; all mean the same
        raise MetadataError(f"not a readable DCP metadata pickle ({type(error).__name__}: "
                            f"{error})", path=source) from None


# A BYTEARRAY8 opcode asking for more bytes than can be allocated fails with MemoryError, which
# is what is reported; but CPython (3.11 at least) frees the half-made bytearray without having
# set its export count, and when that garbage is positive it prints "SystemError: deallocated
# bytearray object has exported buffers" through sys.excepthook. A damaged .metadata meets this
# about once in 2,500 random edits: while unpickling, that one line is dropped.
_BYTEARRAY_NOISE = "deallocated bytearray object has exported buffers"
_noise_filter_lock = threading.Lock()
_noise_filter_users = 0  # unpicklings running; the filter is installed while any is
_hook_before_filter = sys.__excepthook__


@contextlib.contextmanager
def _without_cpython_bytearray_noise() -> Iterator[None]:
    global _noise_filter_users, _hook_before_filter
    with _noise_filter_lock:
        if _noise_filter_users == 0:
            _hook_before_filter, sys.excepthook = sys.excepthook, _drop_bytearray_noise
        _noise_filter_users += 1
    try:
        yield
    finally:
        with _noise_filter_lock:
            _noise_filter_users -= 1
            if _noise_filter_users == 0:
                sys.excepthook = _hook_before_filter


def _drop_bytearray_noise(kind, value, traceback) -> None:
    if not (kind is SystemError and str(value) == _BYTEARRAY_NOISE):
        _hook_before_filter(kind, value, traceback)


# A tuple nested a million deep, used as a dict key, is hashed by recursion in C, without
# Python's recursion limit: on the main thread's 8 MiB stack that is a segmentation fault.
# Each level costs at most about 64 bytes of stack and one byte of pickle, so the unpickler
# runs on a thread whose stack holds twice as many levels as the pickle has bytes: address
# space reserved, not memory used unless the pickle nests that deep. Where the system will not
# reserve that much (past about the machine's memory, so for pickles of more than a few hundred
# MB on a 24 GiB machine), the stack is the largest it grants, halving down to 8 MiB.
_STACK_BYTES_PER_PICKLE_BYTE = 128
_MIN_STACK_BYTES = 8 << 20
_stack_size_lock = threading.Lock()


def _run_with_stack_for(pickle_bytes: int, function: Callable[[], Any]) -> Any:
    """function(), on a thread with a stack sized for unpickling a pickle of pickle_bytes;
    raises what it raised."""
    outcome: list = []

    def run() -> None:
        try:
            outcome.append((True, function()))
        except BaseException as error:  # handed to the calling thread
            outcome.append((False, error))

    stack_bytes = max(pickle_bytes * _STACK_BYTES_PER_PICKLE_BYTE, _MIN_STACK_BYTES)
    stack_bytes = -(-stack_bytes // _MIN_STACK_BYTES) * _MIN_STACK_BYTES  # 8 MiB multiples
    while True:
        try:
            thread = _started_with_stack(run, stack_bytes)
            break
        except RuntimeError:  # "can't start new thread": no room for that stack
            if stack_bytes <= _MIN_STACK_BYTES:
                raise
            stack_bytes = max(stack_bytes // 2 // _MIN_STACK_BYTES * _MIN_STACK_BYTES,
                              _MIN_STACK_BYTES)
    thread.join()
    succeeded, result = outcome[0]
    if not succeeded:
        raise result
    return result


def _started_with_stack(run: Callable[[], None], stack_bytes: int) -> threading.Thread:
    with _stack_size_lock:
        previous = threading.stack_size(stack_bytes)
        try:
            thread = threading.Thread(target=run, name="dcpctl-metadata-unpickler", daemon=True)
            thread.start()
        finally:
            threading.stack_size(previous)
    return thread


def read_metadata(checkpoint_dir: str | os.PathLike | StoragePath,
                  name: str = METADATA_FILE_NAME) -> CheckpointMetadata:
    """Read and check `checkpoint_dir/.metadata` (or another file of DCP metadata there: a
    rank's own, `__<rank>.metadata`) without importing torch. A local file is unpickled as it
    is read, never whole in memory beside what it unpickles to (142 MB at a million chunks)."""
    path = storage_path(checkpoint_dir) / name
    note_planned_from(path, whole=True)
    try:
        if isinstance(path, ObjectPath):
            return parse_metadata(read_whole(path), str(path))
        raw = open_for_reading(path)
    except OSError as error:
        raise _unread(error, path) from None
    with io.BufferedReader(raw, _READ_BUFFER_BYTES) as stream:
        return _parse_stream(stream, os.fstat(raw.fileno()).st_size, str(path))


def _unread(error: OSError, path: str | StoragePath) -> MetadataError:
    """What a metadata file that could not be read is: no verdict where the file system failed
    (MetadataReadError), damage where something other than a file stands in its place."""
    kind = MetadataError if isinstance(error, NotARegularFileError) else MetadataReadError
    return kind(f"cannot read ({error.strerror or error})", path=path)


_READ_BUFFER_BYTES = 1 << 20

"""What a conversion did, and the pieces the three conversions share."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Callable, Iterable, Iterator

from dcpctl.errors import UnsupportedLayoutError
from dcpctl.format.checkpoint.view import TensorEntry
from dcpctl.format.dtypes import DType
from dcpctl.pipeline import Pipeline
from dcpctl.storage.paths import StoragePath

# Called with (bytes just done, total bytes) as work advances.
ProgressCallback = Callable[[int, int], None]
PIECE_BUDGET_BYTES = 16 << 20


@dataclass
class WrittenFile:
    """One file of the output."""

    name: str
    size_bytes: int
    tensors: int


@dataclass
class ConvertReport:
    """What a convert did: what went in, what came out, and what was left out."""

    source: str
    output: str
    source_format: str
    target_format: str
    tensors: int = 0
    objects: int = 0
    tensor_bytes: int = 0
    largest_tensor_bytes: int = 0
    cast_to: str | None = None
    stripped_prefix: str | None = None
    """To safetensors: what came off the names (`model.`, say; "" for nothing)."""
    tensors_left_out: int = 0
    objects_left_out: int = 0
    ranks: int | None = None
    items_several_ranks_saved: int = 0
    """Of a source saved with use_collectives=False: the items several of its ranks saved,
    each written from the lowest rank's copy (rank_metadata.py)."""
    threads: int = 1
    """Threads of each worker."""
    workers: int = 1
    seconds: float = 0.0
    files: list[WrittenFile] = field(default_factory=list)

    def count_tensors(self, sizes: Iterable[int]) -> None:
        """Record the tensors written, by their sizes in bytes."""
        sizes = list(sizes)
        self.tensors = len(sizes)
        self.tensor_bytes = sum(sizes)
        self.largest_tensor_bytes = max(sizes, default=0)

    def to_json(self) -> dict:
        """A JSON-ready dict."""
        rate = self.tensor_bytes / self.seconds if self.seconds else None
        return {**dataclasses.asdict(self), "bytes_per_second": rate}


@dataclass(frozen=True)
class OutputTensor:
    """A checkpoint tensor as it goes into the output: its name there and its dtype."""

    entry: TensorEntry
    name: str
    dtype: DType

    @property
    def nbytes(self) -> int:
        """Bytes of its data in the output."""
        return math.prod(self.entry.shape) * self.dtype.itemsize


def cast_dtype(entry: TensorEntry, cast_to: DType | None, source: StoragePath) -> DType:
    """The dtype a tensor gets: cast_to for floating-point tensors, its own otherwise. One of
    values packed two to a byte (float4_e2m1fn_x2) is refused: torch casts no such tensor."""
    if cast_to is None or not entry.dtype.is_floating_point or entry.dtype == cast_to:
        return entry.dtype
    if entry.dtype.packed_values > 1:
        raise UnsupportedLayoutError(
            f"tensor {entry.fqn!r} is {entry.dtype.name}, two values packed in each byte, which "
            "torch casts to no other dtype; leave it out with --exclude, or convert without "
            "--dtype", path=source)
    return cast_to


def run_in_order(produce: Callable, tasks: list, write: Callable[[object, Iterator], None],
                 threads: int) -> None:
    """Produce each task's pieces on `threads` threads and hand them to write in task order,
    with the bytes waiting in between bounded."""
    Pipeline(produce, threads=threads, bytes_in_flight=PIECE_BUDGET_BYTES * threads).run(
        tasks, write)

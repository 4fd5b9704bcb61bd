"""`dcpctl convert`: which conversion each target format names, and the options it takes.

The command line hands every option to `convert_checkpoint`, which passes each conversion its
own; TARGET_OPTIONS says which those are, for the command line to refuse the others.
"""

from __future__ import annotations

import os

from dcpctl.errors import InvalidOptionError
from dcpctl.execution.running import workers_started
from dcpctl.format.dtypes import dtype_by_name
from dcpctl.format.safetensors import DEFAULT_MAX_SHARD_BYTES
from dcpctl.ops.convert.key_selection import KeySelection, Rename
from dcpctl.ops.convert.report import ConvertReport, ProgressCallback

SAFETENSORS_TARGET, TORCH_TARGET, DCP_TARGET = "safetensors", "torch", "dcp"
CAST_DTYPE_NAMES = ("bfloat16", "float16", "float32")
# The options each target takes, by keyword of convert_checkpoint.
TARGET_OPTIONS = {
    SAFETENSORS_TARGET: {"max_shard_bytes", "dtype", "include", "exclude", "strip_prefix",
                         "renames"},
    TORCH_TARGET: {"dtype", "include", "exclude"},
    DCP_TARGET: {"ranks", "prefix"},
}
__all__ = ["DEFAULT_MAX_SHARD_BYTES", "Rename", "convert_checkpoint"]


def convert_checkpoint(source: str | os.PathLike, target: str, output: str | os.PathLike,
                       dtype: str | None = None, include: tuple[str, ...] = (),
                       exclude: tuple[str, ...] = (), strip_prefix: str | None = None,
                       renames: tuple[Rename, ...] = (),
                       max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES, ranks: int = 1,
                       prefix: str = "", threads: int | None = None, overwrite: bool = False,
                       on_progress: ProgressCallback | None = None,
                       workers: int = 1) -> ConvertReport:
    """Convert source to the target format (SAFETENSORS_TARGET, TORCH_TARGET or DCP_TARGET)
    at output, on `workers` processes of `threads` threads each. include empty takes the
    target's default selection (for safetensors the model's weights, key_selection.py);
    strip_prefix None, safetensors' default (`model.` off names that all start with it)."""
    if target not in TARGET_OPTIONS:
        raise InvalidOptionError(f"unknown target {target!r}; dcpctl converts to "
                                 f"{', '.join(TARGET_OPTIONS)}")
    if dtype is not None and dtype not in CAST_DTYPE_NAMES:
        raise InvalidOptionError(f"cannot cast to {dtype!r}; dcpctl casts to "
                                 f"{', '.join(CAST_DTYPE_NAMES)}")
    common = {"threads": threads, "overwrite": overwrite, "on_progress": on_progress,
              "workers": workers}
    cast_to = dtype_by_name(dtype) if dtype is not None else None
    with workers_started(workers):
        if target == DCP_TARGET:
            from dcpctl.ops.convert.to_dcp import convert_to_dcp
            return convert_to_dcp(source, output, ranks, prefix, **common)
        if target == TORCH_TARGET:
            from dcpctl.ops.convert.to_torch_save import convert_to_torch_save
            selection = KeySelection(include or ("*",), exclude)
            return convert_to_torch_save(source, output, selection, cast_to, **common)
        from dcpctl.ops.convert.to_safetensors import convert_to_safetensors
        selection = KeySelection(include or None, exclude, strip_prefix, renames)
        return convert_to_safetensors(source, output, selection, cast_to, max_shard_bytes,
                                      **common)

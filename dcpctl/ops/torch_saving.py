"""torch `StorageWriter`s for a training job that saves its checkpoints compressed as it writes
them: torch's FileSystemWriter (or its fsspec writer for a URL) with the codec's extension."""

from __future__ import annotations

import os
from typing import Any

from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint._extension import StreamTransformExtension, ZStandard
from torch.distributed.checkpoint.filesystem import SerializationFormat

from dcpctl.errors import InvalidOptionError
from dcpctl.format.codecs.names import FLOATSPLIT, ZSTD
from dcpctl.format.codecs.registry import DEFAULT_ZSTD_LEVEL, codec_by_name
from dcpctl.format.codecs.torch_extension import FloatSplit
from dcpctl.storage.paths import is_remote, storage_path
from dcpctl.storage.stores import storage_options


def storage_writer(path: str | os.PathLike, codec: str = FLOATSPLIT, level: int | None = None,
                   thread_count: int = 1, **writer_options: Any) -> FileSystemWriter:
    """A torch StorageWriter that saves to path (a local directory or a URL) with every item
    coded by codec: `floatsplit` (dcpctl's), `zstd` (torch's own ZStandard, which stock torch
    loads) or `none`. level is floatsplit's level (FloatSplit's: by default 1, which codes for
    speed); the rest goes to torch's writer (and for a URL to fsspec, after the storage options
    in DCPCTL_STORAGE_OPTIONS)."""
    if isinstance(thread_count, bool) or not isinstance(thread_count, int) or thread_count < 1:
        raise InvalidOptionError(f"thread_count is a whole number, at least 1, not "
                                 f"{thread_count!r}")
    extensions = _extensions_for(codec, level)
    serialization = writer_options.get("serialization_format", SerializationFormat.TORCH_SAVE)
    if extensions and serialization != SerializationFormat.TORCH_SAVE:
        # torch writes such tensors past its extensions, each item's stream left empty
        raise InvalidOptionError(f"codec {codec!r} codes torch.save items; torch's writer "
                                 f"passes {serialization} tensors around its extensions")
    location = storage_path(path)
    if is_remote(location):
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

        # fsspec hands out one cached client per set of keywords, whatever endpoint and
        # credentials the environment names now: this writer gets its own.
        options = {"skip_instance_cache": True, **storage_options(), **writer_options}
        return FsspecWriter(str(location), thread_count=thread_count, _extensions=extensions,
                            **options)
    # the local path storage_path reads (`file:///abs/ck` is /abs/ck, not ./file:/abs/ck)
    return FileSystemWriter(location, thread_count=thread_count, _extensions=extensions,
                            **writer_options)


def _extensions_for(codec: str, level: int | None) -> list[StreamTransformExtension]:
    codec_by_name(codec, level or DEFAULT_ZSTD_LEVEL)  # refuses unknown names and levels
    if codec == FLOATSPLIT:
        return [FloatSplit() if level is None else FloatSplit(level)]
    if level not in (None, DEFAULT_ZSTD_LEVEL):
        raise InvalidOptionError(f"codec {codec!r} takes no level: torch's ZStandard writes "
                                 f"level {DEFAULT_ZSTD_LEVEL}, and `none` does not compress")
    return [ZStandard()] if codec == ZSTD else []

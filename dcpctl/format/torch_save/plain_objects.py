"""A non-tensor item's torch.save archive loaded without torch, where its pickle holds plain
Python data only: numbers, strings, bytes, containers (an optimizer's param_groups, a step
count, a scheduler's state). Importing torch to read such an object through its weights_only
loader costs seconds; Python's own unpickler, allowed no global but the few builtins torch's
loader allows for plain data and no persistent id, makes the same values and runs no code.
Anything else (a tensor, a torch.Size, a dtype, an opcode torch's loader does not read, a
damaged archive) is NotPlainData, left to torch's loader and its own errors.
"""

from __future__ import annotations

import codecs
import io
import pickle
from collections import Counter, OrderedDict
from typing import Any

from dcpctl.errors import name_and_message
from dcpctl.format.torch_save.layout import check_torch_save_records
from dcpctl.format.torch_save.loadable_pickle import refuse_unloadable_pickle
from dcpctl.format.torch_save.zip_records import read_zip_records

# What torch's weights_only loader allows of plain Python (_get_allowed_globals), each the
# callable it allows: bytes are pickled as _codecs.encode calls at protocol 2, and builtins
# under their Python 2 module name, __builtin__, as both unpicklers read it.
_PLAIN_GLOBALS = {
    ("collections", "OrderedDict"): OrderedDict, ("collections", "Counter"): Counter,
    ("_codecs", "encode"): codecs.encode,
    **{(module, builtin.__name__): builtin for module in ("builtins", "__builtin__")
       for builtin in (bytearray, set, complex)},
}


class NotPlainData(Exception):
    """The archive needs torch's loader: it is more than plain data, or not a sound pickle."""


class _PlainDataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        found = _PLAIN_GLOBALS.get((module, name))
        if found is None:
            raise NotPlainData(f"{module}.{name}")
        return found

    def persistent_load(self, pid: Any) -> Any:
        raise NotPlainData("a persistent id (a storage)")


def load_plain_object(archive: bytes) -> Any:
    """The value a torch.save archive holds, where it is plain data in a sound archive; raises
    NotPlainData for anything torch's loader must judge (so this never refuses what it would
    take, nor words a refusal differently)."""
    try:
        return _load(memoryview(archive))
    except NotPlainData:
        raise
    except Exception as error:  # damage fails in many ways: torch's loader says how
        raise NotPlainData(f"{name_and_message(error)}") from None


def _load(view: memoryview) -> Any:
    records = read_zip_records(lambda start, length: bytes(view[start:start + length]),
                               len(view))
    check_torch_save_records(records)
    prefix = records[0].name.partition("/")[0]
    if any(record.name.startswith(f"{prefix}/data/") for record in records):
        raise NotPlainData("storage records (tensors)")
    record = next(record for record in records if record.name == f"{prefix}/data.pkl")
    data = bytes(view[record.data_offset:record.data_end])
    record.check_crc(data)
    refuse_unloadable_pickle(data)
    # utf-8, as torch.load reads the 8-bit strings of a Python 2 pickle
    return _PlainDataUnpickler(io.BytesIO(data), encoding="utf-8").load()

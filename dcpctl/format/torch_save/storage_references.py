"""The storages an object's torch.save archive refers to, read off its data.pkl without building
anything it names: the check that an archive of any object (a DCP object item, a trainer's
`meta.pt` or `common.pt`) is one torch.load can read, beyond its zip records and CRC-32s.

torch.load unpickles data.pkl and loads each storage its persistent ids name, `('storage',
<storage type>, <key>, <location>, <numel>)`, from the record `<archive>/data/<key>`: a data.pkl
that is no pickle, or one naming a storage with no record, fails it however sound the zip is.
Its objects may be any class (Megatron's `common.pt` holds its argparse Namespace), so every
global the pickle names stands for one permissive class here, which takes any arguments and
state and runs no code of the pickle's choosing.
"""

from __future__ import annotations

import io
import pickle
from typing import Any

from dcpctl.errors import DataError, name_and_message
from dcpctl.unpickling_memory import bounded_memory

MAX_OBJECT_PICKLE_BYTES = 256 << 20
"""As much as dcpctl holds in memory of one object (format/checkpoint/items.py): a larger
data.pkl is not read for this check."""


class _StandIn:
    """Whatever a global of the pickle is, and whatever calling it makes."""

    def __new__(cls, *args: Any, **kwargs: Any) -> "_StandIn":
        return object.__new__(cls)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __call__(self, *args: Any, **kwargs: Any) -> "_StandIn":
        return _StandIn()

    def __setstate__(self, state: Any) -> None:
        pass

    def __setitem__(self, key: Any, value: Any) -> None:
        pass

    def append(self, value: Any) -> None:
        pass

    def extend(self, values: Any) -> None:
        pass

    def add(self, value: Any) -> None:
        pass


class _StorageKeysUnpickler(pickle.Unpickler):
    def __init__(self, data: bytes) -> None:
        super().__init__(io.BytesIO(data))
        self.storage_keys: dict[str, None] = {}  # in the order the pickle first names them

    def find_class(self, module: str, name: str) -> Any:
        return _StandIn

    def persistent_load(self, pid: Any) -> Any:
        # ('storage', storage type, key, location, element count), as torch's loader takes it
        if not (type(pid) is tuple and len(pid) == 5 and pid[0] == "storage"
                and type(pid[2]) is str):
            raise DataError(f"data.pkl names a persistent id {pid!r:.80}, not a storage as "
                            "torch.save names one")
        self.storage_keys.setdefault(pid[2])
        return _StandIn()


def referenced_storage_keys(data: bytes) -> list[str]:
    """The keys of the storages the data.pkl of a torch.save archive refers to, in the order it
    first names each; DataError where it is no pickle, or names a persistent id that is no
    storage."""
    unpickler = _StorageKeysUnpickler(data)
    try:
        with bounded_memory(len(data)):
            unpickler.load()
    except DataError:
        raise
    except Exception as error:  # damage fails in many ways: all mean the same
        raise DataError(f"data.pkl is no pickle torch.load reads "
                        f"({name_and_message(error)})") from None
    return list(unpickler.storage_keys)

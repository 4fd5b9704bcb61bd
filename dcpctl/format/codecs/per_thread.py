"""One object per thread, made on first use: the coders and scratch buffers codecs reuse.

Making a zstd context or a multi-megabyte buffer costs more than coding a small item, so each
thread keeps its own and reuses them; they are never shared, so they need no lock. They are
fetched at each use, as a coder may be handed from thread to thread between uses.
"""

from __future__ import annotations

import threading
from typing import Callable, Generic, TypeVar

Value = TypeVar("Value")


class PerThread(Generic[Value]):
    """`get()` returns this thread's value, made by `make()` the first time."""

    def __init__(self, make: Callable[[], Value]) -> None:
        self._make = make
        self._local = threading.local()

    def get(self) -> Value:
        """This thread's value."""
        try:
            return self._local.value
        except AttributeError:
            value = self._local.value = self._make()
            return value

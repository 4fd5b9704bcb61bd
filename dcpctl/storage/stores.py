"""The object stores a process has opened, one per protocol and storage options.

fsspec is an optional dependency (`pip install 'dcpctl[s3]'`): it is imported when the first
URL is opened, and its absence is a one-line error naming the extra to install.
"""

from __future__ import annotations

import copyreg
import importlib
import json
import os
import threading

from dcpctl.errors import DcpctlError
from dcpctl.storage.objects import ObjectStore
from dcpctl.storage.s3 import S3Store, new_s3_store

# Storage options for every URL, as JSON (`{"anon": true}`); the command line's
# --storage-option KEY=VALUE adds to them.
STORAGE_OPTIONS_ENVIRONMENT = "DCPCTL_STORAGE_OPTIONS"

_STORES: dict[tuple[str, str], ObjectStore] = {}
_STORES_LOCK = threading.Lock()
_EXTRA_OPTIONS: dict[str, object] = {}


def add_storage_options(options: dict[str, object]) -> None:
    """Storage options (fsspec's keyword arguments) for every store opened after this."""
    _EXTRA_OPTIONS.update(options)


def storage_options() -> dict[str, object]:
    """The storage options in force: DCPCTL_STORAGE_OPTIONS, then those added."""
    text = os.environ.get(STORAGE_OPTIONS_ENVIRONMENT, "").strip()
    options: dict[str, object] = {}
    if text:
        try:
            options = json.loads(text)
        except ValueError as error:
            raise DcpctlError(f"{STORAGE_OPTIONS_ENVIRONMENT} is not JSON: {error}") from None
        if not isinstance(options, dict):
            raise DcpctlError(f"{STORAGE_OPTIONS_ENVIRONMENT} must be a JSON object")
    return {**options, **_EXTRA_OPTIONS}


def store_for(protocol: str) -> ObjectStore:
    """The store for a protocol, made once per process with the storage options in force; a
    protocol's other names (`s3a` for `s3`) give the one store, so that a path is the same
    path whatever name reaches it."""
    protocol = _canonical_protocol(protocol)
    options = storage_options()
    # where the client finds its endpoint and credentials is part of what a store is
    environment = sorted((name, value) for name, value in os.environ.items()
                         if name.startswith("AWS_"))
    cache_key = (protocol, json.dumps([options, environment], sort_keys=True, default=str))
    with _STORES_LOCK:
        store = _STORES.get(cache_key)
        if store is None:
            store = _STORES[cache_key] = _new_store(protocol, options)
        return store


def _canonical_protocol(protocol: str) -> str:
    """The first of the names fsspec's file system for protocol answers to."""
    try:
        names = importlib.import_module("fsspec").get_filesystem_class(protocol).protocol
    except (ImportError, ValueError):
        return protocol  # no such file system: _new_store says so
    return names if isinstance(names, str) else names[0]


def _store_by_protocol(store: ObjectStore):
    """Pickle a store as its protocol: a worker process opens its own, with the storage options
    in force there (which the coordinator hands it first)."""
    if store.protocol == "memory":
        raise DcpctlError("memory:// objects live in one process; worker processes and torchrun "
                          "ranks need a local path or a shared object store")
    return store_for, (store.protocol,)


copyreg.pickle(ObjectStore, _store_by_protocol)
copyreg.pickle(S3Store, _store_by_protocol)


def _new_store(protocol: str, options: dict[str, object]) -> ObjectStore:
    try:
        fsspec = importlib.import_module("fsspec")
    except ImportError:
        raise DcpctlError(f"{protocol}:// URLs need fsspec: pip install 'dcpctl[s3]'") from None
    if protocol in ("s3", "s3a"):
        return new_s3_store(protocol, options)
    try:
        filesystem = fsspec.filesystem(protocol, **options)
    except (ImportError, ValueError) as error:
        raise DcpctlError(f"cannot open {protocol}:// URLs: {error}") from None
    return ObjectStore(protocol, filesystem)

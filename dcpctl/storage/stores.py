"""The object stores a process has opened, one per protocol and storage options.

fsspec is an optional dependency (`pip install 'dcpctl[s3]'`): it is imported when the first
URL is opened, and its absence is a one-line error naming the extra to install.
"""

from __future__ import annotations

import copyreg
import importlib
import json
import os
import re
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


# adlfs's connection_string holds the account's key
_SECRET_OPTION = re.compile(r"secret|pass|token|auth|key|cred|sig|sas|cert|connection_string",
                            re.IGNORECASE)
_SECRET_ENVIRONMENT = ("AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN",
                       "AZURE_STORAGE_CONNECTION_STRING", "AZURE_STORAGE_ACCOUNT_KEY",
                       "AZURE_STORAGE_KEY", "AZURE_STORAGE_SAS_TOKEN",
                       "AZURE_STORAGE_CLIENT_SECRET", "AZURE_CLIENT_SECRET")
_SHORTEST_SECRET = 3
"""Shorter values are no secret worth hiding (a test's `x`), and hiding them would mangle the
line: every `y` of `list-type` shown as `***`."""


def without_secrets(text: str) -> str:
    """text with the secrets of the storage options in force (the values of options named
    like a key, password, token or credentials, at any depth, and the key fields of a
    connection string) and of the AWS and Azure environment shown as `***`: what a file
    system's error may quote back."""
    secrets = {value for value in map(os.environ.get, _SECRET_ENVIRONMENT)
               if value and len(value) >= _SHORTEST_SECRET}
    try:
        _collect_secrets(storage_options(), False, secrets)
    except DcpctlError:  # options that are no JSON object hold nothing to find
        pass
    secrets.update(_secret_fields(secrets))
    spellings = {spelling for secret in filter(None, secrets)
                 for spelling in (secret, repr(secret)[1:-1], json.dumps(secret)[1:-1])}
    for spelling in sorted(spellings, key=len, reverse=True):  # as quoted back, too
        text = text.replace(spelling, "***")
    return without_user_info(text)


_URL_USER_INFO = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*://)[^/\s@]*@")


def holds_user_info(url: str) -> bool:
    """Whether a URL names a user or password (`ftp://user:password@host/...`)."""
    return _URL_USER_INFO.match(url) is not None


def without_user_info(text: str) -> str:
    """text with the user and password of every URL in it shown as `***`."""
    return _URL_USER_INFO.sub(r"\1***@", text)


def _secret_fields(secrets: set[str]) -> set[str]:
    """The values of the fields named like a secret in secrets that are connection strings
    (Azure's `AccountName=a;AccountKey=...;...`): an error may quote the key alone."""
    fields = set()
    for secret in secrets:
        for field in secret.split(";"):
            name, equals, value = field.partition("=")
            if equals and _SECRET_OPTION.search(name) and len(value) >= _SHORTEST_SECRET:
                fields.add(value)
    return fields


def _collect_secrets(value: object, secret: bool, into: set) -> None:
    """Into `into`, the values of value held under a key named like a secret: all of a list's
    (`auth: [user, password]`), the secret-named ones of a dict (a service account's JSON
    keeps its private key beside its project's name)."""
    if isinstance(value, dict):
        for key, inner in value.items():
            _collect_secrets(inner, bool(_SECRET_OPTION.search(str(key))), into)
    elif isinstance(value, (list, tuple)):
        for inner in value:
            _collect_secrets(inner, secret, into)
    elif secret and value is not None and len(str(value)) >= _SHORTEST_SECRET:
        into.add(str(value))


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


def abort_open_uploads() -> None:
    """Abort every upload this process started and neither completed nor aborted, in every
    store (ObjectStore.abort_open_uploads): what a worker whose share failed or was stopped
    leaves, which its coordinator's clean-up cannot reach."""
    with _STORES_LOCK:
        stores = list(_STORES.values())
    for store in stores:
        store.abort_open_uploads("")


def etags_written(since: dict[str, dict[str, str]] | None = None) -> dict[str, dict[str, str]]:
    """By protocol, the ETags the writes of this process were given (ObjectStore.etags_written),
    only those not already in `since` (what it gave earlier): what a worker process hands its
    coordinator with a share's result (adopt_etags_written)."""
    with _STORES_LOCK:
        stores = list(_STORES.values())
    written: dict[str, dict[str, str]] = {}
    for store in stores:
        earlier = (since or {}).get(store.protocol, {})
        written.setdefault(store.protocol, {}).update(
            (key, etag) for key, etag in store.etags_written().items()
            if earlier.get(key) != etag)
    return {protocol: etags for protocol, etags in written.items() if etags}


def adopt_etags_written(written: dict[str, dict[str, str]]) -> None:
    """Take the ETags a worker's writes were given (etags_written there) as this process's own,
    so that its checks of the output it publishes (staging) know every object's."""
    for protocol, etags in written.items():
        store = store_for(protocol)
        for key, etag in etags.items():
            store.note_written(key, etag)


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
    except (ImportError, ValueError, TypeError) as error:  # TypeError: an option's type
        raise DcpctlError(f"cannot open {protocol}:// URLs: {error}") from None
    return ObjectStore(protocol, filesystem)

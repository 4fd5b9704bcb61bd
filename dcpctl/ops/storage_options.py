"""Storage options (fsspec's keyword arguments) for every checkpoint at a URL, named here for
the command line, which reaches storage only through the operations."""

from __future__ import annotations

from dcpctl.storage.stores import (STORAGE_OPTIONS_ENVIRONMENT, add_storage_options,
                                   without_secrets)

__all__ = ["STORAGE_OPTIONS_ENVIRONMENT", "add_storage_options", "without_secrets"]

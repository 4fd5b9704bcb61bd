"""What the libraries dcpctl calls log (gcsfs, botocore, fsspec, aiohttp...): not shown unless
--debug asks.

A failure reaches the user as dcpctl's one `Error:` line. A library that logs with no handler
configured gets Python's last-resort handler, which prints its warnings and errors, tracebacks
and all, on stderr: gcsfs logs each request it gives up on, 51 lines for one failed request
and over a thousand for a verify against a store that stopped answering, above the line that
says what happened.
"""

from __future__ import annotations

import logging
import os
import sys

_SHOWN = "DCPCTL_SHOW_LIBRARY_LOGS"
"""Set by show_library_logs: the worker processes a --debug command starts inherit it."""


def quiet_library_logs() -> None:
    """Give the root logger a handler that drops every record (it keeps Python's last-resort
    handler from printing them): for the dcpctl process and each worker it starts. A worker
    of a command run with --debug shows them instead."""
    logging.getLogger().addHandler(logging.NullHandler())
    if os.environ.get(_SHOWN):
        show_library_logs()


def show_library_logs(in_workers: bool = False) -> None:
    """Print the libraries' warnings and errors on stderr (--debug); with in_workers, in the
    worker processes started from now on too (for the dcpctl process itself: the variable
    would outlast a command run inside another program)."""
    if in_workers:
        os.environ[_SHOWN] = "1"
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(name)s: %(levelname)s: %(message)s"))
    logging.getLogger().addHandler(handler)

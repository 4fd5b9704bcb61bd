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
import sys


def quiet_library_logs() -> None:
    """Give the root logger a handler that drops every record (it keeps Python's last-resort
    handler from printing them). For the dcpctl process and each worker it starts."""
    logging.getLogger().addHandler(logging.NullHandler())


def show_library_logs() -> None:
    """Print the libraries' warnings and errors on stderr (--debug)."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(name)s: %(levelname)s: %(message)s"))
    logging.getLogger().addHandler(handler)

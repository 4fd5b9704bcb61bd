"""Options that several commands share."""

from __future__ import annotations

import click

threads_option = click.option(
    "--threads", type=click.IntRange(min=1), default=None,
    help="Threads doing the work, each reading, coding, writing and hashing whole items; 1 "
         "runs everything in one thread (default: the cores this process may use).")

"""Options that several commands share."""

from __future__ import annotations

import click

threads_option = click.option(
    "--threads", type=click.IntRange(min=1), default=None,
    help="Worker threads (default: the cores this process may use).")

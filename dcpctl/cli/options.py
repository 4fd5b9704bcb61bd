"""The arguments and options several commands share, declared once."""

from __future__ import annotations

import click

from dcpctl.cli.render import JSON_ASKED
from dcpctl.ops.distributed import REMOTE_THREADS, default_workers


def _remember_json(context: click.Context, parameter: click.Parameter, as_json: bool) -> bool:
    """--json, noted in the context object, where a failure's message finds it."""
    context.ensure_object(dict)[JSON_ASKED] = as_json
    return as_json


json_option = click.option("--json", "as_json", is_flag=True, callback=_remember_json,
                           help="Print the report as one JSON document instead of text; "
                                "a failure that leaves no report prints {\"error\": MESSAGE, "
                                "\"exit_code\": N} instead (its Error: line still on stderr; "
                                "a command line that does not parse, on stderr only).")
# Past these, a typo (`--workers 100000`) would start a process or thread per unit of it.
MAX_WORKERS = MAX_THREADS = 1024
threads_option = click.option(
    "--threads", type=click.IntRange(min=1, max=MAX_THREADS), default=None,
    help="Threads doing the work, each on whole items at a time; 1 runs everything in one "
         "thread (default: the cores this process may use, and at least "
         f"{REMOTE_THREADS} for a checkpoint in an object store, where threads mostly wait on "
         "the network).")
workers_option = click.option(
    "--workers", type=click.IntRange(min=1, max=MAX_WORKERS), default=None,
    help="Processes sharing the work on this machine (this one and N - 1 it starts), each "
         "with its own --threads (default threads: the cores shared among the workers); the "
         "output is the same byte for byte whatever the number. Default: one per core for a "
         "local checkpoint, but at most one per 256 MiB of its files and as many as half the "
         "available memory holds (each holds its own plan, about 16 bytes per byte of "
         "`.metadata`); 1 for an object store. Across machines, run the command under "
         "torchrun instead: `torchrun --nnodes 2 --nproc-per-node 8 ... -m dcpctl COMMAND ...` "
         "(see dcpctl --help).")
overwrite_option = click.option("--overwrite", is_flag=True,
                                help="Replace an output that exists and is not empty.")
dry_run_option = click.option("--dry-run", is_flag=True,
                              help="Report what would be done; change and write nothing.")


def workers_for(workers: int | None, checkpoint: str, output: str | None = None) -> int:
    """--workers as given, or the default for a command on checkpoint writing to output."""
    if workers is not None:
        return workers
    return default_workers(checkpoint, output)


def checkpoint_argument(name: str = "checkpoint"):
    """A checkpoint (or run directory, or conversion source) given as a path."""
    return click.argument(name, type=click.Path())


def output_option(required: bool, help: str):
    """-o/--output PATH. A required one has no default: click (8.3 on) takes a default of None
    as given, and would let the command run without it."""
    default = {} if required else {"default": None}
    return click.option("-o", "--output", type=click.Path(), required=required, help=help,
                        **default)

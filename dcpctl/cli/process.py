"""Ending the dcpctl process early, once a command's output is out."""

from __future__ import annotations

import os
import sys

import click

from dcpctl.stopping import handle_stops

# Set in the context object by the console-script entry point only: commands called from
# Python (tests through click's CliRunner) never end the process.
RUNS_AS_PROCESS = "runs_as_process"


def end_process_without_teardown(context: click.Context, exit_code: int = 0) -> None:
    """In the dcpctl process itself, flush the output and exit with exit_code at once:
    freeing millions of objects one by one at shutdown can take longer than the command's
    own work."""
    if not (context.find_root().obj or {}).get(RUNS_AS_PROCESS):
        return
    end_process_now(exit_code)


def end_at_once_if_stopped(exit_code: int) -> None:
    """For the dcpctl process whose command has ended, its result said: a stop from now on
    (Ctrl-C, SIGTERM, SIGHUP while the interpreter tears down, joining threads and running
    exit handlers) ends it at once with the command's own status, where the stop raised into
    the teardown would print `Exception ignored in ...` or end the process by the signal."""
    handle_stops(lambda number, frame: end_process_now(exit_code))


def end_process_now(exit_code: int) -> None:
    """Flush the output and exit with exit_code, without the interpreter's teardown."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a reader gone (`| head`), a stream closed: nothing to do
            pass
    os._exit(exit_code)

"""`dcpctl checksum`: write SHA256SUMS for a checkpoint."""

from __future__ import annotations

import click

from dcpctl.cli.options import (checkpoint_argument, json_option, threads_option, workers_for,
                                workers_option)
from dcpctl.cli.progress import byte_progress
from dcpctl.cli.render import format_bytes, print_report
from dcpctl.ops.checksum import ChecksumReport, checksum_checkpoint
from dcpctl.wording import counted


@click.command("checksum")
@checkpoint_argument()
@json_option
@threads_option
@workers_option
def checksum_command(checkpoint: str, as_json: bool, threads: int | None,
                     workers: int | None) -> None:
    """Write CHECKPOINT/SHA256SUMS covering `.metadata` and every data file.

    The file is in the coreutils format, so `cd CHECKPOINT && sha256sum -c SHA256SUMS`
    checks the checkpoint with no dcpctl installed, and `dcpctl verify` checks it too. Files
    are hashed in parallel, and every item is checked as `dcpctl verify` checks it: a
    damaged checkpoint, or one whose SHA256SUMS already disagrees, is refused and nothing is
    written (remove SHA256SUMS first to certify files changed on purpose).

    \b
    Examples:
      dcpctl checksum ckpt/
      cd ckpt/ && sha256sum -c SHA256SUMS
    """
    with byte_progress("checksum") as progress:
        report = checksum_checkpoint(checkpoint, threads, progress,
                                     workers_for(workers, checkpoint))
    print_report(report, as_json, render_checksum_report)


def render_checksum_report(report: ChecksumReport) -> list[str]:
    """Where SHA256SUMS went and what it covers, for people."""
    return [f"wrote {report.sums_path}: {counted(len(report.digests), 'file')}, "
            f"{format_bytes(report.hashed_bytes)}"]

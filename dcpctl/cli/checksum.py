"""`dcpctl checksum`: write SHA256SUMS for a checkpoint."""

from __future__ import annotations

import click

from dcpctl.cli.options import threads_option
from dcpctl.cli.progress import byte_progress
from dcpctl.cli.render import echo_json, format_bytes
from dcpctl.ops.checksum import checksum_checkpoint


@click.command("checksum")
@click.argument("checkpoint", type=click.Path(file_okay=True, dir_okay=True))
@click.option("--json", "as_json", is_flag=True, help="Print a JSON document.")
@threads_option
def checksum_command(checkpoint: str, as_json: bool, threads: int | None) -> None:
    """Write CHECKPOINT/SHA256SUMS covering `.metadata` and every data file.

    The file is in the coreutils format, so `cd CHECKPOINT && sha256sum -c SHA256SUMS`
    checks the checkpoint with no dcpctl installed, and `dcpctl verify` checks it too. Files
    are hashed in parallel. A checkpoint with missing or truncated data files is refused.

    \b
    Examples:
      dcpctl checksum ckpt/
      cd ckpt/ && sha256sum -c SHA256SUMS
    """
    with byte_progress("checksum") as progress:
        report = checksum_checkpoint(checkpoint, threads, progress)
    if as_json:
        echo_json(report.to_json())
        return
    click.echo(f"wrote {report.sums_path}: {len(report.digests)} files, "
               f"{format_bytes(report.hashed_bytes)}")

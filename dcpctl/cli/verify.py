"""`dcpctl verify`: prove a checkpoint whole, or list what is wrong with it."""

from __future__ import annotations

import click

from dcpctl.cli.options import (checkpoint_argument, json_option, threads_option, workers_for,
                                workers_option)
from dcpctl.cli.process import end_process_without_teardown
from dcpctl.cli.progress import byte_progress
from dcpctl.cli.render import format_bytes, print_report, render_problem
from dcpctl.ops.verify.verifier import VerifyReport, verify_checkpoint
from dcpctl.wording import counted


@click.command("verify")
@checkpoint_argument()
@click.option("--quick", is_flag=True,
              help="Check structure and SHA256SUMS only; do not decode the items.")
@json_option
@threads_option
@workers_option
@click.pass_context
def verify_command(context: click.Context, checkpoint: str, quick: bool, as_json: bool,
                   threads: int | None, workers: int | None) -> None:
    """Check that CHECKPOINT is whole; exit 0 if it is, 1 if anything is wrong.

    Structure: `.metadata` reads (safely) as DCP metadata, every data file it names is there
    and holds every byte range it names, the chunks of each tensor tile it with no gap or
    overlap, stored lengths fit dtype and shape. Checksums: when SHA256SUMS is present, every
    file it lists matches; files the metadata does not know are reported. Deep (skipped by
    --quick): every item decodes through its transforms (zstd), every torch.save record
    matches its CRC-32, and every tensor's dtype and shape match the metadata.

    Every problem is reported, each with its file, byte range and fqns. A directory with
    data files but no `.metadata` (a save still running, or one that died) is incomplete; one
    whose `.metadata` names a class outside DCP's (which dcpctl never unpickles: a custom
    planner's, a quantized dtype, or a damaged name), or that the file system fails to read,
    with no other problem, is unreadable.
    Files are read once each, in parallel, in bounded memory.

    \b
    Examples:
      dcpctl verify ckpt/
      dcpctl verify ckpt/ --quick          # with SHA256SUMS: checksums and structure
      dcpctl verify ckpt/ --json | jq '.problems[] | .fqns[]'
    """
    with byte_progress("verify") as progress:
        report = verify_checkpoint(checkpoint, deep=not quick, threads=threads,
                                   on_progress=progress,
                                   workers=workers_for(workers, checkpoint))
    print_report(report, as_json, render_report)
    end_process_without_teardown(context, report.exit_code)  # not freeing report.checkpoint
    context.exit(report.exit_code)


def render_report(report: VerifyReport) -> list[str]:
    """A summary of the checks made, then each problem on two lines."""
    checks = ["structure"]
    if report.checksummed_files is not None:
        checks.append(f"checksums ({counted(report.checksummed_files, 'file')} in SHA256SUMS)")
    if report.deep:
        checks.append(f"deep ({counted(report.items_checked, 'item')})")
    status = report.status
    if report.problems:
        status += f": {counted(len(report.problems), 'problem')}"
    lines = [f"checkpoint  {report.path}", f"checks      {', '.join(checks)}",
             f"read        {format_bytes(report.bytes_read)}", f"status      {status}"]
    if report.leftover_temporaries:
        lines.append(f"leftovers   {len(report.leftover_temporaries)} temporary files of a "
                     "stopped (or running) dcpctl, not the checkpoint's: the next in-place run "
                     "removes them (in an object store once a day old)")
    if report.divergent_copies:
        shown = ", ".join(report.divergent_copies[:3])
        more = len(report.divergent_copies) - 3
        lines.append(f"copies      {counted(len(report.divergent_copies), 'item')} a rank saved "
                     "under a key a lower rank saved too, with other bytes than the copy kept "
                     "(other values, or equal ones stored otherwise: a set's order, a "
                     "tensor's strides); each rank loads its own, reshard and convert write "
                     f"the kept one: {shown}{f', and {more} more' if more > 0 else ''}")
    for problem in report.problems:
        lines += ["", *render_problem(problem)]
    return lines

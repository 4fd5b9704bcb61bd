"""`dcpctl compress` and `dcpctl decompress`: re-encode every item, in place or into -o OUT."""

from __future__ import annotations

import click

from dcpctl.cli.options import (checkpoint_argument, dry_run_option, json_option, output_option,
                                overwrite_option, threads_option, workers_for,
                                workers_option)
from dcpctl.cli.progress import byte_progress
from dcpctl.cli.render import format_bytes, print_report
from dcpctl.ops.transcode import (COMPRESSING_CODEC_NAMES, DEFAULT_ZSTD_LEVEL, IDENTITY,
                                  MAX_ZSTD_LEVEL, MIN_ZSTD_LEVEL, ZSTD, TranscodeReport,
                                  compress_checkpoint, decompress_checkpoint)
from dcpctl.wording import counted

_output_option = output_option(
    required=False,
    help="Write the result to this directory instead of rewriting CHECKPOINT in place. It must "
         "not exist or be empty, unless --overwrite; CHECKPOINT itself means in place.")


@click.command("compress")
@checkpoint_argument()
@_output_option
@click.option("--codec", "codec_name", type=click.Choice(COMPRESSING_CODEC_NAMES), default=ZSTD,
              show_default=True,
              help="zstd: torch's own `stream.zstd/1`, loads with stock torch. floatsplit: "
                   "dcpctl's `dcpctl.floatsplit/2`, smaller on float weights; loads through "
                   "dcpctl.storage_reader.")
@click.option("--level", type=click.IntRange(MIN_ZSTD_LEVEL, MAX_ZSTD_LEVEL), default=None,
              help=f"zstd level, {MIN_ZSTD_LEVEL}-{MAX_ZSTD_LEVEL} (default "
                   f"{DEFAULT_ZSTD_LEVEL}); for floatsplit, the level of its plain zstd parts, "
                   "and 1 codes for speed: no row and column prediction, as a save through "
                   "dcpctl.FloatSplit writes by default. Given explicitly, items already in the "
                   "chosen codec are re-compressed; otherwise they are copied as they are.")
@threads_option
@workers_option
@dry_run_option
@overwrite_option
@json_option
def compress_command(checkpoint: str, output: str | None, codec_name: str, level: int | None,
                     threads: int | None, workers: int | None, dry_run: bool,
                     overwrite: bool, as_json: bool) -> None:
    """Compress every item of CHECKPOINT with zstd (torch's own `stream.zstd/1` transform) or
    with floatsplit.

    With zstd (the default) the result loads with plain `torch.distributed.checkpoint.load`
    and the default FileSystemReader (torch needs the `zstandard` package, which dcpctl
    installs). With floatsplit, tensor items have their float bytes split into an exponent
    plane and sign and mantissa planes, each entropy-coded (about 0.66 of the bytes on bfloat16
    weights where zstd keeps about 0.78); such a checkpoint loads with
    `dcp.load(state_dict, storage_reader=dcpctl.storage_reader(CHECKPOINT))`, while plain torch
    fails with "Unknown extension". `compress --codec zstd` or `decompress` makes it loadable
    by stock torch again. Without -o the checkpoint is rewritten in place, atomically: new
    files are written beside the old ones, `.metadata` switches to them with a rename, the old
    files go last; a run killed at any moment leaves a checkpoint that loads. Every item is
    checked as it is read (see `dcpctl verify`): damage stops the run, naming the file and
    item, and nothing is published. SHA256SUMS is written for the result. In place, a
    checkpoint whose items are all in the codec already (and no --level given) and whose
    SHA256SUMS certifies every file (checked first) is left as it is.

    \b
    Examples:
      dcpctl compress ckpt/                      # in place, zstd level 3
      dcpctl compress ckpt/ -o ckpt-zstd/        # into a new directory
      dcpctl compress ckpt/ --level 9            # recompress, also items already in zstd
      dcpctl compress ckpt/ --codec floatsplit   # smallest; load with dcpctl.storage_reader
      dcpctl compress ckpt/ --dry-run --json
    """
    with byte_progress("compress") as progress:
        report = compress_checkpoint(checkpoint, codec_name, level, output, threads=threads,
                                     workers=workers_for(workers, checkpoint, output),
                                     dry_run=dry_run, overwrite=overwrite,
                                     on_progress=progress)
    print_report(report, as_json, render_transcode_report)


@click.command("decompress")
@checkpoint_argument()
@_output_option
@threads_option
@workers_option
@dry_run_option
@overwrite_option
@json_option
def decompress_command(checkpoint: str, output: str | None, threads: int | None,
                       workers: int | None,
                       dry_run: bool, overwrite: bool, as_json: bool) -> None:
    """Store every item of CHECKPOINT uncompressed, byte for byte as torch saved it.

    The reverse of `compress`: each item is decoded and written plain, so the result loads
    with any torch, even without zstandard. In place unless -o is given, atomically, with
    SHA256SUMS written for the result; in place, a checkpoint stored uncompressed already,
    whose SHA256SUMS certifies every file (checked first), is left as it is.

    \b
    Examples:
      dcpctl decompress ckpt/
      dcpctl decompress ckpt/ -o plain/ --threads 8
    """
    with byte_progress("decompress") as progress:
        report = decompress_checkpoint(checkpoint, output, threads=threads,
                                       workers=workers_for(workers, checkpoint, output),
                                       dry_run=dry_run, overwrite=overwrite,
                                       on_progress=progress)
    print_report(report, as_json, render_transcode_report)


def render_transcode_report(report: TranscodeReport) -> list[str]:
    """What a compress or decompress did, for people."""
    if report.unchanged:
        left = "would be left" if report.dry_run else "left"
        stored = "stored uncompressed" if report.codec == IDENTITY.name else f"in {report.codec}"
        lines = [f"{report.source}: every one of its {report.items} items is {stored} "
                 f"already: {left} as it is",
                 f"stored: {format_bytes(report.stored_bytes_before)}"]
        lines += [f"removed {name}, left by an earlier interrupted run"
                  for name in report.removed_stale_files]
        return lines
    where = "in place" if report.in_place else f"into {report.output}"
    verb = "would rewrite" if report.dry_run else "rewrote"
    encoding = "uncompressed" if report.codec == IDENTITY.name else f"as {report.codec}"
    lines = [f"{report.source}: {verb} {counted(report.items, 'item')} {where} {encoding}"
             + (f" level {report.level}" if report.level else "")
             + f" ({report.items_transcoded} re-encoded, {report.items_copied} copied)"]
    if report.dry_run:
        return lines + [f"stored now: {format_bytes(report.stored_bytes_before)}"]
    rate = report.stored_bytes_before / report.seconds if report.seconds else 0
    lines.append(f"stored: {format_bytes(report.stored_bytes_before)} -> "
                 f"{format_bytes(report.stored_bytes_after)} (ratio {report.ratio:.3f}) in "
                 f"{report.seconds:.1f} s, {format_bytes(int(rate))}/s on "
                 + (f"{report.workers} workers of " if report.workers > 1 else "")
                 + (f"{report.threads} threads" if report.threads > 1 else "1 thread"))
    lines += [f"removed {name}, left by an earlier interrupted run"
              for name in report.removed_stale_files]
    return lines

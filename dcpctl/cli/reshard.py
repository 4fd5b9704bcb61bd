"""`dcpctl reshard`: lay a checkpoint out for a new world size."""

from __future__ import annotations

import click

from dcpctl.cli.options import (checkpoint_argument, json_option, output_option, overwrite_option,
                                threads_option, workers_option)
from dcpctl.cli.progress import byte_progress
from dcpctl.cli.render import format_bytes, print_report
from dcpctl.ops.reshard.execution import CODEC_NAMES, ReshardReport, reshard_checkpoint


@click.command("reshard")
@checkpoint_argument()
@click.option("--ranks", "world_size", type=click.IntRange(min=1), required=True,
              help="World size of the job that will load the result.")
@output_option(required=True, help="Directory for the new checkpoint; must not exist or be "
                                   "empty, unless --overwrite.")
@click.option("--codec", "codec_name", type=click.Choice(CODEC_NAMES), default=None,
              help="Codec of the output items (default: the input's, so zstd stays zstd); "
                   "none stores them as they are.")
@threads_option
@workers_option
@overwrite_option
@json_option
def reshard_command(checkpoint: str, world_size: int, output: str, codec_name: str | None,
                    threads: int | None, workers: int, overwrite: bool, as_json: bool) -> None:
    """Write CHECKPOINT laid out for a job of --ranks ranks, one file per rank.

    Every tensor is split along dim 0 exactly as a real N-rank FSDP2 save (`fully_shard`,
    `Shard(0)` on a 1-D mesh) splits it: ceil(rows / N) rows per rank, the last ranks smaller
    or empty, like torch.chunk. Rank r's chunks go to `__r_0.distcp`, so each rank of the next
    job reads only its own file. 0-d tensors and non-tensor objects go to rank 0. Any DCP
    input works: FSDP2 or 2-D mesh shards, zstd or plain, TORCH_SAVE or SAFETENSORS
    serialization. Output chunks are assembled from the byte ranges of the input chunks they
    overlap, a large chunk in blocks of rows, so memory stays near a few 4 MiB blocks per
    thread; zstd inputs are decoded once, a chunk of up to 4 MiB in memory and a larger one
    into a temporary spool file beside the output. The output is written into a hidden sibling
    directory and renamed into place, with SHA256SUMS.

    \b
    Examples:
      dcpctl reshard ckpt/ --ranks 16 -o ckpt-16/
      dcpctl reshard ckpt/ --ranks 1 -o consolidated/      # one file
      dcpctl reshard ckpt/ --ranks 8 -o out/ --codec zstd --json
    """
    with byte_progress("reshard") as progress:
        report = reshard_checkpoint(checkpoint, world_size, output, codec_name, threads=threads,
                                    overwrite=overwrite, on_progress=progress, workers=workers)
    print_report(report, as_json, render_reshard_report)


def render_reshard_report(report: ReshardReport) -> str:
    """What a reshard did, for people."""
    rate = report.logical_bytes / report.seconds if report.seconds else 0
    return (f"{report.source} -> {report.output}: {report.tensors} tensors in "
            f"{report.chunks_written} chunks and {report.objects} objects over "
            f"{report.world_size} ranks ({report.files} files), codec {report.codec}\n"
            f"wrote {format_bytes(report.stored_bytes_after)} in {report.seconds:.1f} s "
            f"({format_bytes(int(rate))}/s of tensor data)")

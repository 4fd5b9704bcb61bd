"""`dcpctl reshard`: lay a checkpoint out for a new world size."""

from __future__ import annotations

import click

from dcpctl.cli.options import threads_option
from dcpctl.cli.progress import byte_progress
from dcpctl.cli.render import echo_json, format_bytes
from dcpctl.format.codecs.registry import IDENTITY, floatsplit_codec, zstd_codec
from dcpctl.ops.reshard import ReshardReport, reshard_checkpoint

_CODECS = {"zstd": zstd_codec, "floatsplit": floatsplit_codec, "none": lambda: IDENTITY}


@click.command("reshard")
@click.argument("checkpoint", type=click.Path())
@click.option("--ranks", "world_size", type=click.IntRange(min=1), required=True,
              help="World size of the job that will load the result.")
@click.option("-o", "--output", type=click.Path(), required=True,
              help="Directory for the new checkpoint; must not exist or be empty, unless "
                   "--overwrite.")
@click.option("--codec", type=click.Choice(sorted(_CODECS)), default=None,
              help="Codec of the output items (default: the input's, so zstd stays zstd).")
@threads_option
@click.option("--overwrite", is_flag=True, help="Replace a non-empty output directory.")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
def reshard_command(checkpoint: str, world_size: int, output: str, codec: str | None,
                    threads: int | None, overwrite: bool, as_json: bool) -> None:
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
        report = reshard_checkpoint(checkpoint, world_size, output,
                                    codec=_CODECS[codec]() if codec else None, threads=threads,
                                    overwrite=overwrite, on_progress=progress)
    render_reshard_report(report, as_json)


def render_reshard_report(report: ReshardReport, as_json: bool) -> None:
    """Print what a reshard did."""
    if as_json:
        echo_json(report.to_json())
        return
    rate = report.logical_bytes / report.seconds if report.seconds else 0
    click.echo(f"{report.source} -> {report.output}: {report.tensors} tensors in "
               f"{report.chunks_written} chunks and {report.objects} objects over "
               f"{report.world_size} ranks ({report.files} files), codec {report.codec}")
    click.echo(f"wrote {format_bytes(report.stored_bytes_after)} in {report.seconds:.1f} s "
               f"({format_bytes(int(rate))}/s of tensor data)")

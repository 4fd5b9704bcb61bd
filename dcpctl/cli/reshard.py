"""`dcpctl reshard`: lay a checkpoint out for a new world size."""

from __future__ import annotations

import click

from dcpctl.cli.options import (checkpoint_argument, json_option, output_option, overwrite_option,
                                threads_option, workers_for, workers_option)
from dcpctl.cli.progress import byte_progress
from dcpctl.cli.render import format_bytes, print_report, several_ranks_saved_said
from dcpctl.errors import InvalidOptionError
from dcpctl.ops.reshard.execution import (CODEC_NAMES, PER_RANK_OBJECT_CHOICES, Mesh,
                                          ReshardReport, parse_mesh, reshard_checkpoint)
from dcpctl.ops.reshard.planning import describe_ranks
from dcpctl.wording import counted


@click.command("reshard")
@checkpoint_argument()
@click.option("--ranks", "world_size", type=click.IntRange(min=1), default=None,
              help="World size of the job that will load the result (a 1-D FSDP2 layout).")
@click.option("--mesh", "mesh_text", metavar="DPxTP", default=None,
              help="Lay it out for a 2-D mesh of DP data-parallel by TP tensor-parallel ranks "
                   "(FSDP2 over tensor parallel, rank = dp * TP + tp), keeping the source's "
                   "tensor-parallel layout: TP must be the source's tensor-parallel size; only "
                   "the data-parallel size changes. Instead of --ranks.")
@output_option(required=True, help="Directory for the new checkpoint; must not exist or be "
                                   "empty, unless --overwrite.")
@click.option("--codec", "codec_name", type=click.Choice(CODEC_NAMES), default=None,
              help="Codec of the output items (default: the input's, so zstd stays zstd); "
                   "none stores them uncompressed, a compressed input decompressed.")
@click.option("--per-rank-objects", type=click.Choice(PER_RANK_OBJECT_CHOICES), default="keep",
              show_default=True,
              help="What to do with objects each rank saved for itself (torchtitan's "
                   "dataloader.dp_rank_<r>) when the new world size does not match them: keep "
                   "them (rank r's on rank r's file, those past the new world size on rank "
                   "0's), drop them, or refuse to reshard.")
@threads_option
@workers_option
@overwrite_option
@json_option
def reshard_command(checkpoint: str, world_size: int | None, mesh_text: str | None, output: str,
                    codec_name: str | None, per_rank_objects: str, threads: int | None,
                    workers: int | None, overwrite: bool, as_json: bool) -> None:
    """Write CHECKPOINT laid out for a job of --ranks ranks (or a --mesh), one file per rank.

    The output is what a real N-rank FSDP2 save (`fully_shard`, `Shard(0)` on a 1-D mesh)
    writes. Every sharded tensor is split along dim 0 as FSDP2 splits it: ceil(rows / N) rows
    per rank, the last ranks smaller or empty, like torch.chunk; rank r's chunks go to
    `__r_0.distcp`, so each rank of the next job reads only its own file. A tensor that was
    never sharded (in a save of several ranks, one chunk covering it: buffers, RNG states,
    counters; any 0-d tensor) is written whole and once, and so is every object, on the rank
    file torch's deduplication would pick (the rank with the least data planned at its turn).
    A save of one rank cannot tell its buffers from its parameters: every tensor of it is
    split. Objects a rank saved for itself (torchtitan's dataloader.dp_rank_<r>) stay on
    their rank's file; the report names the new ranks that have none (--per-rank-objects).
    With --ranks, a 2-D mesh source (FSDP + tensor parallel) becomes a 1-D FSDP2 layout: each
    tensor's tensor-parallel shards are joined and its rows split over the N ranks. With
    --mesh DPxTP, the output is what a save from a DP x TP mesh writes: each tensor keeps the
    tensor-parallel placement it was saved with (sharded on a dim, ColwiseParallel's 0 or
    RowwiseParallel's 1, or replicated), told from its chunks and the rank files they are in,
    and FSDP2 splits each tensor-parallel part over the DP ranks (torch's _StridedShard where
    both shard dim 0); the report counts the placements found. Any DCP input works: FSDP2 or
    2-D mesh shards, zstd or plain, TORCH_SAVE or SAFETENSORS serialization.

    Output chunks are assembled from the byte ranges of the input chunks they overlap, a
    large chunk in blocks of rows, so memory stays near a few 4 MiB blocks per thread; zstd
    inputs are decoded once, a chunk of up to 4 MiB in memory and a larger one
    into a temporary spool file beside the output. The output is written into a hidden sibling
    directory and renamed into place, with SHA256SUMS.

    \b
    Examples:
      dcpctl reshard ckpt/ --ranks 16 -o ckpt-16/
      dcpctl reshard ckpt/ --ranks 1 -o consolidated/      # one file
      dcpctl reshard ckpt/ --ranks 8 -o out/ --codec zstd --json
      dcpctl reshard fsdp2x_tp2/ --mesh 4x2 -o out/      # 8 ranks, same TP layout
    """
    if (world_size is None) == (mesh_text is None):
        raise InvalidOptionError("give the new layout as --ranks N or as --mesh DPxTP (one of "
                                 "the two)")
    mesh = parse_mesh(mesh_text) if mesh_text is not None else Mesh(world_size)
    with byte_progress("reshard") as progress:
        report = reshard_checkpoint(checkpoint, mesh.ranks, output, codec_name, threads=threads,
                                    overwrite=overwrite, on_progress=progress,
                                    workers=workers_for(workers, checkpoint, output),
                                    per_rank_objects=per_rank_objects,
                                    tensor_parallel=mesh.tensor_parallel)
    print_report(report, as_json, render_reshard_report)


def render_reshard_report(report: ReshardReport) -> list[str]:
    """What a reshard did, for people."""
    rate = report.logical_bytes / report.seconds if report.seconds else 0
    lines = [f"{report.source} -> {report.output}: {counted(report.tensors, 'tensor')} in "
             f"{counted(report.chunks_written, 'chunk')} and {counted(report.objects, 'object')}"
             f" over {counted(report.world_size, 'rank')} ({counted(report.files, 'file')}), codec "
             f"{report.codec}"
             + (f", mesh {report.mesh}" if report.mesh else ""),
             f"wrote {format_bytes(report.stored_bytes_after)} in {report.seconds:.1f} s "
             f"({format_bytes(int(rate))}/s of tensor data)"]
    if report.placements:
        lines.append("tensor-parallel placements kept: " + ", ".join(
            f"{placement} {count}" for placement, count in report.placements.items()))
    per_rank = report.per_rank_objects
    if per_rank is not None and (per_rank.ranks_without or per_rank.dropped
                                 or per_rank.ranks[-1] >= report.world_size):
        what = "dropped" if per_rank.dropped else "kept"
        without = (f"; new ranks {describe_ranks(per_rank.ranks_without)} have none of "
                   "their own (a trainer that loads its own, as torchtitan's dataloader does, "
                   "must skip them on resume)" if per_rank.ranks_without else "")
        lines.append(f"per-rank objects ({per_rank.fqns[0]}, ...) "
                     f"of ranks {describe_ranks(per_rank.ranks)}: {what}{without}")
    return lines + several_ranks_saved_said(report.items_several_ranks_saved, report.source)

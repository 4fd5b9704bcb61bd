"""`dcpctl inspect`: what a checkpoint holds, as a table or JSON."""

from __future__ import annotations

from functools import lru_cache

import click

from dcpctl.cli.options import checkpoint_argument, json_option
from dcpctl.cli.process import end_process_without_teardown
from dcpctl.cli.render import format_bytes, format_table, print_report, render_problem
from dcpctl.cycle_collector import paused_cycle_collector
from dcpctl.ops.inspection.report import InspectReport, inspect_checkpoint
from dcpctl.wording import counted


@click.command("inspect")
@checkpoint_argument()
@json_option
@click.option("--filter", "fqn_glob", metavar="GLOB",
              help="Only tensors and objects whose fqn matches GLOB, e.g. 'model.*.weight' "
                   "(with --by-file, the files holding them, those items alone counted).")
@click.option("--by-file", is_flag=True, help="List the data files instead of the tensors.")
@click.pass_context
def inspect_command(context: click.Context, checkpoint: str, as_json: bool,
                    fqn_glob: str | None, by_file: bool) -> None:
    """Show what CHECKPOINT holds, reading only `.metadata` and file sizes.

    The summary gives the DCP version, the layout (whose state dict: torchtitan,
    torchtune, {"model", "optim"}, an accelerate part, Megatron-Core torch_dist, Lightning
    or a plain one; where the model weights are and which trainer state lies beside them, which is
    what `convert --to safetensors` leaves out; FSDP2/DTensor or FSDP1/ShardedTensor chunks,
    where a tensor with fewer rows than ranks tells), how many tensors and objects, their
    logical size (what the tensors occupy in memory) and stored size (bytes in the data
    files), sizes by dtype and by top-level key (`model`, `optim`...), the data files and
    the compression in use. Then one row per tensor: fqn, dtype, shape, number of stored
    chunks, logical and stored bytes.

    A data file that is missing or ends before the items the metadata places in it is listed
    below the report, which is shown all the same, and inspect exits 1 (`problems` in
    --json); `dcpctl verify` checks every byte.

    \b
    Examples:
      dcpctl inspect ckpt/
      dcpctl inspect ckpt/ --filter 'model.layers.0.*'
      dcpctl inspect ckpt/ --by-file
      dcpctl inspect ckpt/ --json | jq '.tensors[] | select(.dtype == "bfloat16") | .fqn'
    """
    # The report is millions of small objects: the cycle collector is held off until they are
    # freed (collecting them would find no cycle), and the dcpctl process ends before freeing
    # them at all.
    with paused_cycle_collector():
        report = inspect_checkpoint(checkpoint, fqn_glob)
        print_report(report, as_json, lambda report: [
            *render_summary(report), "",
            *(render_files(report) if by_file else render_tensors(report)),
            *(line for problem in report.problems for line in ("", *render_problem(problem)))])
        exit_code = 1 if report.problems else 0
        end_process_without_teardown(context, exit_code)
        del report
    context.exit(exit_code)


def _ratio(numerator: int, denominator: int) -> str:
    return f"{numerator / denominator:.3f}" if denominator else "-"


def render_summary(report: InspectReport) -> list[str]:
    """The key facts of a checkpoint, one per line."""
    def sizes(logical: dict[str, int], stored: dict[str, int] | None = None) -> str:
        parts = []
        for key, size in sorted(logical.items(), key=lambda kv: -kv[1]):
            stored_part = f" (stored {format_bytes(stored[key])})" if stored else ""
            parts.append(f"{key} {format_bytes(size)}{stored_part}")
        return ", ".join(parts) or "-"

    file_bytes = sum(f.size_bytes or 0 for f in report.files)
    lines = [
        ("checkpoint", report.path),
        ("dcp version", report.version or "unknown"),
        ("layout", report.layout),
        ("filter", report.filter),
        ("tensors", f"{len(report.tensors)}"),
        ("objects", f"{len(report.objects)}"),
        ("logical", format_bytes(report.nbytes)),
        ("stored", f"{format_bytes(report.stored_bytes)} "
                   f"(stored/logical {_ratio(report.stored_bytes, report.nbytes)})"),
        ("by dtype", sizes(report.nbytes_by_dtype)),
        ("by key", sizes(report.nbytes_by_top_level_key, report.stored_bytes_by_top_level_key)),
        ("compression", ", ".join(f"{codec} ({counted(count, 'item')})"
                                  for codec, count in report.compression.items()) or "-"),
        ("files", f"{len(report.files)}, {format_bytes(file_bytes)}"),
        ("damaged", f"{counted(len(report.problems), 'problem')} of its data files, listed "
                    "below" if report.problems else None),
    ]
    width = max(len(label) for label, _ in lines)
    return [f"{label.ljust(width)}  {value}" for label, value in lines if value is not None]


def render_tensors(report: InspectReport) -> list[str]:
    """One row per tensor, then one per object."""
    # Shapes and sizes repeat from tensor to tensor: each distinct one is formatted once.
    shape_text = lru_cache(maxsize=None)(_shape_text)
    size_text = lru_cache(maxsize=None)(format_bytes)
    rows = [(t.fqn, t.dtype.name, shape_text(t.shape), len(t.chunks), size_text(t.nbytes),
             size_text(t.stored_bytes)) for t in report.tensors]
    rows += [(o.fqn, "object", "-", 1, "-", size_text(o.storage.length if o.storage else 0))
             for o in report.objects]
    return format_table(("FQN", "DTYPE", "SHAPE", "CHUNKS", "LOGICAL", "STORED"), rows,
                        right_aligned=(3, 4, 5))


def _shape_text(shape: tuple[int, ...]) -> str:
    return "x".join(map(str, shape)) or "scalar"


def render_files(report: InspectReport) -> list[str]:
    """One row per data file."""
    rows = [(f.name, format_bytes(f.size_bytes), f.serialization, f.item_count,
             ", ".join(f"{codec} {count}"
                       for codec, count in report.codecs_by_file[f.name].items()))
            for f in report.files]
    return format_table(("FILE", "SIZE", "SERIALIZATION", "ITEMS", "COMPRESSION"), rows,
                        right_aligned=(1, 3))

"""`dcpctl convert`: DCP to safetensors or torch.save, and safetensors or torch.save to DCP."""

from __future__ import annotations

import re

import click
from click.core import ParameterSource

from dcpctl.cli.options import (checkpoint_argument, json_option, output_option, overwrite_option,
                                threads_option, workers_for, workers_option)
from dcpctl.cli.progress import byte_progress
from dcpctl.cli.render import format_bytes, format_table, print_report, several_ranks_saved_said
from dcpctl.ops.convert.report import ConvertReport
from dcpctl.ops.convert.targets import (CAST_DTYPE_NAMES, DEFAULT_MAX_SHARD_BYTES,
                                        TARGET_OPTIONS, Rename, convert_checkpoint)
from dcpctl.wording import counted

_SIZE = re.compile(r"^\s*(\d+(?:\.\d*)?)\s*([kmgt]i?b|b)?\s*$", re.IGNORECASE)
_UNIT_BYTES = {"b": 1, **{f"{unit}b": 1000 ** power for power, unit in enumerate("kmgt", 1)},
               **{f"{unit}ib": 1024 ** power for power, unit in enumerate("kmgt", 1)}}


def parse_byte_size(text: str) -> int:
    """`5GB` (10^9), `2GiB` (2^30), `500MB`, `1.5GB`, or a plain number of bytes."""
    match = _SIZE.match(text)
    if not match:
        raise ValueError(f"{text!r} is not a size such as 500MB, 5GB or 2GiB")
    number, unit = match.groups()
    return int(float(number) * _UNIT_BYTES[(unit or "b").lower()])


class ByteSize(click.ParamType):
    """A size in bytes written as 5GB, 2GiB, 500MB..."""

    name = "SIZE"

    def convert(self, value, parameter, context):
        if isinstance(value, int):
            return value
        try:
            size = parse_byte_size(value)
        except ValueError as error:
            self.fail(str(error), parameter, context)
        if size < 1:
            self.fail(f"{value!r} is not a positive size", parameter, context)
        return size


class RenameRule(click.ParamType):
    """REGEX=REPLACEMENT."""

    name = "REGEX=REPLACEMENT"

    def convert(self, value, parameter, context):
        if isinstance(value, Rename):
            return value
        try:
            return Rename.parse(value)
        except ValueError as error:
            self.fail(str(error), parameter, context)


@click.command("convert")
@checkpoint_argument("source")
@click.option("--to", "target", type=click.Choice(sorted(TARGET_OPTIONS)), required=True,
              help="The output format.")
@output_option(required=True, help="Output directory (safetensors, dcp) or file (torch). It "
                                   "must not exist or be empty, unless --overwrite.")
@click.option("--max-shard-size", "max_shard_bytes", type=ByteSize(),
              default=DEFAULT_MAX_SHARD_BYTES,
              help="safetensors: most tensor bytes per file (5GB is 5*10^9 bytes, 5GiB 5*2^30); "
                   "a tensor larger than this gets a file of its own.  [default: 5GB]")
@click.option("--dtype", type=click.Choice(CAST_DTYPE_NAMES), default=None,
              help="safetensors, torch: cast floating-point tensors to this dtype (integer and "
                   "bool tensors keep theirs).")
@click.option("--include", multiple=True, metavar="GLOB",
              help="safetensors, torch: take the entries whose checkpoint fqn matches GLOB "
                   "(repeatable). Default for safetensors: the model's weights, every tensor "
                   "but trainer state (entries under optimizer., optim., optimizer_0., "
                   "lr_scheduler, dataloader., train_state, rng_state, ...: the model at the "
                   "top level, as torchtitan saves it, or under model. or state_dict.); for "
                   "torch: everything.")
@click.option("--exclude", multiple=True, metavar="GLOB",
              help="safetensors, torch: leave out entries whose fqn matches GLOB (repeatable).")
@click.option("--strip-prefix", default=None,
              help="safetensors: remove this prefix from names so that they match the module's "
                   "own state_dict(). Default: `model.` or `state_dict.` when every name taken "
                   "starts with it (a model saved under that key), else nothing; '' keeps "
                   "names as they are. One that begins no name is refused.")
@click.option("--rename", "renames", multiple=True, type=RenameRule(),
              help="safetensors: rewrite names with a regex, after --strip-prefix, e.g. "
                   "'^layers\\.(\\d+)\\.=model.layers.\\1.' (repeatable, applied in order; "
                   "split at the last `=`); one that matches no name is refused.")
@click.option("--ranks", type=click.IntRange(min=1), default=1, show_default=True,
              help="dcp: lay the checkpoint out for this many ranks, as an FSDP2 save of that "
                   "world size would (dim 0 split like torch.chunk), one file per rank.")
@click.option("--prefix", default="",
              help="dcp: nest every key under these keys, joined by dots, e.g. `model.`.")
@threads_option
@workers_option
@overwrite_option
@json_option
@click.pass_context
def convert_command(context: click.Context, source: str, target: str, output: str,
                    as_json: bool, **options) -> None:
    """Convert SOURCE between DCP and Hugging Face safetensors or torch.save.

    \b
    --to safetensors: SOURCE is a DCP checkpoint; OUTPUT gets model.safetensors, or
      shards model-00001-of-0000N.safetensors and model.safetensors.index.json in the
      layout transformers and huggingface_hub load. Full (unsharded) tensors, each
      assembled from its chunks and written at its place: memory holds a few chunks
      (a whole tensor for layouts not split by rows), never the checkpoint.
      Non-tensor entries are left out (safetensors holds tensors only).
    --to torch: SOURCE is a DCP checkpoint; OUTPUT is one torch.save file nested by the
      original keys, as torch's dcp_to_torch_save writes it, streamed in one pass in
      bounded memory. What it costs: one file that plain torch.load reads whole into
      memory (torch.load(..., mmap=True) does not); and importing torch, a few seconds,
      where the checkpoint holds objects beyond plain Python data (those are unpickled
      with weights_only=True) or --dtype casts.
    --to dcp: SOURCE is a .safetensors file, a directory with model.safetensors.index.json
      (or model.safetensors), or a torch.save file (its structure loaded with
      weights_only=True only, tensor bytes read a chunk at a time). OUTPUT is a DCP
      checkpoint that torch.distributed.checkpoint.load reads, laid out for --ranks ranks.

    The output is written under a temporary name beside OUTPUT and renamed at the end:
    a failed or killed run leaves no partial output. With --workers (or under torchrun),
    --to safetensors and torch share out the tensors (each process writes its tensors at
    their places in the files, so the output must be local or on a shared file system);
    --to dcp shares out the rank files.

    \b
    Examples:
      dcpctl convert ckpt/ --to safetensors -o hf/
      dcpctl convert ckpt/ --to safetensors -o hf/ --dtype bfloat16 --max-shard-size 2GB
      dcpctl convert ckpt/ --to safetensors -o hf/ --include 'model.*' --exclude '*.rope.*'
      dcpctl convert ckpt/ --to torch -o model.pt
      dcpctl convert hf/ --to dcp -o ckpt/ --ranks 8 --prefix model.
    """
    _refuse_foreign_options(context, target)
    options["workers"] = workers_for(options["workers"], source, output)
    with byte_progress("convert") as progress:
        report = convert_checkpoint(source, target, output, on_progress=progress, **options)
    print_report(report, as_json, render_convert_report)


def _refuse_foreign_options(context: click.Context, target: str) -> None:
    for name in set().union(*TARGET_OPTIONS.values()) - TARGET_OPTIONS[target]:
        if context.get_parameter_source(name) != ParameterSource.DEFAULT:
            option = next(p.opts[0] for p in context.command.params if p.name == name)
            raise click.UsageError(f"{option} does not apply to --to {target}", context)


def render_convert_report(report: ConvertReport) -> list[str]:
    """What a convert did, for people."""
    objects = f" and {report.objects} objects" if report.objects else ""
    layout = f" for {counted(report.ranks, 'rank')}" if report.ranks else ""
    workers = f" ({report.workers} workers)" if report.workers > 1 else ""
    lines = [f"{report.source}: wrote {counted(report.tensors, 'tensor')} "
             f"({format_bytes(report.tensor_bytes)}){objects} as {report.target_format}"
             f"{layout} to {report.output} in {report.seconds:.1f} s{workers}"]
    if report.cast_to:
        lines.append(f"floating-point tensors cast to {report.cast_to}")
    if report.stripped_prefix:
        lines.append(f"{report.stripped_prefix!r} taken off the names that start with it "
                     "(--strip-prefix '' keeps it)")
    left_out = []
    if report.tensors_left_out:
        left_out.append(f"{counted(report.tensors_left_out, 'tensor')} not selected")
    if report.objects_left_out:
        why = " (safetensors holds tensors only)" if report.target_format == "safetensors" \
            else " not selected"
        entries = counted(report.objects_left_out, "non-tensor entry", "non-tensor entries")
        left_out.append(entries + why)
    if left_out:
        lines.append("left out: " + "; ".join(left_out))
    lines += several_ranks_saved_said(report.items_several_ranks_saved, report.source)
    rows = [(written.name, written.tensors, format_bytes(written.size_bytes))
            for written in report.files]
    return lines + ["", *format_table(("file", "tensors", "size"), rows, right_aligned=(1, 2))]

"""`dcpctl ls`: the checkpoints of a training run directory, as a table or JSON."""

from __future__ import annotations

import click

from dcpctl.cli.options import checkpoint_argument, json_option
from dcpctl.cli.render import format_age, format_bytes, format_table, print_report
from dcpctl.ops.runs.layouts import MEGATRON_TRACKER
from dcpctl.ops.runs.listing import ListReport, list_run_directory
from dcpctl.ops.runs.scan import CheckpointEntry, IgnoredEntry, no_checkpoints_said

CHECKPOINT_HEADERS = ("STEP", "CHECKPOINT", "STATE", "SIZE", "AGE")


@click.command("ls")
@checkpoint_argument("run_dir")
@json_option
def ls_command(run_dir: str, as_json: bool) -> None:
    """List the checkpoint directories directly under RUN_DIR, sorted by step.

    A checkpoint directory is named by a word trainers name checkpoints by (step, steps,
    global_step, checkpoint, checkpoints, ckpt, iter, iteration, epoch, dist_epoch; any case),
    an optional `-` or `_`, then the step and nothing after it, or by the step alone:
    step-1000, step_2000, checkpoint-3000, global_step4000, iter_0000100, 5000; or as
    Lightning's ModelCheckpoint names them by default: epoch=2-step=300.ckpt, step=300.ckpt.
    Other names (llama3, ckpt_v2, old-step-3-bak, step-3.tmp, epoch=2-step=300-v1.ckpt) are
    not checkpoints. It is
    complete when it holds `.metadata` (torch writes it last) and incomplete when it holds
    only data files, `.metadata.tmp`, or nothing yet: a save in progress or one that died.

    Trainers' layouts: torchtitan's step-N, torchtune's dist_epoch_N and Megatron's
    iter_0000100 are one DCP directory each (Megatron's, with common.pt, is complete once
    metadata.json, written after `.metadata`, is there; Lightning's, with meta.pt written after
    `.metadata`, once that is there). accelerate's checkpoint_N holds several
    (pytorch_model_fsdp_0/, optimizer_0/: its parts) beside its RNG and scheduler files: it
    is listed as one checkpoint, complete when every part holds `.metadata` and
    random_states_0.pkl is there; one holding fewer custom_checkpoint_<i>.pkl (written last)
    than the one before it is unsure: not complete, and never pruned. Give accelerate's
    `checkpoints/` directory,
    not one checkpoint_N. A directory named like a step that holds other DCP directories
    (checkpoint-1/step-100: a run of its own) is no checkpoint: it is ignored. Megatron's
    latest_checkpointed_iteration.txt is shown as the tracked step, and a symlink in RUN_DIR
    that points to a checkpoint (latest -> step-200) and the transformers Trainer's
    best_model_checkpoint below the table.

    A complete checkpoint is also checked as `verify --quick` checks it, short of hashing (as
    prune does): one that fails is `damaged`, one whose `.metadata` dcpctl cannot read
    `unreadable` (torch may read it all the same; prune never deletes it), its problem on a
    line below the table; one another dcpctl is changing (an in-place compress) is `in use`,
    not checked. `--json` gives each its `state` as the table does.

    One row per checkpoint: step, name, state, size, compression (read from `.metadata`),
    age (time since anything inside it last changed; `?` where the store does not say when
    its objects were written) and whether it holds SHA256SUMS. Entries
    named like a checkpoint that are symlinks, files or not DCP directories are listed after
    the table as ignored; symlinks are never followed.

    \b
    Examples:
      dcpctl ls runs/exp1/
      dcpctl ls runs/exp1/ --json | jq -r '.checkpoints[] | select(.state == "complete") | .path'
    """
    print_report(list_run_directory(run_dir), as_json, render_listing)


def checkpoint_cells(entry: CheckpointEntry, state: str) -> list[str]:
    """The cells of CHECKPOINT_HEADERS for one checkpoint in its state (quick_check.STATES),
    shared by ls and prune tables."""
    name = f"{entry.name} ({len(entry.parts)} parts)" if entry.parts else entry.name
    return [str(entry.step), name, state, format_bytes(entry.size_bytes),
            format_age(entry.age_seconds)]


def render_ignored(ignored: list[IgnoredEntry]) -> list[str]:
    """One line per entry named like a checkpoint that was left alone."""
    return [f"ignored {entry.name}: {entry.reason}" for entry in ignored]


def render_listing(report: ListReport) -> list[str]:
    """The ls table, then damaged checkpoints' problems and the ignored look-alikes."""
    if not report.checkpoints:
        lines = [no_checkpoints_said(report.scan.path, report.scan.runs_below,
                                     report.scan.named_otherwise)]
    else:
        rows = [[*checkpoint_cells(listed.entry, listed.state),
                 "?" if listed.compression is None and listed.entry.complete
                 else ", ".join(listed.compression or ()) or "-",
                 "yes" if listed.entry.has_sha256sums else "no"]
                for listed in report.checkpoints]
        lines = format_table((*CHECKPOINT_HEADERS, "COMPRESSION", "SHA256SUMS"), rows,
                             right_aligned=(0, 3, 4))
        lines += [f"problem: {listed.problem}" for listed in report.checkpoints if listed.problem]
        lines += [f"in use: {listed.in_use}" for listed in report.checkpoints if listed.in_use]
    if report.scan.tracked_step is not None:
        lines.append(f"tracked step: {report.scan.tracked_step} (named by {MEGATRON_TRACKER}; "
                     "prune keeps it)")
    lines += [f"symlink {link} -> {listed.entry.name} (prune keeps it)"
              for listed in report.checkpoints for link in listed.entry.linked_by]
    lines += [f"unsure: {listed.entry.name}: {listed.entry.doubt}"
              for listed in report.checkpoints if listed.entry.doubt]
    lines += [f"best: {listed.entry.name} (the Trainer's best_model_checkpoint; prune keeps it)"
              for listed in report.checkpoints if listed.entry.trainers_best]
    return lines + render_ignored(report.scan.ignored)

"""`dcpctl prune`: delete the checkpoints of a run directory that no retention rule keeps."""

from __future__ import annotations

import re

import click

from dcpctl.cli.ls import CHECKPOINT_HEADERS, checkpoint_cells, render_ignored
from dcpctl.cli.options import checkpoint_argument, dry_run_option, json_option
from dcpctl.cli.render import format_bytes, format_table, print_report
from dcpctl.errors import TRY_AGAIN_EXIT_CODE, PartialFailureError
from dcpctl.ops.runs.prune import (DELETED, FAILED, GONE, PruneReport, RetentionRules,
                                   prune_run_directory)
from dcpctl.ops.runs.scan import no_checkpoints_said
from dcpctl.wording import counted

_DURATION = re.compile(r"([0-9]+)([smhdw])")
_UNIT_SECONDS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}


def parse_duration(text: str) -> int:
    """Seconds in a duration such as `30m`, `12h`, `7d` or `2w`; ValueError otherwise."""
    match = _DURATION.fullmatch(text.strip())
    if match is None or int(match.group(1)) == 0:
        raise ValueError(f"{text!r} is not a duration: write a positive whole number and a "
                         "unit, s, m, h, d or w (30m, 12h, 7d, 2w)")
    return int(match.group(1)) * _UNIT_SECONDS[match.group(2)]


class DurationType(click.ParamType):
    """A click parameter holding a duration, given in seconds to the command."""

    name = "duration"

    def convert(self, value, parameter, context):
        """Seconds, or a usage error (exit 2) naming the accepted forms."""
        try:
            return parse_duration(value)
        except ValueError as error:
            self.fail(str(error), parameter, context)


@click.command("prune")
@checkpoint_argument("run_dir")
@click.option("--keep-last", metavar="N", type=click.IntRange(min=1), required=True,
              help="Keep the N complete checkpoints with the highest steps.")
@click.option("--keep-every", "keep_every_steps", metavar="STEPS", type=click.IntRange(min=1),
              help="Also keep complete checkpoints whose step is a multiple of STEPS.")
@click.option("--keep", "keep_globs", metavar="GLOB", multiple=True,
              help="Also keep checkpoints whose directory name matches GLOB, complete or not "
                   "(repeatable), e.g. 'step-*0000'.")
@click.option("--older-than", metavar="DURATION", type=DurationType(),
              help="Also keep complete checkpoints that changed within DURATION: only older "
                   "ones are deleted.")
@click.option("--incomplete-older-than", metavar="DURATION", type=DurationType(),
              help="Delete incomplete checkpoints (a save unfinished: no .metadata, or not "
                   "the files its trainer writes after it) unchanged for longer than DURATION; "
                   "never one `ls` is unsure of. Without it incomplete ones are never deleted.")
@dry_run_option
@json_option
def prune_command(run_dir: str, keep_last: int, keep_every_steps: int | None,
                  keep_globs: tuple[str, ...], older_than: int | None,
                  incomplete_older_than: int | None, dry_run: bool, as_json: bool) -> None:
    """Delete the checkpoints under RUN_DIR that no rule keeps (see `dcpctl ls` for which
    directories are checkpoints, and how age is measured).

    A complete checkpoint is kept if ANY rule keeps it: it is the newest complete one
    (always, whatever the options), the one Megatron's latest_checkpointed_iteration.txt
    names or a symlink in RUN_DIR points to (always, complete or not: the trainer resumes
    from it; latest -> step-200) or a symlink inside another checkpoint leads into, the
    transformers Trainer's best_model_checkpoint (always), one of the last N (--keep-last),
    its step is a multiple of --keep-every, its name matches a --keep GLOB, or it changed within
    --older-than. Every other complete checkpoint is deleted. So --older-than only ever
    narrows the deletions: with it, a checkpoint is deleted only when it is older than
    DURATION and no other rule keeps it.

    An incomplete checkpoint never counts toward --keep-last. It is deleted only with
    --incomplete-older-than, when nothing in it changed for longer than DURATION (a save
    in progress keeps writing, so it stays young), and when no --keep GLOB matches it. A
    checkpoint with `.metadata` that `verify --quick` calls damaged, or whose `.metadata`
    dcpctl cannot read, never takes the place of a sound one as the newest or among the last
    N. One damaged by a data file missing or short (as in one being copied in) counts as
    incomplete; one damaged otherwise, or unreadable (torch may read it all the same), is
    never deleted.

    Never touched: symlinks (not followed, not deleted, nor their targets), files, and
    anything not named and laid out like a checkpoint. A directory is deleted `.metadata`
    first (every part's, for accelerate's checkpoint_N: always whole, never one part), so
    one whose deletion fails part-way is left looking incomplete, never complete. A RUN_DIR
    that numbers some complete checkpoints by epoch (epoch_N, dist_epoch_N) and others by
    step is refused: the two have no common order.

    DURATION is a whole number and a unit: s, m, h, d or w (30m, 12h, 7d, 2w).

    A real run locks RUN_DIR itself (flock; no file is created, and the lock dies with its
    process). A second prune of the same RUN_DIR does not wait: it fails at once with exit
    status 75 and changes nothing. A checkpoint another dcpctl command is using is not
    deleted. Deletions go through directory handles opened once, so a checkpoint swapped
    for a symlink mid-run deletes nothing outside RUN_DIR. --dry-run takes no lock and
    prints the same plan.

    Exit status: 0 done (or nothing to delete); 1 when RUN_DIR cannot be read, or some
    deletions failed (the others are still done, and the report says which were deleted and
    which were not); 2 for usage errors; 75 when another prune holds the lock, or every
    deletion that failed was of a checkpoint another dcpctl was using (try again later).

    \b
    Examples:
      dcpctl prune runs/exp1/ --keep-last 3 --dry-run
      dcpctl prune runs/exp1/ --keep-last 3 --keep-every 10000 --incomplete-older-than 1d
      dcpctl prune runs/exp1/ --keep-last 2 --keep 'step-*5000' --older-than 7d --json
    """
    rules = RetentionRules(keep_last, keep_every_steps, keep_globs, older_than,
                           incomplete_older_than)
    report = prune_run_directory(run_dir, rules, dry_run)
    print_report(report, as_json, render_prune)
    failed = report.with_status(FAILED)
    if failed:
        error = PartialFailureError(f"{len(failed)} of {len(report.to_delete)} checkpoint "
                                    f"deletions failed; first, {failed[0].checkpoint.name}: "
                                    f"{failed[0].error}", path=run_dir)
        if all(decision.try_again for decision in failed):  # each in use by another dcpctl
            error.exit_code = TRY_AGAIN_EXIT_CODE
        raise error


def render_prune(report: PruneReport) -> list[str]:
    """One row per checkpoint with what became of it and why, then a summary line."""
    rows = [[*checkpoint_cells(decision.checkpoint, decision.state),
             decision.status,
             "; ".join(decision.reasons + ([decision.error] if decision.error else []))]
            for decision in report.decisions]
    lines = (format_table((*CHECKPOINT_HEADERS, "ACTION", "WHY"), rows, right_aligned=(0, 3, 4))
             if rows else [no_checkpoints_said(report.run_dir, report.runs_below,
                                               report.named_otherwise)])
    lines += render_ignored(report.ignored)
    planned = len(report.to_delete)
    if report.dry_run:
        lines.append(f"dry run: would delete {counted(planned, 'checkpoint')}, freeing "
                     f"{format_bytes(report.delete_bytes)}; nothing was changed")
    else:
        gone = len(report.with_status(GONE))
        lines.append(f"deleted {len(report.with_status(DELETED))} of "
                     f"{counted(planned, 'checkpoint')}, freed {format_bytes(report.freed_bytes)}"
                     + (f"; {gone} deleted meanwhile by another process" if gone else ""))
    return lines

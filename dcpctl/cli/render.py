"""Turning reports into text for people and JSON for scripts: the one way commands print.

Names in a report come from a checkpoint or a directory that a stranger may have made, and a
name can hold terminal control sequences (`\\x1b[31m`...) or line breaks. A report for people
is rendered as lines, and every control character in each line is escaped, the line break
too: what a checkpoint holds can never rewrite the screen or pass for a line of the report.
JSON escapes them by its own rules.
"""

from __future__ import annotations

import json
import sys
from typing import TYPE_CHECKING, Any, Callable, Sequence

import click

from dcpctl.wording import counted, listed

if TYPE_CHECKING:
    from dcpctl.ops.verify.verifier import Problem

_UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")
_FQNS_SHOWN = 3  # of a problem's
# C0 and C1 control characters and DEL, each shown as \\xNN; the lone surrogates that stand for
# undecodable bytes in file names as the byte, \\xNN; any other lone surrogate (a pickled name
# can hold one; UTF-8 cannot write it), the line and paragraph separators that Python's
# splitlines() breaks at, and the bidirectional controls that reorder what a terminal shows,
# as \\uNNNN.
_ESCAPES = {code: f"\\x{code:02x}" for code in (*range(0x20), *range(0x7F, 0xA0))}
_ESCAPES.update({code: f"\\u{code:04x}" for code in (
    *range(0xD800, 0xE000), 0x2028, 0x2029, *range(0x202A, 0x202F), *range(0x2066, 0x206A))})
_ESCAPES.update({code: f"\\x{code - 0xDC00:02x}" for code in range(0xDC80, 0xDD00)})
_ESCAPES_KEEPING_LINES = {code: text for code, text in _ESCAPES.items() if code != ord("\n")}


def escape_control_characters(text: str) -> str:
    """text with every control character written as an escape, `\\x1b` for ESC."""
    return text.translate(_ESCAPES)


def escaped_lines(lines: Sequence[str]) -> str:
    """The lines joined into one text, every control character in each escaped, a line break
    inside a line too."""
    text = "\n".join(lines)
    if text.count("\n") == max(len(lines) - 1, 0):  # no line holds a break: one pass
        return text.translate(_ESCAPES_KEEPING_LINES)
    return "\n".join(map(escape_control_characters, lines))


def format_bytes(size_bytes: int | None) -> str:
    """`1.5 GiB` style sizes; `-` for unknown."""
    if size_bytes is None:
        return "-"
    value = float(size_bytes)
    for unit in _UNITS:
        if abs(value) < 1024 or unit == _UNITS[-1]:
            return f"{int(value)} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def format_age(seconds: float | None) -> str:
    """`45s`, `90m`, `36h`, `9d`: whole units of the largest unit that fits twice, rounded
    down; `?` where the age is unknown."""
    if seconds is None:
        return "?"
    for unit, unit_seconds in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= 2 * unit_seconds:
            return f"{int(seconds // unit_seconds)}{unit}"
    return f"{int(seconds)}s"


def format_table(headers: Sequence[str], rows: Sequence[Sequence[Any]],
                 right_aligned: Sequence[int] = ()) -> list[str]:
    """The lines of a plain text table with columns padded to their widest cell, control
    characters in cells escaped first (so that columns stay aligned)."""
    columns = [[header, *_escaped_cells(list(map(str, column)))]
               for header, column in zip(headers, zip(*rows) if rows else [()] * len(headers))]
    widths = [max(map(len, column)) for column in columns]
    # One %-format pads a whole row (`%-12s` as ljust(12), `%12s` as rjust(12)): tables of a
    # hundred thousand rows are formatted in C, not cell by cell.
    row_format = "  ".join(f"%{'' if index in right_aligned else '-'}{width}s"
                           for index, width in enumerate(widths))
    return list(map(str.rstrip, map(row_format.__mod__, zip(*columns))))


def _escaped_cells(cells: list[str]) -> list[str]:
    """cells, control characters escaped in each: looked for in one pass over them all first,
    since there are nearly never any (a table can have a hundred thousand rows)."""
    joined = "".join(cells)
    if escape_control_characters(joined) == joined:
        return cells
    return list(map(escape_control_characters, cells))


# Keys in click's context object: whether the command was given --json, and whether it
# printed its report (a failure after the report, as prune's, is told on stderr alone).
JSON_ASKED = "json_asked"
REPORT_PRINTED = "report_printed"


def print_report(report: Any, as_json: bool,
                 render_lines: Callable[[Any], Sequence[str]]) -> None:
    """Print a command's report on stdout: one compact JSON document (the report's own
    `to_json_text()` where it writes one, else `to_json()`), or render_lines(report) for
    people, escaped."""
    context = click.get_current_context(silent=True)
    if context is not None:
        context.ensure_object(dict)[REPORT_PRINTED] = True
    if as_json:
        to_json_text = getattr(report, "to_json_text", None)
        # json.dumps encodes in C; json.dump to a stream takes the pure-Python path, 5x slower.
        text = to_json_text() if to_json_text is not None else json.dumps(
            report.to_json(), separators=(",", ":"), default=str)
    else:
        text = escaped_lines(render_lines(report))
    sys.stdout.write(text)
    sys.stdout.write("\n")
    sys.stdout.flush()


def print_failure(context: click.Context, message: str, exit_code: int) -> None:
    """A command's failure: `Error: message` on stderr and, where --json was asked and no
    report came out, `{"error": message, "exit_code": N}` on stdout, so that a script reading
    stdout gets one JSON document either way."""
    click.echo(f"Error: {escape_control_characters(message)}", err=True)
    asked = context.obj or {}
    if asked.get(JSON_ASKED) and not asked.get(REPORT_PRINTED):
        sys.stdout.write(json.dumps({"error": message, "exit_code": exit_code}) + "\n")
        sys.stdout.flush()


def several_ranks_saved_said(count: int, source: str) -> list[str]:
    """The line a command that wrote a new checkpoint from a use_collectives=False save says
    of the items several of its ranks saved (none where there are none)."""
    if not count:
        return []
    return [f"{counted(count, 'item')} several ranks saved (use_collectives=False): each "
            f"written from the lowest rank's copy; `dcpctl verify {source}` names any a rank "
            "saved with other values"]


def render_problem(problem: Problem) -> list[str]:
    """`rule  file  bytes a..b  fqns`, then the message, indented."""
    parts = [problem.rule]
    if problem.file:
        parts.append(problem.file)
    if problem.start is not None and problem.end is not None:
        parts.append(f"bytes {problem.start}..{problem.end}")
    if problem.fqns:
        parts.append(listed(problem.fqns, _FQNS_SHOWN))
    return ["  ".join(parts), "    " + problem.message]

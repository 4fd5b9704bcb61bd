"""Turning reports into text for people: sizes, tables, JSON."""

from __future__ import annotations

import json
from typing import Any, Sequence

import click

_UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")


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


def format_age(seconds: float) -> str:
    """`45s`, `90m`, `36h`, `9d`: whole units of the largest unit that fits twice, rounded down."""
    for unit, unit_seconds in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= 2 * unit_seconds:
            return f"{int(seconds // unit_seconds)}{unit}"
    return f"{int(seconds)}s"


def format_table(headers: Sequence[str], rows: Sequence[Sequence[Any]],
                 right_aligned: Sequence[int] = ()) -> str:
    """A plain text table with columns padded to their widest cell."""
    columns = [[header, *map(str, column)]
               for header, column in zip(headers, zip(*rows) if rows else [()] * len(headers))]
    widths = [max(map(len, column)) for column in columns]
    # One %-format pads a whole row (`%-12s` as ljust(12), `%12s` as rjust(12)): tables of a
    # hundred thousand rows are formatted in C, not cell by cell.
    row_format = "  ".join(f"%{'' if index in right_aligned else '-'}{width}s"
                           for index, width in enumerate(widths))
    return "\n".join(map(str.rstrip, map(row_format.__mod__, zip(*columns))))


def echo_json(payload: Any) -> None:
    """Print a JSON document on stdout, compact (pipe it to `jq` to read it)."""
    # json.dumps encodes in C; json.dump to a stream takes the pure-Python path, 5x slower.
    echo_json_text(json.dumps(payload, separators=(",", ":"), default=str))


def echo_json_text(text: str) -> None:
    """Print an already encoded JSON document on stdout."""
    stdout = click.get_text_stream("stdout")
    stdout.write(text)
    stdout.write("\n")
    stdout.flush()


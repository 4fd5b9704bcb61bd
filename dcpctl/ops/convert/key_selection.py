"""Which fqns a conversion takes (include/exclude globs) and what they are called in the output
(prefix stripping, regex renames), with clashes refused."""

from __future__ import annotations

import fnmatch
import re
from dataclasses import dataclass
from typing import Iterable

from dcpctl.errors import SelectionError

MODEL_PREFIX = "model."
OPTIMIZER_PREFIX = "optim"
_GLOBAL_FLAGS = re.compile(r"(?:\(\?[aiLmsux]+\))*")


@dataclass(frozen=True)
class Rename:
    """`--rename REGEX=REPLACEMENT`: re.sub over the whole name."""

    pattern: re.Pattern
    replacement: str

    @classmethod
    def parse(cls, text: str) -> "Rename":
        """Split at the last `=` (a regex may hold `=`, as in `(?=...)`; replacements rarely
        do); raise ValueError when there is none, the regex does not compile, or the
        replacement names a group the regex lacks (re.sub would fail only at the first name
        that matches)."""
        pattern, separator, replacement = text.rpartition("=")
        if not separator or not pattern:
            raise ValueError(f"{text!r} is not REGEX=REPLACEMENT")
        try:
            compiled = re.compile(pattern)
        except re.error as error:
            raise ValueError(f"{pattern!r} is not a regular expression ({error})") from None
        # A match of the same groups, all empty, expands the replacement as a match would. Global
        # flags must stay first, and a newline ends a trailing (?x) comment.
        flags = _GLOBAL_FLAGS.match(pattern).group()
        try:
            re.compile(f"{flags}(?:{pattern[len(flags):]}\n)|").match("").expand(replacement)
        except (re.error, IndexError) as error:
            raise ValueError(f"{replacement!r} is not a replacement for {pattern!r} "
                             f"({error})") from None
        return cls(compiled, replacement)


@dataclass(frozen=True)
class KeySelection:
    """Globs on the source fqns, then the renaming of those taken. include None: the default,
    `model.*` when the checkpoint has a model/optimizer split, else everything."""

    include: tuple[str, ...] | None = None
    exclude: tuple[str, ...] = ()
    strip_prefix: str = ""
    renames: tuple[Rename, ...] = ()


def default_include(fqns: Iterable[str]) -> tuple[str, ...]:
    """`model.*` when some fqns start with `model.` and others with `optim`, else `*`."""
    fqns = list(fqns)
    has_model = any(fqn.startswith(MODEL_PREFIX) for fqn in fqns)
    has_optimizer = any(fqn.startswith(OPTIMIZER_PREFIX) for fqn in fqns)
    return (f"{MODEL_PREFIX}*",) if has_model and has_optimizer else ("*",)


def is_selected(fqn: str, include: tuple[str, ...], exclude: tuple[str, ...]) -> bool:
    """Whether fqn matches an include glob and no exclude glob."""
    return (any(fnmatch.fnmatchcase(fqn, glob) for glob in include)
            and not any(fnmatch.fnmatchcase(fqn, glob) for glob in exclude))


def output_name(fqn: str, selection: KeySelection) -> str:
    """The fqn with the prefix stripped and every rename applied in order."""
    name = fqn.removeprefix(selection.strip_prefix) if selection.strip_prefix else fqn
    for rename in selection.renames:
        name = rename.pattern.sub(rename.replacement, name)
    return name


def select_and_rename(fqns: Iterable[str], selection: KeySelection) -> dict[str, str]:
    """Source fqn -> output name for every selected fqn, in source order; raises
    SelectionError when two fqns get one name, a name is empty, or nothing is selected."""
    fqns = list(fqns)
    include = selection.include if selection.include is not None else default_include(fqns)
    names: dict[str, str] = {}
    taken: dict[str, str] = {}
    for fqn in fqns:
        if not is_selected(fqn, include, selection.exclude):
            continue
        name = output_name(fqn, selection)
        if not name:
            raise SelectionError(f"{fqn!r} is renamed to an empty name")
        if name in taken:
            raise SelectionError(f"{taken[name]!r} and {fqn!r} are both renamed to {name!r}; "
                                 "change --strip-prefix or --rename, or --exclude one of them")
        taken[name] = fqn
        names[fqn] = name
    if not names:
        excluding = f" and no --exclude {list(selection.exclude)}" if selection.exclude else ""
        raise SelectionError(f"nothing to convert: none of the {len(fqns)} entries matches "
                             f"--include {list(include)}{excluding}")
    return names

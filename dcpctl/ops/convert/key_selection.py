"""Which fqns a conversion takes (include/exclude globs) and what they are called in the output
(prefix stripping, regex renames), with clashes refused. By default, to safetensors: the
model's weights named as the model's own `state_dict()` names them (state_dict_layouts.py).
"""

from __future__ import annotations

import fnmatch
import re
from dataclasses import dataclass
from typing import Iterable

from dcpctl.errors import SelectionError
from dcpctl.format.state_dict_layouts import is_trainer_state, model_prefix_of, root_of

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
    """Globs on the source fqns, then the renaming of those taken. include None: the model's
    weights (every entry but trainer state). strip_prefix None: `model.` when every name
    taken starts with it, else nothing."""

    include: tuple[str, ...] | None = None
    exclude: tuple[str, ...] = ()
    strip_prefix: str | None = ""
    renames: tuple[Rename, ...] = ()


def is_selected(fqn: str, include: tuple[str, ...] | None, exclude: tuple[str, ...]) -> bool:
    """Whether fqn matches an include glob (include None: is not trainer state) and no
    exclude glob."""
    included = (not is_trainer_state(fqn) if include is None
                else any(fnmatch.fnmatchcase(fqn, glob) for glob in include))
    return included and not any(fnmatch.fnmatchcase(fqn, glob) for glob in exclude)


def _output_name(fqn: str, strip_prefix: str, renames: tuple[Rename, ...],
                 applied: set[Rename]) -> str:
    """fqn as the output names it; each rename that matched is added to applied."""
    name = fqn.removeprefix(strip_prefix) if strip_prefix else fqn
    for rename in renames:
        name, count = rename.pattern.subn(rename.replacement, name)
        if count:
            applied.add(rename)
    return name


def prefix_to_strip(selected: list[str], selection: KeySelection) -> str:
    """What comes off the names of the selected fqns: --strip-prefix, or by default `model.`
    (and the like) where every one starts with it."""
    if selection.strip_prefix is None:
        return model_prefix_of(selected)
    return selection.strip_prefix


def select_and_rename(fqns: Iterable[str], selection: KeySelection,
                      objects: Iterable[str] | None = None) -> dict[str, str]:
    """Source fqn -> output name for every selected fqn, in source order, the prefix stripped
    and every rename applied in order; raises SelectionError when two fqns get one name, a
    name is empty, nothing is selected, or a --strip-prefix or --rename given changes no name.
    objects: where fqns are the tensors alone, the objects the output cannot hold (named where
    only they match)."""
    fqns = list(fqns)
    selected = [fqn for fqn in fqns if is_selected(fqn, selection.include, selection.exclude)]
    strip_prefix = prefix_to_strip(selected, selection)
    names: dict[str, str] = {}
    taken: dict[str, str] = {}
    applied: set[Rename] = set()
    for fqn in selected:
        name = _output_name(fqn, strip_prefix, selection.renames, applied)
        if not name and fqn:  # an entry named "" keeps its name, as torch's state dicts can
            raise SelectionError(f"{fqn!r} is renamed to an empty name")
        if strip_prefix and fqn.startswith(strip_prefix + "."):
            raise SelectionError(f"--strip-prefix {strip_prefix!r} leaves {fqn!r} a name that "
                                 f"starts with a dot; give the prefix with its dot, "
                                 f"{strip_prefix + '.'!r}")
        if name in taken:
            raise SelectionError(f"{taken[name]!r} and {fqn!r} are both renamed to {name!r}; "
                                 "change --strip-prefix or --rename, or --exclude one of them")
        taken[name] = fqn
        names[fqn] = name
    if not names:
        raise SelectionError(_nothing_selected(fqns, selection, objects))
    if strip_prefix and not any(fqn.startswith(strip_prefix) for fqn in selected):
        raise SelectionError(  # given, as the default strips only where every name has it
            f"--strip-prefix {strip_prefix!r} begins none of the {len(names)} names taken "
            f"(such as {selected[0]!r}); leave it out, or give a prefix they begin with")
    for rename in selection.renames:
        if rename not in applied:  # a name mistyped, or the prefix stripped first
            stripped = f", once --strip-prefix {strip_prefix!r} is off" if strip_prefix else ""
            raise SelectionError(
                f"--rename {rename.pattern.pattern}={rename.replacement} matches none of the "
                f"{len(names)} names taken (such as {selected[0].removeprefix(strip_prefix)!r}"
                f"{stripped}); leave it out, or match those names")
    return names


def _nothing_selected(fqns: list[str], selection: KeySelection,
                      objects: Iterable[str] | None) -> str:
    entries = "entries" if objects is None else "tensors"
    included = [fqn for fqn in fqns if is_selected(fqn, selection.include, ())]
    if included:  # --exclude took them all
        what = (f"{entries} matching --include" if selection.include is not None
                else "model weights")
        return (f"nothing to convert: --exclude {list(selection.exclude)} leaves none of the "
                f"{len(included)} {what} (of {len(fqns)} {entries})")
    if selection.include is not None:
        matching_objects = [fqn for fqn in objects or ()
                            if is_selected(fqn, selection.include, selection.exclude)]
        do = "entry does" if len(matching_objects) == 1 else "entries do"
        objects_said = (f"; {len(matching_objects)} non-tensor {do} (such as "
                        f"{matching_objects[0]!r}), which the output cannot hold"
                        if matching_objects else "")
        return (f"nothing to convert: none of the {len(fqns)} {entries} matches --include "
                f"{list(selection.include)}{objects_said}")
    roots = sorted({root_of(fqn) for fqn in fqns if is_trainer_state(fqn)})
    held = f"; it holds trainer state ({', '.join(roots)})" if roots else ""
    return (f"nothing to convert: none of the {len(fqns)} {entries} is a model weight"
            f"{held}; give --include '*' to take them anyway")

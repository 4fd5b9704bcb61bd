"""Which entries a conversion takes, and their names in the output."""

from __future__ import annotations

import pytest

from dcpctl.errors import SelectionError
from dcpctl.ops.convert.key_selection import KeySelection, Rename, select_and_rename

TRAINING = ["model.embed.weight", "model.head.bias", "optim.state.embed.weight.exp_avg", "step"]


def test_default_takes_the_model_when_there_is_an_optimizer():
    names = select_and_rename(TRAINING, KeySelection(strip_prefix="model."))
    assert names == {"model.embed.weight": "embed.weight", "model.head.bias": "head.bias"}


def test_default_takes_everything_without_a_split():
    fqns = ["model.a", "model.b", "extra"]
    assert list(select_and_rename(fqns, KeySelection())) == fqns


def test_globs_match_source_fqns_and_renames_apply_in_order():
    selection = KeySelection(include=("*",), exclude=("optim.*", "step"), strip_prefix="model.",
                             renames=(Rename.parse(r"^(\w+)\.weight$=\1.w"),
                                      Rename.parse("^=transformer.")))
    assert select_and_rename(TRAINING, selection) == {
        "model.embed.weight": "transformer.embed.w", "model.head.bias": "transformer.head.bias"}


def test_a_rename_splits_at_the_last_equals_sign():
    rename = Rename.parse(r"a(?=b)=c")
    assert (rename.pattern.pattern, rename.replacement) == ("a(?=b)", "c")
    for bad in ("no-separator", "=x", "(=x"):
        with pytest.raises(ValueError):
            Rename.parse(bad)


@pytest.mark.parametrize("text, name, renamed", [
    (r"(?i)^MODEL\.=", "model.w", "w"),
    (r"(?i)(?s)^(model)\.=\1/", "Model.w", "Model/w"),
    ("(?x) ^model \\. # the prefix=", "model.w", "w"),
])
def test_renames_with_global_flags_are_accepted(text, name, renamed):
    rename = Rename.parse(text)
    assert rename.pattern.sub(rename.replacement, name) == renamed


@pytest.mark.parametrize("text", [r"bias=\9", r"(?i)(a)=\2", "(?x)(a) # one group=\\2"])
def test_replacements_naming_a_missing_group_are_refused(text):
    with pytest.raises(ValueError, match="invalid group reference"):
        Rename.parse(text)


def test_clashes_and_empty_selections_are_refused():
    with pytest.raises(SelectionError, match="'model.embed.weight' and 'model.head.bias' are "
                                             "both renamed to 'x'"):
        select_and_rename(TRAINING, KeySelection(renames=(Rename.parse("^.*$=x"),)))
    with pytest.raises(SelectionError, match="empty name"):
        select_and_rename(["model."], KeySelection(include=("*",), strip_prefix="model."))
    with pytest.raises(SelectionError, match="none of the 4 entries matches --include"):
        select_and_rename(TRAINING, KeySelection(include=("decoder.*",)))

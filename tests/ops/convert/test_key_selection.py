"""Which entries a conversion takes, and their names in the output."""

from __future__ import annotations

import pytest

from dcpctl.errors import SelectionError
from dcpctl.ops.convert.key_selection import KeySelection, Rename, select_and_rename

TRAINING = ["model.embed.weight", "model.head.bias", "optim.state.embed.weight.exp_avg", "step"]


TORCHTITAN = ["tok_embeddings.weight", "layers.0.attention.wq.weight", "norm.weight",
              "output.weight", "optimizer.state.tok_embeddings.weight.exp_avg",
              "optimizer.state.tok_embeddings.weight.step", "lr_scheduler", "dataloader.dp_rank_0",
              "dataloader.dp_rank_1", "train_state"]


def test_default_takes_the_model_nested_under_model_named_as_its_state_dict():
    names = select_and_rename(TRAINING, KeySelection(strip_prefix=None))
    assert names == {"model.embed.weight": "embed.weight", "model.head.bias": "head.bias"}


def test_default_takes_a_top_level_model_beside_trainer_state_as_it_is():
    names = select_and_rename(TORCHTITAN, KeySelection(strip_prefix=None))
    assert names == {fqn: fqn for fqn in TORCHTITAN[:4]}


def test_default_leaves_out_an_rng_state_beside_a_model_without_optimizer():
    names = select_and_rename(["model.a", "rng_state", "model.b"], KeySelection(strip_prefix=None))
    assert names == {"model.a": "a", "model.b": "b"}


@pytest.mark.parametrize("model_key", ["model", "state_dict"])
def test_a_lightning_trainer_s_model_beside_its_numbered_optimizers(model_key):
    """Lightning's Trainer saves the module under `model` (FSDP) or `state_dict`
    (ModelParallel) beside `optimizer_0`, `optimizer_1`: those were taken for weights."""
    fqns = [f"{model_key}.body.0.weight", "optimizer_0.state.body.0.weight.exp_avg",
            "optimizer_0.param_groups.0.lr", "optimizer_1.state.head.step",
            f"{model_key}.head.bias"]
    assert select_and_rename(fqns, KeySelection(strip_prefix=None)) == {
        f"{model_key}.body.0.weight": "body.0.weight", f"{model_key}.head.bias": "head.bias"}


def test_a_model_with_a_module_called_model_keeps_its_names():
    fqns = ["model.embed_tokens.weight", "lm_head.weight", "optim.state.lm_head.weight.exp_avg"]
    assert select_and_rename(fqns, KeySelection(strip_prefix=None)) == {
        "model.embed_tokens.weight": "model.embed_tokens.weight",
        "lm_head.weight": "lm_head.weight"}


def test_options_still_rule_over_the_default():
    assert list(select_and_rename(TRAINING, KeySelection(strip_prefix=""))) == TRAINING[:2]
    assert select_and_rename(TORCHTITAN, KeySelection(include=("optimizer.*",),
                                                      strip_prefix="optimizer.state.")) == {
        fqn: fqn.removeprefix("optimizer.state.") for fqn in TORCHTITAN[4:6]}
    assert list(select_and_rename(TORCHTITAN, KeySelection(exclude=("output.*",)))) == \
        TORCHTITAN[:3]


def test_a_checkpoint_of_trainer_state_alone_is_refused_by_default_with_the_way_out():
    fqns = ["optimizer.state.w.exp_avg", "optimizer.state.w.exp_avg_sq", "lr_scheduler"]
    with pytest.raises(SelectionError) as raised:
        select_and_rename(fqns, KeySelection(strip_prefix=None))
    assert str(raised.value) == (
        "nothing to convert: none of the 3 entries is a model weight; it holds trainer state "
        "(lr_scheduler, optimizer); give --include '*' to take them anyway")
    assert list(select_and_rename(fqns, KeySelection(include=("*",)))) == fqns


def test_an_exclude_that_takes_every_weight_says_so():
    """`--exclude '*'` was told that none of the entries is a model weight, and to give
    --include '*'."""
    with pytest.raises(SelectionError) as raised:
        select_and_rename(TRAINING, KeySelection(exclude=("*",)))
    assert str(raised.value) == (f"nothing to convert: --exclude ['*'] leaves none of the 2 "
                                 f"model weights (of {len(TRAINING)} entries)")
    with pytest.raises(SelectionError) as raised:
        select_and_rename(TRAINING, KeySelection(include=("model.*",), exclude=("*",)))
    assert str(raised.value) == ("nothing to convert: --exclude ['*'] leaves none of the 2 "
                                 f"entries matching --include (of {len(TRAINING)} entries)")


def test_a_rename_that_matches_no_name_is_refused():
    """The README's `--rename '^layers\\.=model.layers.'` on a checkpoint whose names start
    `model.layers.` (stripped to `layers.`) renamed them; on one without, it changed nothing,
    silently, and the output lacked the names the user asked for."""
    selection = KeySelection(renames=(Rename.parse(r"^layers\.=model.layers."),))
    with pytest.raises(SelectionError) as raised:
        select_and_rename(TRAINING, KeySelection(strip_prefix=None, renames=selection.renames))
    assert str(raised.value) == (
        r"--rename ^layers\.=model.layers. matches none of the 2 names taken (such as "
        r"'embed.weight', once --strip-prefix 'model.' is off); leave it out, or match those "
        "names")
    with pytest.raises(SelectionError, match=r"\(such as 'model.embed.weight'\); leave it out"):
        select_and_rename(TRAINING, KeySelection(renames=selection.renames))
    assert select_and_rename(["model.layers.0.w"], KeySelection(
        strip_prefix=None, renames=selection.renames)) == {"model.layers.0.w": "model.layers.0.w"}


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


def test_an_entry_named_empty_keeps_its_name_and_only_a_rename_to_empty_is_refused():
    """torch saves and loads a state dict entry named "": convert refused it as renamed to an
    empty name, though nothing renamed it."""
    everything = KeySelection(strip_prefix="")
    assert select_and_rename(["", "w"], everything) == {"": "", "w": "w"}
    with pytest.raises(SelectionError, match="'w' is renamed to an empty name"):
        select_and_rename(["w"], KeySelection(strip_prefix="", renames=(Rename.parse("w="),)))


def test_a_strip_prefix_that_begins_no_name_is_refused():
    """A mistyped --strip-prefix was taken without a word, and the default `model.` strip
    with it: the names came out as they were."""
    with pytest.raises(SelectionError) as raised:
        select_and_rename(TRAINING, KeySelection(strip_prefix="modle."))
    assert str(raised.value) == (
        "--strip-prefix 'modle.' begins none of the 2 names taken (such as "
        "'model.embed.weight'); leave it out, or give a prefix they begin with")
    assert select_and_rename(TRAINING, KeySelection(include=("*",), strip_prefix="model.")) == {
        "model.embed.weight": "embed.weight", "model.head.bias": "head.bias",
        **{fqn: fqn for fqn in TRAINING[2:]}}


def test_an_include_that_matches_objects_alone_says_so():
    """`none of the 28 entries matches` was said of a checkpoint of 40 entries, 12 of them
    objects the glob matched."""
    tensors = ["model.w", "optim.state.w.exp_avg"]
    objects = ["optim.param_groups.0.lr", "optim.param_groups.0.betas", "step"]
    with pytest.raises(SelectionError) as raised:
        select_and_rename(tensors, KeySelection(include=("optim.param_groups.*",)), objects)
    assert str(raised.value) == (
        "nothing to convert: none of the 2 tensors matches --include ['optim.param_groups.*']; "
        "2 non-tensor entries do (such as 'optim.param_groups.0.lr'), which the output cannot "
        "hold")
    with pytest.raises(SelectionError) as raised:
        select_and_rename(tensors, KeySelection(include=("nothing*",)), objects)
    assert str(raised.value) == (
        "nothing to convert: none of the 2 tensors matches --include ['nothing*']")


def test_a_strip_prefix_short_of_its_dot_is_refused():
    """`--strip-prefix model` wrote names `.embed.weight`, which no module matches."""
    with pytest.raises(SelectionError) as raised:
        select_and_rename(TRAINING, KeySelection(strip_prefix="model"))
    assert str(raised.value) == (
        "--strip-prefix 'model' leaves 'model.embed.weight' a name that starts with a dot; give "
        "the prefix with its dot, 'model.'")

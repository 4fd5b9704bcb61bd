"""How trainers shape the state dict they save, read from the checkpoint's fqns alone.

A trainer saves the model's weights beside its own state, each under a first name (the root
of its fqns):
- torchtitan: the model's state dict flattened into the top level (`tok_embeddings.weight`),
  beside `optimizer.state.<fqn>.exp_avg`, `lr_scheduler`, `dataloader.dp_rank_<r>` and
  `train_state`.
- torch's recipe with `get_state_dict`: `{"model": ..., "optim": ...}`.
- torchtune: `model.` beside `optimizer.`, `epochs_run`, `seed`, `steps_run`, ...
- accelerate: a directory per state, `pytorch_model_fsdp_<i>/` holding `model.` alone and
  `optimizer_<i>/` holding `optimizer.` alone.
- Megatron-Core `torch_dist`: its own sharded keys beside `optimizer.state.` and `rng_state`,
  with common.pt and metadata.json beside the DCP files.
- Lightning, with meta.pt beside the DCP files: Fabric's own keys (`model.`, `optimizer.`);
  the Trainer's `model.` (FSDP strategy) or `state_dict.` (ModelParallel strategy) beside
  `optimizer_0.`, `optimizer_1.`, one per optimizer.

TRAINER_STATE_ROOTS (and `optimizer_<i>`) are the roots of trainer state; every other entry is
the model's. When every model entry lies under `model.` or `state_dict.`, the model was saved
under that key and its own names are what follows (a Hugging Face `LlamaForCausalLM`'s
`model.layers...` beside `lm_head.weight` is a model with a module called `model`).
"""

from __future__ import annotations

import re
from typing import Collection, Iterable

MODEL_PREFIXES = ("model.", "state_dict.")
"""The keys a trainer saves a model's state dict under (`state_dict`: Lightning's Trainer)."""
TRAINER_STATE_ROOTS = frozenset({
    "optimizer", "optim", "optimizers", "optimizer_state", "optim_state", "state",
    "param_groups", "lr_scheduler", "lr_schedulers", "scheduler", "schedulers",
    "opt_param_scheduler", "dataloader", "data_loader", "dataloaders", "sampler",
    "train_state", "trainer_state", "rng", "rng_state", "rng_states", "rng_tracker_states",
    "random_states", "scaler", "grad_scaler", "rerun_state_machine_state", "args",
    "iteration", "step", "epoch", "epochs_run", "global_step", "steps_run", "seed",
    "total_epochs", "max_steps_per_epoch", "num_floating_point_operations_so_far",
})
_NUMBERED_OPTIMIZER_ROOT = re.compile(r"optimizer_[0-9]+")  # Lightning's Trainer, per optimizer
_TORCHTUNE_ROOTS = frozenset({"epochs_run", "seed", "steps_run", "total_epochs",
                              "max_steps_per_epoch"})
ACCELERATE_PART = re.compile(r"(pytorch_model_fsdp|optimizer)_[0-9]+")
"""The name of a directory accelerate saves a model (FSDP) or an optimizer into, with DCP."""
ACCELERATE_MODEL_PART = "pytorch_model_fsdp"


_PER_RANK_KEY = re.compile(r"dp_rank_([0-9]+)")


def rank_of_per_rank_entry(fqn: str) -> int | None:
    """The rank an entry belongs to alone (torchtitan's `dataloader.dp_rank_<r>`: each
    data-parallel rank saves its own), or None for an entry every rank shares."""
    for name in fqn.split("."):
        match = _PER_RANK_KEY.fullmatch(name)
        if match:
            return int(match.group(1))
    return None


def root_of(fqn: str) -> str:
    """The first name of an fqn."""
    return fqn.partition(".")[0]


def is_trainer_state(fqn: str) -> bool:
    """Whether fqn is trainer state beside the model (TRAINER_STATE_ROOTS, `optimizer_<i>`)."""
    return _is_trainer_state_root(root_of(fqn))


def _is_trainer_state_root(root: str) -> bool:
    return root in TRAINER_STATE_ROOTS or _NUMBERED_OPTIMIZER_ROOT.fullmatch(root) is not None


def model_prefix_of(model_fqns: Collection[str]) -> str:
    """`model.` (or `state_dict.`) when every model entry lies under it (the model saved under
    a `model` key), else nothing."""
    for prefix in MODEL_PREFIXES:
        if model_fqns and all(fqn.startswith(prefix) for fqn in model_fqns):
            return prefix
    return ""


def describe_layout(tensor_fqns: Iterable[str], object_fqns: Iterable[str], directory_name: str,
                    saver: str | None = None) -> str:
    """Which trainer's state dict this is, and where its model weights (tensors) are, in
    words; saver, where the files already tell who wrote them (Megatron-Core's side files,
    torch's HF writer), names it."""
    tensor_fqns = list(tensor_fqns)
    fqns = tensor_fqns + list(object_fqns)
    first_names = [fqn.partition(".")[0] for fqn in fqns]  # root_of, once per fqn, inline
    roots = set(first_names)
    # objects beside the weights (`extra.epoch`, `consumed_samples`) tell no weights' place
    model = [fqn for fqn, root in zip(tensor_fqns, first_names)
             if not _is_trainer_state_root(root)]
    state = sorted(filter(_is_trainer_state_root, roots))
    part = ACCELERATE_PART.fullmatch(directory_name)
    if saver:
        trainer = saver
    elif part and roots == {"model" if part.group(1) == ACCELERATE_MODEL_PART else "optimizer"}:
        trainer = f"accelerate {'model' if roots == {'model'} else 'optimizer'} part"
    elif "train_state" in roots or any(rank_of_per_rank_entry(fqn) is not None
                                       for fqn in fqns if "dp_rank_" in fqn):
        trainer = "torchtitan"
    elif roots & _TORCHTUNE_ROOTS and "model" in roots:
        trainer = "torchtune"
    elif {"model", "optim"} <= roots:
        trainer = '{"model", "optim"}'
    else:
        trainer = "plain state dict"
    prefix = model_prefix_of(model)
    if not model:
        where = "no model weights"
    elif prefix:
        where = f"model weights under {prefix}"
    else:
        where = "model weights at the top level"
    beside = f"; trainer state: {', '.join(state)}" if state else ""
    return f"{trainer} ({where}{beside}{_optimizer_form(fqns, roots)})"


_OPTIMIZER_ROOTS = ("optimizer", "optim")


def is_optimizer_state(fqn: str) -> bool:
    """Whether fqn is an optimizer's state of a parameter (`optim.state.<param>.exp_avg`)."""
    root, _, rest = fqn.partition(".")
    return _is_optimizer_root(root) and rest.startswith("state.")


def _is_optimizer_root(root: str) -> bool:
    return root in _OPTIMIZER_ROOTS or _NUMBERED_OPTIMIZER_ROOT.fullmatch(root) is not None


def _optimizer_form(fqns: list[str], roots: set[str]) -> str:
    """How the optimizer's state was taken, where it tells: torch's get_optimizer_state_dict
    with flatten_optimizer_state_dict keys its param_groups by parameter
    (`optim.param_groups.<fqn>.lr`), without it by the group's place in a list
    (`optim.param_groups.0.lr`)."""
    numbered = sorted(root for root in roots if _NUMBERED_OPTIMIZER_ROOT.fullmatch(root))
    for root in [*(root for root in _OPTIMIZER_ROOTS if root in roots), *numbered]:
        prefix = f"{root}.param_groups."
        groups = {fqn[len(prefix):].partition(".")[0] for fqn in fqns if fqn.startswith(prefix)}
        if groups:
            flattened = not all(group.isdecimal() for group in groups)
            return f"; optimizer state {'flattened' if flattened else 'nested'}"
    return ""

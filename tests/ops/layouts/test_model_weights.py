"""convert --to safetensors takes exactly the model's weights, named as the model's own
`state_dict()` names them, from the state dicts trainers save (built here with torch's own
distributed state-dict helpers, as the trainers build them)."""

from __future__ import annotations

import io

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_optimizer_state_dict)

from dcpctl.ops.convert.targets import convert_checkpoint
from dcpctl.ops.inspection.report import inspect_checkpoint

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


class TinyTransformer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.tok_embeddings = torch.nn.Embedding(32, 8)
        self.layers = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(2))
        self.norm = torch.nn.LayerNorm(8)
        self.output = torch.nn.Linear(8, 32, bias=False)

    def forward(self, tokens):
        hidden = self.tok_embeddings(tokens)
        for layer in self.layers:
            hidden = layer(hidden)
        return self.output(self.norm(hidden))


@pytest.fixture(scope="module")
def trained():
    model = TinyTransformer()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.arange(8)).sum().backward()
    optimizer.step()
    return model, optimizer


def _object(value) -> io.BytesIO:
    buffer = io.BytesIO()
    torch.save(value, buffer)
    buffer.seek(0)
    return buffer


def torchtitan_state(model, optimizer) -> dict:
    """torchtitan's CheckpointManager: the model's state dict flattened into the top level,
    the optimizer flattened under `optimizer`, the schedulers, one dataloader state per
    data-parallel rank and the train state beside it."""
    options = StateDictOptions(flatten_optimizer_state_dict=True)
    return {**get_model_state_dict(model),
            "optimizer": get_optimizer_state_dict(model, optimizer, options=options),
            "lr_scheduler": {"lr_scheduler_0": _object({"last_epoch": 1})},
            "dataloader": {"dp_rank_0": _object({"sample": 8}), "dp_rank_1": _object({})},
            "train_state": {"step": torch.tensor(1), "ntokens_seen": torch.tensor(8)}}


def model_optim_state(model, optimizer) -> dict:
    """torch's recipe: `{"model": ..., "optim": ...}` from get_state_dict's two halves."""
    return {"model": get_model_state_dict(model),
            "optim": get_optimizer_state_dict(model, optimizer)}


def model_and_rng_state(model, optimizer) -> dict:
    """A model nested under `model` and no optimizer, beside an RNG state tensor."""
    return {"model": get_model_state_dict(model), "rng_state": torch.get_rng_state()}


@pytest.mark.parametrize("layout", [torchtitan_state, model_optim_state, model_and_rng_state])
def test_convert_to_safetensors_takes_exactly_the_models_state_dict(trained, tmp_path, layout):
    model, optimizer = trained
    dcp.save(layout(model, optimizer), checkpoint_id=tmp_path / "dcp")
    convert_checkpoint(tmp_path / "dcp", "safetensors", tmp_path / "hf")
    converted = load_file(tmp_path / "hf" / "model.safetensors")
    expected = model.state_dict()
    assert list(converted) == sorted(expected)
    for name, value in expected.items():
        assert torch.equal(converted[name], value), name
    TinyTransformer().load_state_dict(converted, strict=True)


@pytest.mark.parametrize("layout,directory,described", [
    (torchtitan_state, "step-10", "torchtitan (model weights at the top level; trainer state: "
                                  "dataloader, lr_scheduler, optimizer, train_state; optimizer "
                                  "state flattened)"),
    (model_optim_state, "step-10", '{"model", "optim"} (model weights under model.; trainer '
                                   'state: optim; optimizer state nested)'),
    (model_and_rng_state, "step-10", "plain state dict (model weights under model.; trainer "
                                     "state: rng_state)"),
    # objects beside the weights tell nothing of where they are (before: "at the top level")
    (lambda model, optimizer: {**model_optim_state(model, optimizer), "consumed_samples": 5,
                               "extra": {"epoch": 1, "tag": "a"}}, "step-10",
     '{"model", "optim"} (model weights under model.; trainer state: optim; optimizer state '
     'nested)'),
    (lambda model, optimizer: {"model": model.state_dict()}, "pytorch_model_fsdp_0",
     "accelerate model part (model weights under model.)"),
    (lambda model, optimizer: {"optimizer": get_optimizer_state_dict(model, optimizer)},
     "optimizer_0", "accelerate optimizer part (no model weights; trainer state: optimizer; "
                    "optimizer state nested)"),
])
def test_inspect_says_whose_state_dict_it_is(trained, tmp_path, layout, directory, described):
    dcp.save(layout(*trained), checkpoint_id=tmp_path / directory)
    assert inspect_checkpoint(tmp_path / directory).layout == described

"""inspect says whether a save's chunks came from FSDP2's DTensors or FSDP1's ShardedTensors,
where they tell (real 3-rank saves of both), and says nothing where they do not."""

from __future__ import annotations

import pytest
import torch
from make_fixtures import run_gloo_job

from dcpctl.ops.inspection.report import inspect_checkpoint


class TwoLayers(torch.nn.Module):
    """A layer of more rows than ranks, and one of a single row: where FSDP2 writes an empty
    chunk for the ranks past its rows and FSDP1 writes none."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.wide = torch.nn.Linear(8, 16)
        self.single = torch.nn.Linear(16, 1)

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        return self.single(torch.relu(self.wide(inputs)))


def _save(rank: int, world_size: int, api: str, out: str) -> None:
    import torch.distributed.checkpoint as dcp

    model = TwoLayers()
    if api == "fsdp1":
        from torch.distributed.fsdp import FullyShardedDataParallel, StateDictType
        model = FullyShardedDataParallel(model, device_id=torch.device("cpu"),
                                         use_orig_params=True)
    elif api == "fsdp2":
        from torch.distributed.fsdp import fully_shard
        fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(4, 8)).sum().backward()
    optimizer.step()
    if api == "fsdp1":
        with FullyShardedDataParallel.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
            state = {"model": model.state_dict(),
                     "optim": FullyShardedDataParallel.optim_state_dict(model, optimizer)}
    else:
        from torch.distributed.checkpoint.state_dict import (get_model_state_dict,
                                                             get_optimizer_state_dict)
        state = {"model": get_model_state_dict(model),
                 "optim": get_optimizer_state_dict(model, optimizer)}
    dcp.save(state, checkpoint_id=out)


@pytest.mark.slow
@pytest.mark.parametrize("api,told", [("fsdp1", "; FSDP1/ShardedTensor chunks"),
                                      ("fsdp2", "; FSDP2/DTensor chunks"),
                                      ("replicated", "")])
def test_the_sharding_api_is_told_from_the_chunks(tmp_path, api, told):
    """FSDP1 SHARDED_STATE_DICT, FSDP2, and a replicated (DDP-like) save of the same model on
    3 ranks."""
    run_gloo_job(3, _save, api, str(tmp_path / api))
    layout = inspect_checkpoint(tmp_path / api).layout
    assert layout.endswith("optimizer state nested)" + told), layout


def test_an_empty_tensor_of_a_one_process_save_tells_nothing(tmp_path):
    """The one chunk of an empty tensor (no rows, fewer than the one rank) was taken for the
    empty chunk a DTensor leaves for the ranks past its rows."""
    import torch.distributed.checkpoint as dcp

    dcp.save({"w": torch.randn(4, 3), "empty": torch.empty(0)}, checkpoint_id=tmp_path / "ck",
             no_dist=True)
    assert "DTensor" not in inspect_checkpoint(tmp_path / "ck").layout

"""Checkpoints shaped as Megatron-Core's `torch_dist` saver writes them, made with torch's own
DCP on several gloo ranks: Megatron's save plans kept in `.metadata` (`all_local_plans`, as
megatron/core/dist_checkpointing/strategies/state_dict_saver.py does), optionally its
`mcore_data` (0.14), rank-local objects under `<key>/shard_<rank>_<world>` keys, and its
`common.pt` and `metadata.json` beside the DCP files."""

from __future__ import annotations

import io
import json
from pathlib import Path

import torch
from make_fixtures import run_gloo_job

MCORE_DATA = {"decoder.weight": {"nd_reformulated_orig_global_shape": (2, 8, 6)},
              "decoder.bias": {}}
COMMON_STATE = {"iteration": 7, "args": {"lr": 0.1}}
MEGATRON_CONFIG = {"sharded_backend": "torch_dist", "sharded_backend_version": 1,
                   "common_backend": "torch", "common_backend_version": 1}


def megatron_state(rank: int, world_size: int) -> dict:
    """The state each rank hands DCP: a weight sharded by rows, a replicated bias and a
    rank-local object (Megatron's ShardedObject)."""
    from torch.distributed.tensor import Shard, distribute_tensor, init_device_mesh

    torch.manual_seed(0)
    weight = torch.randn(8, 6, dtype=torch.bfloat16)
    mesh = init_device_mesh("cpu", (world_size,))
    return {"decoder.weight": distribute_tensor(weight, mesh, [Shard(0)]),
            "decoder.bias": torch.arange(6, dtype=torch.float32),
            f"rng_state/shard_{rank}_{world_size}": io.BytesIO(
                f"seed {1234 + rank}".encode())}


def _save(rank: int, world_size: int, path: str, with_mcore_data: bool) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    class MegatronLikePlanner(DefaultSavePlanner):
        def create_global_plan(self, all_plans):
            plans, metadata = super().create_global_plan(all_plans)
            metadata.all_local_plans = all_plans
            if with_mcore_data:
                metadata.mcore_data = MCORE_DATA
            return plans, metadata

    dcp.save(megatron_state(rank, world_size), checkpoint_id=path,
             planner=MegatronLikePlanner(flatten_state_dict=False))
    if rank == 0:
        torch.save(COMMON_STATE, Path(path) / "common.pt")
        (Path(path) / "metadata.json").write_text(json.dumps(MEGATRON_CONFIG))


def save_megatron_like(path: Path, world_size: int = 2, with_mcore_data: bool = False) -> Path:
    run_gloo_job(world_size, _save, str(path), with_mcore_data)
    return path

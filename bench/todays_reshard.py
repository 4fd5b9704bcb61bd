"""Today's way to reshard a DCP checkpoint: N gloo processes that load and re-save it.

Usage: python bench/todays_reshard.py SOURCE TARGET N
Each rank builds the target state from the metadata (DTensors sharded along dim 0 on an N-rank
CPU mesh, plain tensors for 0-d entries, placeholders for objects), `dcp.load`s it and
`dcp.save`s it, as users do today with torchrun.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "fixtures"))
from make_fixtures import run_gloo_job  # noqa: E402


def load_and_save(rank: int, world_size: int, source: str, target: str) -> None:
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    mesh = init_device_mesh("cpu", (world_size,))
    metadata = dcp.FileSystemReader(source).read_metadata()
    state = {}
    for fqn, entry in metadata.state_dict_metadata.items():
        if not isinstance(entry, TensorStorageMetadata):
            state[fqn] = 0
            continue
        shape, dtype = entry.size, entry.properties.dtype
        if len(shape) == 0:
            state[fqn] = torch.empty((), dtype=dtype)
            continue
        per_rank = -(-shape[0] // world_size)
        start = min(rank * per_rank, shape[0])
        rows = min(start + per_rank, shape[0]) - start
        local = torch.empty((rows, *shape[1:]), dtype=dtype)
        state[fqn] = DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=shape,
                                        stride=torch.empty(shape, device="meta").stride())
    dcp.load(state, checkpoint_id=source)
    dcp.save(state, checkpoint_id=target)


if __name__ == "__main__":
    run_gloo_job(int(sys.argv[3]), load_and_save, sys.argv[1], sys.argv[2])

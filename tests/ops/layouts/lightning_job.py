"""Lightning jobs on CPU ranks, run by torchrun (Lightning takes its ranks from there), with
the ModelParallel strategy's FSDP2. Fabric: `save OUT VALUES` trains two AdamW steps of a
small model and saves a sharded checkpoint with Fabric's own `save`; `load CHECKPOINT VALUES`
loads one into a fresh job with Fabric's own `load`; rank 0 writes the full model and
optimizer state, and the rest of the state Fabric gave back, to VALUES (JSON). The Trainer:
`trainer-save OUT VALUES` fits a LightningModule for two steps and saves a checkpoint with
`Trainer.save_checkpoint`; rank 0 writes the module's full state dict to VALUES."""

from __future__ import annotations

import json
import os
import sys

import torch


def _parallelize(model, device_mesh):
    from torch.distributed.fsdp import fully_shard

    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=device_mesh["data_parallel"])
    return fully_shard(model, mesh=device_mesh["data_parallel"])


def _job():
    import lightning as L
    from lightning.fabric.strategies import ModelParallelStrategy

    ranks = int(os.environ["WORLD_SIZE"])
    fabric = L.Fabric(accelerator="cpu", devices=ranks, strategy=ModelParallelStrategy(
        _parallelize, data_parallel_size=ranks, tensor_parallel_size=1))
    fabric.launch()
    torch.manual_seed(0)
    with fabric.init_module(empty_init=False):
        model = torch.nn.Sequential(torch.nn.Linear(8, 24), torch.nn.ReLU(),
                                    torch.nn.Linear(24, 5))
    model = fabric.setup_module(model)
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-2))
    return fabric, model, optimizer


def _step(fabric, model, optimizer, seed: int) -> None:
    inputs = torch.randn(4, 8, generator=torch.Generator().manual_seed(seed))
    fabric.backward(model(inputs).sum())
    optimizer.step()
    optimizer.zero_grad()


def _write_values(fabric, model, optimizer, rest: dict, values_file: str) -> None:
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                         get_optimizer_state_dict)

    full = StateDictOptions(full_state_dict=True)
    values = {f"model.{fqn}": value.tolist()
              for fqn, value in get_model_state_dict(model, options=full).items()}
    for parameter, moments in get_optimizer_state_dict(model, optimizer,
                                                       options=full)["state"].items():
        values.update({f"optimizer.{parameter}.{name}": value.tolist()
                       for name, value in moments.items()})
    if fabric.global_rank == 0:
        with open(values_file, "w") as stream:
            json.dump({"tensors": values, "rest": rest}, stream)


def _trainer_save(path: str, values_file: str) -> None:
    import lightning as L
    from lightning.pytorch.strategies import ModelParallelStrategy
    from torch.distributed.fsdp import fully_shard
    from torch.utils.data import DataLoader, TensorDataset

    class Net(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.body = torch.nn.Sequential(torch.nn.Linear(8, 24), torch.nn.ReLU(),
                                            torch.nn.Linear(24, 5))

        def configure_model(self) -> None:
            mesh = self.device_mesh["data_parallel"]
            for layer in self.body:
                if isinstance(layer, torch.nn.Linear):
                    fully_shard(layer, mesh=mesh)
            fully_shard(self.body, mesh=mesh)

        def training_step(self, batch, index):
            return self.body(batch[0]).sum()

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-2)

    inputs = torch.randn(16, 8, generator=torch.Generator().manual_seed(1))
    trainer = L.Trainer(accelerator="cpu", devices=int(os.environ["WORLD_SIZE"]),
                        strategy=ModelParallelStrategy(), max_steps=2, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False)
    module = Net()
    trainer.fit(module, DataLoader(TensorDataset(inputs), batch_size=4))
    trainer.save_checkpoint(path)
    values = {name: value.full_tensor().tolist() for name, value in module.state_dict().items()}
    if trainer.global_rank == 0:
        with open(values_file, "w") as stream:
            json.dump(values, stream)


def main(action: str, path: str, values_file: str) -> None:
    if action == "trainer-save":
        return _trainer_save(path, values_file)
    fabric, model, optimizer = _job()
    if action == "save":
        for seed in (1, 2):
            _step(fabric, model, optimizer, seed)
        rest = {"step": 2, "note": "two steps"}
        fabric.save(path, {"model": model, "optimizer": optimizer, **rest})
    else:
        _step(fabric, model, optimizer, 3)  # state the load must replace
        rest = fabric.load(path, {"model": model, "optimizer": optimizer})
    _write_values(fabric, model, optimizer, rest, values_file)


def _end_process_group() -> None:
    """Every rank past its work, then the group torn down: a rank that exits while another's
    gloo threads still serve the group can take that one down with it (SIGABRT, `terminate
    called without an active exception`), as it did once in CI."""
    import torch.distributed as distributed

    if distributed.is_initialized():
        distributed.barrier()
        distributed.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
    _end_process_group()
    # Leave without running interpreter shutdown, as make_fixtures.run_gloo_job does: gloo's
    # threads can still make the C++ runtime abort there (`terminate called without an active
    # exception`, SIGABRT) after the group was torn down, which CI met again.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)

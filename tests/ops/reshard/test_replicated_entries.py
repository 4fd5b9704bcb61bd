"""reshard writes what a real N-rank save writes, entry by entry and file by file: sharded
tensors split as FSDP2 splits them, tensors that were never sharded (buffers, counters, RNG
state) and objects whole and once on the rank file torch's deduplication picks, per-rank
objects on their own rank's file; compared against real FSDP2 saves of 2, 3 and 4 ranks."""

from __future__ import annotations

import io

import pytest
import torch
from conftest import (assert_torch_loads_equal, entry_files, is_per_rank_object,
                      torch_metadata)
from make_fixtures import run_gloo_job

from dcpctl.errors import UnsupportedLayoutError
from dcpctl.format.checkpoint.sharding import place_like_a_save
from dcpctl.ops.reshard.execution import reshard_checkpoint


class BufferedModel(torch.nn.Module):
    """Parameters of several row counts (one of a single row) and buffers FSDP2 leaves whole."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(10, 6)
        self.proj = torch.nn.Linear(6, 5)
        self.gate = torch.nn.Linear(6, 1)
        self.register_buffer("rope", torch.randn(7, 4))
        self.register_buffer("scale", torch.randn(3))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        hidden = self.embed(tokens)
        return self.proj(hidden).sum() + self.gate(hidden).sum() + self.rope.sum()


def _object(value) -> io.BytesIO:
    buffer = io.BytesIO()
    torch.save(value, buffer)
    buffer.seek(0)
    return buffer


def trainer_state(rank: int, world_size: int) -> dict:
    """What torchtitan's CheckpointManager saves from an FSDP2 job, in its order."""
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                         get_optimizer_state_dict)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = BufferedModel()
    mesh = init_device_mesh("cpu", (world_size,))
    for layer in (model.embed, model.proj, model.gate):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.arange(8) % 10).backward()
    optimizer.step()
    options = StateDictOptions(flatten_optimizer_state_dict=True)
    return {**get_model_state_dict(model),
            "optimizer": get_optimizer_state_dict(model, optimizer, options=options),
            "lr_scheduler": {"lr_scheduler_0": _object({"last_epoch": 1})},
            "dataloader": {f"dp_rank_{rank}": _object({"rank": rank}),
                           "world_size": world_size},
            "train_state": {"step": torch.tensor(1), "rng": torch.get_rng_state()}}


def _save(rank: int, world_size: int, path: str) -> None:
    import torch.distributed.checkpoint as dcp

    dcp.save(trainer_state(rank, world_size), checkpoint_id=path)


@pytest.fixture(scope="module")
def real_saves(tmp_path_factory):
    root = tmp_path_factory.mktemp("trainer_saves")
    saves = {}
    for world_size in (2, 3, 4):
        saves[world_size] = root / f"{world_size}ranks"
        run_gloo_job(world_size, _save, str(saves[world_size]))
    return saves


@pytest.mark.slow
@pytest.mark.parametrize("source,target", [(2, 3), (4, 3), (3, 2), (2, 4)])
def test_every_entry_lands_where_a_real_save_puts_it(real_saves, tmp_path, source, target):
    out = tmp_path / "out"
    report = reshard_checkpoint(real_saves[source], target, str(out))
    real = entry_files(real_saves[target], is_per_rank_object)
    assert entry_files(out, is_per_rank_object) == real
    written = entry_files(out)
    kept = {fqn for fqn, _ in written if is_per_rank_object(fqn)}
    assert kept == {f"dataloader.dp_rank_{rank}" for rank in range(source)}
    for rank in range(min(source, target)):
        assert written[(f"dataloader.dp_rank_{rank}", None)] == f"__{rank}_0.distcp"
    assert report.per_rank_objects.ranks == tuple(range(source))
    assert report.per_rank_objects.ranks_without == tuple(range(source, target))
    assert_torch_loads_equal(real_saves[source], out)


@pytest.mark.slow
def test_per_rank_objects_can_be_dropped_or_refused(real_saves, tmp_path):
    with pytest.raises(UnsupportedLayoutError, match=r"holds per-rank objects of ranks 0, 1 "
                                                     r"\(dataloader.dp_rank_0, dataloader."
                                                     r"dp_rank_1\), which a 3-rank job"):
        reshard_checkpoint(real_saves[2], 3, str(tmp_path / "refused"),
                           per_rank_objects="refuse")
    assert not (tmp_path / "refused").exists()
    report = reshard_checkpoint(real_saves[2], 3, str(tmp_path / "dropped"),
                                per_rank_objects="drop")
    assert report.per_rank_objects.dropped == ("dataloader.dp_rank_0", "dataloader.dp_rank_1")
    metadata = torch_metadata(tmp_path / "dropped")
    assert not any(map(is_per_rank_object, metadata.state_dict_metadata))
    assert not any(map(is_per_rank_object, metadata.planner_data))
    assert entry_files(tmp_path / "dropped") == entry_files(real_saves[3], is_per_rank_object)
    same = reshard_checkpoint(real_saves[2], 2, str(tmp_path / "same"), per_rank_objects="refuse")
    assert same.per_rank_objects.ranks_without == () and same.per_rank_objects.dropped == ()


@pytest.mark.parametrize("seed", range(20))
def test_placement_is_torchs_deduplication(seed):
    """place_like_a_save against torch's own dedup_save_plans, on plans of random items:
    sharded (one holder), replicated (every rank), shared empty chunks (a suffix of ranks),
    and chunks a scattered set of ranks holds (the empty chunks of a 2-D mesh)."""
    import random

    from torch.distributed.checkpoint._dedup_save_plans import dedup_save_plans
    from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, MetadataIndex,
                                                       TensorProperties)
    from torch.distributed.checkpoint.planner import (SavePlan, TensorWriteData, WriteItem,
                                                      WriteItemType)

    generator = random.Random(seed)
    world_size = generator.randint(1, 9)
    items = []
    for _ in range(generator.randint(1, 40)):
        first = generator.randrange(world_size)
        kind = generator.choice(["sharded", "replicated", "shared", "scattered", "object"])
        others = generator.sample(range(world_size), generator.randint(0, min(3, world_size)))
        scattered = tuple(sorted({first, *others}))
        holders = {"sharded": range(first, first + 1), "shared": range(first, world_size),
                   "scattered": scattered}.get(kind, range(world_size))
        items.append((holders, 0 if kind == "object" else 4 * generator.randint(0, 50)))

    def write_item(index: int, size: int) -> WriteItem:
        if size == 0 and items[index][1] == 0 and len(items[index][0]) == world_size:
            return WriteItem(MetadataIndex(f"item{index}"), WriteItemType.BYTE_IO)
        data = TensorWriteData(ChunkStorageMetadata(torch.Size([0]), torch.Size([0])),
                               TensorProperties(dtype=torch.float32), torch.Size([size // 4]))
        return WriteItem(MetadataIndex(f"item{index}", torch.Size([0])), WriteItemType.SHARD,
                         tensor_data=data)

    plans = [SavePlan([write_item(index, size) for index, (holders, size) in enumerate(items)
                       if rank in holders]) for rank in range(world_size)]
    kept_by = {item.index.fqn: rank for rank, plan in enumerate(dedup_save_plans(plans))
               for item in plan.items}
    assert place_like_a_save(items, world_size) == [kept_by[f"item{index}"]
                                                    for index in range(len(items))]

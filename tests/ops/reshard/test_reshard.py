"""reshard against real N-rank saves: the same chunks, the values torch loads, own-file reads."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import MANIFEST, directory_state, fixture_path, load_with_torch, torch_metadata
from make_fixtures import build_fsdp2_train_state, run_gloo_job, tensor_sha256
from rank_loading import assert_matches_manifest, describe_after_loading_on_ranks

from dcpctl.errors import InvalidOptionError, OutputError
from dcpctl.format.checkpoint.view import open_checkpoint
from dcpctl.format.dtypes import dtype_by_name
from dcpctl.format.file_names import rank_file_name
from dcpctl.ops.reshard.execution import reshard_checkpoint
from dcpctl.ops.reshard.planning import ChunkTask, group_tasks_into_runs
from dcpctl.ops.verify.verifier import verify_checkpoint


def _save_fsdp2(rank: int, world_size: int, path: str) -> None:
    import torch.distributed.checkpoint as dcp

    dcp.save(build_fsdp2_train_state(world_size), checkpoint_id=path)


@pytest.fixture(scope="module")
def real_fsdp2_saves(tmp_path_factory):
    """Real FSDP2 saves of the fixtures' model and AdamW state on 1 and 4 ranks."""
    root = tmp_path_factory.mktemp("real_saves")
    saves = {}
    for world_size in (1, 4):
        saves[world_size] = root / f"fsdp2_{world_size}ranks"
        run_gloo_job(world_size, _save_fsdp2, str(saves[world_size]))
    saves[3] = fixture_path("fsdp2_adamw_3ranks")
    saves[2] = fixture_path("zstd_fsdp2_2ranks")
    return saves


def chunk_layout(checkpoint: Path) -> dict[str, list]:
    """fqn -> [(offsets, sizes), ...] as torch's own metadata lists them."""
    metadata = torch_metadata(checkpoint)
    return {fqn: sorted((tuple(c.offsets), tuple(c.sizes)) for c in entry.chunks)
            for fqn, entry in metadata.state_dict_metadata.items() if hasattr(entry, "chunks")}


def _files_read_by_rank(rank: int, world_size: int, checkpoint: str, out_dir: str) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.tensor import DTensor

    class RecordingReader(dcp.FileSystemReader):
        def read_data(self, plan, planner):
            for item in plan.items:
                info = self.storage_data[item.storage_index]
                reads.append((item.storage_index.fqn, info.relative_path))
            return super().read_data(plan, planner)

    reads: list = []
    state = build_fsdp2_train_state(world_size)
    dcp.load(state, storage_reader=RecordingReader(checkpoint))
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict

    sharded = [fqn for fqn, value in flatten_state_dict(state)[0].items()
               if isinstance(value, DTensor)]
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps({"reads": reads, "sharded": sharded}))


@pytest.mark.slow
@pytest.mark.parametrize("source_ranks,target_ranks", [(2, 4), (4, 3), (3, 1)])
def test_chunks_equal_a_real_save_of_that_world_size(real_fsdp2_saves, tmp_path, source_ranks,
                                                     target_ranks):
    out = tmp_path / "out"
    reshard_checkpoint(real_fsdp2_saves[source_ranks], target_ranks, str(out), threads=2)
    assert chunk_layout(out) == chunk_layout(real_fsdp2_saves[target_ranks])
    names = sorted(p.name for p in out.iterdir() if p.suffix == ".distcp")
    assert names == [f"__{rank}_0.distcp" for rank in range(target_ranks)]
    for info in torch_metadata(out).storage_data.values():
        if info.relative_path != "__0_0.distcp":
            assert info.length > 0


@pytest.mark.slow
def test_each_rank_reads_its_shards_from_its_own_file(tmp_path):
    out = tmp_path / "out"
    reshard_checkpoint(fixture_path("zstd_fsdp2_2ranks"), 4, str(out))
    assert {info.transform_descriptors[0] for info in torch_metadata(out).storage_data.values()
            } == {"stream.zstd/1"}  # zstd stays zstd
    assert_matches_manifest(describe_after_loading_on_ranks(out, "zstd_fsdp2_2ranks", 4),
                            "zstd_fsdp2_2ranks")
    run_gloo_job(4, _files_read_by_rank, str(out), str(tmp_path))
    for rank in range(4):
        record = json.loads((tmp_path / f"rank{rank}.json").read_text())
        sharded = set(record["sharded"])
        shard_files = {path for fqn, path in record["reads"] if fqn in sharded}
        assert shard_files <= {f"__{rank}_0.distcp"}, (rank, shard_files)
        assert shard_files or rank == 3  # rank 3 of 4 holds only empty shards of this model


@pytest.mark.slow
@pytest.mark.parametrize("name,target_ranks", [("mesh2d_4ranks", 2), ("objects_2ranks", 3),
                                               ("fsdp2_adamw_3ranks", 2)])
def test_resharded_checkpoints_load_equal_on_their_new_world_size(name, target_ranks, tmp_path):
    out = tmp_path / "out"
    reshard_checkpoint(fixture_path(name), target_ranks, str(out))
    assert_matches_manifest(describe_after_loading_on_ranks(out, name, target_ranks), name)


def test_safetensors_input_becomes_a_checkpoint_stock_torch_loads(tmp_path):
    out = tmp_path / "out"
    reshard_checkpoint(fixture_path("safetensors_fsdp2_2ranks"), 2, str(out))
    loaded = load_with_torch(out)
    expected = MANIFEST["safetensors_fsdp2_2ranks"]["tensors"]
    assert {fqn: tensor_sha256(loaded[fqn]) for fqn in expected} == {
        fqn: d["sha256"] for fqn, d in expected.items()}


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled",
                            "ignore:ComplexHalf support is experimental")
def test_dtypes_without_a_legacy_storage_class_reshard_to_what_torch_loads(tmp_path):
    import torch
    import torch.distributed.checkpoint as dcp

    def random_bits(dtype, shape):
        return torch.randint(0, 256, (*shape, dtype.itemsize), dtype=torch.uint8).view(
            dtype).reshape(shape)

    state = {str(dtype).removeprefix("torch."): random_bits(dtype, (6, 4)) for dtype in (
        torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e8m0fnu, torch.float4_e2m1fn_x2,
        torch.uint16, torch.uint32, torch.uint64, torch.complex32)}
    dcp.save(state, checkpoint_id=tmp_path / "dcp", no_dist=True)
    reshard_checkpoint(tmp_path / "dcp", 2, str(tmp_path / "out"))
    loaded = load_with_torch(tmp_path / "out")
    assert {name: (tensor.dtype, tensor_sha256(tensor)) for name, tensor in loaded.items()} == {
        name: (tensor.dtype, tensor_sha256(tensor)) for name, tensor in state.items()}


def test_small_row_blocks_and_thread_counts_give_the_same_bytes(tmp_path):
    """Chunks built whole in one buffer or streamed in blocks of rows, from single reads or
    from several input chunks: the same bytes, and every archive's CRC-32s (taken from the
    reads where one read filled a buffer) are right."""
    source = fixture_path("mesh2d_4ranks")
    reshard_checkpoint(source, 3, str(tmp_path / "default"), threads=1)
    reshard_checkpoint(source, 3, str(tmp_path / "blocks"), threads=3, piece_bytes=16)
    assert directory_state(tmp_path / "default") == directory_state(tmp_path / "blocks")
    report = verify_checkpoint(tmp_path / "blocks")
    assert report.exit_code == 0 and report.items_checked, report.problems


def test_codec_can_be_changed(tmp_path):
    out = tmp_path / "out"
    reshard_checkpoint(fixture_path("zstd_fsdp2_2ranks"), 3, str(out), codec_name="none")
    assert all(info.transform_descriptors is None
               for info in open_checkpoint(out).metadata.storage_data.values())


def test_bad_outputs_are_refused(tmp_path):
    with pytest.raises(OutputError, match="is the input"):
        reshard_checkpoint(fixture_path("mesh2d_4ranks"), 2, str(fixture_path("mesh2d_4ranks")))
    out = tmp_path / "out"
    out.mkdir()
    (out / "x").write_text("x")
    with pytest.raises(OutputError, match="not empty"):
        reshard_checkpoint(fixture_path("mesh2d_4ranks"), 2, str(out))
    with pytest.raises(InvalidOptionError, match="from 1 to 1048576, not 0"):
        reshard_checkpoint(fixture_path("mesh2d_4ranks"), 0, str(tmp_path / "zero"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_runs_group_each_windows_tasks_by_rank_file_in_plan_order():
    float32 = dtype_by_name("float32")
    tasks = [ChunkTask(f"t{tensor}", float32, (tensor * 3 + rank, 0), (1, 256), (),
                       rank_file_name(rank))
             for tensor in range(5) for rank in range(3)]  # 1 KiB each, ranks interleaved
    runs = group_tasks_into_runs(tasks, max_bytes=2048, window_bytes=6 * 1024)
    assert [[task.fqn for task in run.tasks] for run in runs] == [
        ["t0", "t1"], ["t0", "t1"], ["t0", "t1"],  # window 1: tensors 0 and 1, per rank file
        ["t2", "t3"], ["t2", "t3"], ["t2", "t3"],
        ["t4"], ["t4"], ["t4"]]
    for run in runs:
        assert {task.output_file for task in run.tasks} == {run.lane}
        assert run.size_bytes == 1024 * len(run.tasks) <= 2048
    for rank in range(3):  # each file gets its tasks in plan order: the same bytes as before
        assert [task for run in runs if run.lane == rank_file_name(rank) for task in run.tasks
                ] == [task for task in tasks if task.output_file == rank_file_name(rank)]

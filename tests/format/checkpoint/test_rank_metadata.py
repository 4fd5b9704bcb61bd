"""Checkpoints saved with use_collectives=False: no `.metadata`, each rank's own, read as one
checkpoint (format/checkpoint/rank_metadata.py), from real 3-rank gloo saves."""

from __future__ import annotations

import pickle
import shutil

import pytest
import torch
from conftest import directory_state, flip_bit, load_with_torch, run_dcpctl

from dcpctl.errors import IncompleteCheckpointError
from dcpctl.format.checkpoint.view import open_checkpoint
from dcpctl.ops.verify.verifier import verify_checkpoint

WORLD_SIZE = 3


def _full_tensors() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(5)
    return {"model.w": torch.randn(9, 4, generator=generator),
            "model.b": torch.randn(4, generator=generator),
            "model.e": torch.arange(10, dtype=torch.bfloat16)}


def _saved_without_collectives(rank: int, world_size: int, path: str) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world_size,))
    full = _full_tensors()
    state = {"model": {"w": distribute_tensor(full["model.w"], mesh, [Shard(0)]),
                       "b": distribute_tensor(full["model.b"], mesh, [Replicate()]),
                       "e": full["model.e"]},
             "step": 7, "rank_state": {"rank": rank, "noise": torch.full((2,), float(rank))}}
    dcp.save(state, checkpoint_id=path, use_collectives=False)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    from make_fixtures import run_gloo_job

    path = tmp_path_factory.mktemp("saved") / "ck"
    run_gloo_job(WORLD_SIZE, _saved_without_collectives, str(path))
    return path


@pytest.fixture
def checkpoint(saved, tmp_path):
    copy = tmp_path / "ck"
    shutil.copytree(saved, copy)
    return copy


def test_it_is_read_as_one_checkpoint_whose_replicas_are_checked_too(checkpoint):
    """It was refused: `dcpctl does not read yet`. Each rank saved the replicated tensor, the
    plain one and both objects: one copy is read, all are checked."""
    opened = open_checkpoint(checkpoint)
    assert opened.rank_metadata == ["__0.metadata", "__1.metadata", "__2.metadata"]
    chunks = {tensor.fqn: [tuple(chunk.offsets) for chunk in tensor.chunks]
              for tensor in opened.tensors}
    assert chunks == {"model.w": [(0, 0), (3, 0), (6, 0)], "model.b": [(0,)], "model.e": [(0,)],
                      "rank_state.noise": [(0,)]}
    assert all(chunk.storage.relative_path == f"__{offsets[0] // 3}_0.distcp"
               for chunk, offsets in zip(opened.tensors[0].chunks, chunks["model.w"]))
    # the lowest rank's copy is the one read
    assert opened.tensors[1].chunks[0].storage.relative_path == "__0_0.distcp"
    assert sorted((replica.key.fqn, replica.storage.relative_path)
                  for replica in opened.replicas) == sorted(
        (fqn, f"__{rank}_0.distcp") for rank in (1, 2)
        for fqn in ("model.b", "model.e", "step", "rank_state.rank", "rank_state.noise"))
    report = verify_checkpoint(checkpoint)
    assert report.status == "ok" and report.items_checked == 6 + 2 + 10
    # no damage, each rank loads its own: but reshard and convert keep rank 0's
    assert report.divergent_copies == [
        f"rank_state.{name} (__{rank}_0.distcp)" for rank in (1, 2) for name in ("rank", "noise")]
    assert report.bytes_read == sum(path.stat().st_size for path in checkpoint.glob("*.distcp"))


def test_reshard_and_convert_write_it_with_one_metadata_that_torch_loads(checkpoint, tmp_path):
    full = _full_tensors()
    outputs = {workers: tmp_path / f"resharded-{workers}" for workers in (1, 2)}
    for workers, output in outputs.items():
        result = run_dcpctl("reshard", checkpoint, "--ranks", 2, "-o", output,
                            "--workers", workers)
        assert result.returncode == 0, result.stderr
    assert directory_state(outputs[1]) == directory_state(outputs[2])
    loaded = load_with_torch(outputs[1])
    assert sorted(loaded) == sorted([*full, "step", "rank_state.rank", "rank_state.noise"])
    assert all(torch.equal(loaded[fqn], value) for fqn, value in full.items())
    assert (loaded["step"], loaded["rank_state.rank"]) == (7, 0)  # the lowest rank's
    assert torch.equal(loaded["rank_state.noise"], torch.zeros(2))
    assert "5 items several ranks saved (use_collectives=False): each written from the lowest " \
        "rank's copy" in result.stdout
    assert verify_checkpoint(outputs[1]).status == "ok"
    result = run_dcpctl("convert", checkpoint, "--to", "safetensors", "-o", tmp_path / "st")
    assert result.returncode == 0, result.stderr
    from safetensors.torch import load_file

    converted = load_file(tmp_path / "st" / "model.safetensors")
    assert converted.keys() == {*full, "rank_state.noise"}
    assert all(torch.equal(converted[fqn], value) for fqn, value in full.items())


def test_compress_and_decompress_refuse_it_naming_reshard(checkpoint, tmp_path):
    before = directory_state(checkpoint)
    for args, codec in ((["compress", checkpoint], "zstd"),
                        (["compress", checkpoint, "-o", tmp_path / "z", "--codec", "floatsplit"],
                         "floatsplit"),
                        (["decompress", checkpoint, "-o", tmp_path / "d"], "none")):
        result = run_dcpctl(*args)
        assert result.returncode == 1 and "Traceback" not in result.stderr
        assert result.stderr == (
            f"Error: {checkpoint}: saved with use_collectives=False (__0.metadata, ...: each "
            "rank's own metadata, and no .metadata); compress and decompress keep a "
            "checkpoint's layout and do not rewrite this one. reshard reads it and writes it "
            "with one .metadata, which torch loads at any world size, in any codec: "
            f"`dcpctl reshard {checkpoint} --ranks 3 -o OUT --codec {codec}`\n")
    assert directory_state(checkpoint) == before
    assert not (tmp_path / "z").exists() and not (tmp_path / "d").exists()


def test_a_damaged_replica_is_damage_though_no_command_reads_it(checkpoint):
    """Rank 2 loads its own copy of the replicated tensor: a flipped bit there is damage."""
    from dcpctl.format.torch_save.layout import find_payload_start

    replica = next(replica for replica in open_checkpoint(checkpoint).replicas
                   if replica.key.fqn == "model.b" and replica.storage.relative_path
                   == "__2_0.distcp")
    data = (checkpoint / "__2_0.distcp").read_bytes()
    start = replica.storage.offset
    flip_bit(checkpoint / "__2_0.distcp",
             start + find_payload_start(data[start:start + replica.storage.length]))
    report = verify_checkpoint(checkpoint)
    assert report.status == "damaged"
    assert [(problem.rule, problem.file, problem.fqns) for problem in report.problems] == [
        ("crc-mismatch", "__2_0.distcp", ("model.b",))]


def _rewrite_rank_metadata(checkpoint, rank: int, change) -> None:
    import torch.distributed.checkpoint  # noqa: F401  registers torch's classes

    path = checkpoint / f"__{rank}.metadata"
    metadata = pickle.loads(path.read_bytes())
    change(metadata)
    path.write_bytes(pickle.dumps(metadata))


def test_ranks_that_disagree_on_a_sharded_tensor_s_size_are_damage(checkpoint):
    _rewrite_rank_metadata(checkpoint, 1, lambda metadata: setattr(
        metadata.state_dict_metadata["model.w"], "size", torch.Size([10, 4])))
    report = verify_checkpoint(checkpoint)
    assert report.status == "damaged"
    assert [(problem.file, problem.message) for problem in report.problems] == [
        ("__1.metadata", "gives tensor 'model.w' dtype float32 and size [10, 4] where a lower "
         "rank's metadata gives float32 and [9, 4]")]


def _saved_buffers_of_their_own(rank: int, world_size: int, path: str) -> None:
    import torch.distributed.checkpoint as dcp

    dcp.save({"buf": torch.arange(3 + rank), "x": torch.ones(2, dtype=(
        torch.float32, torch.bfloat16)[rank % 2]), "w": torch.ones(3)},
        checkpoint_id=path, use_collectives=False)


def test_a_tensor_each_rank_saved_whole_with_its_own_shape_or_dtype_is_no_damage(tmp_path):
    """Per-rank buffers (each rank saves its own `buf`, of its own length or dtype) load back
    with torch at the world size that saved them: every command called the checkpoint damaged
    (`gives tensor 'buf' ... size [4] where a lower rank's metadata gives [3]`). Each rank's
    copy is checked against its own entry; the lowest rank's is kept."""
    from make_fixtures import run_gloo_job

    run_gloo_job(2, _saved_buffers_of_their_own, str(tmp_path / "ck"))
    report = verify_checkpoint(tmp_path / "ck")
    assert report.status == "ok" and report.items_checked == 6
    assert report.divergent_copies == ["buf (__1_0.distcp)", "x (__1_0.distcp)"]
    result = run_dcpctl("reshard", tmp_path / "ck", "--ranks", 1, "-o", tmp_path / "out")
    assert result.returncode == 0, result.stderr
    loaded = load_with_torch(tmp_path / "out")
    assert torch.equal(loaded["buf"], torch.arange(3)) and loaded["x"].dtype == torch.float32
    # a copy whose bytes are not what its own rank's entry says is damage
    _rewrite_rank_metadata(tmp_path / "ck", 1, lambda metadata: setattr(
        metadata.state_dict_metadata["buf"], "size", torch.Size([5])))
    _rewrite_rank_metadata(tmp_path / "ck", 1, lambda metadata: setattr(
        metadata.state_dict_metadata["buf"].chunks[0], "sizes", torch.Size([5])))
    report = verify_checkpoint(tmp_path / "ck")
    assert [(problem.rule, problem.file, problem.fqns) for problem in report.problems] == [
        ("tensor-mismatch", "__1_0.distcp", ("buf",))]


def _without_its_chunk_of_w(metadata) -> None:
    metadata.state_dict_metadata["model.w"].chunks.clear()
    for key in [key for key in metadata.storage_data if key.fqn == "model.w"]:
        del metadata.storage_data[key]


def test_a_chunk_only_one_rank_lost_is_a_gap(checkpoint):
    """Rank 2's metadata lost its chunk of the sharded tensor, entry and all: it still holds
    together, but the merged tensor has a gap."""
    _rewrite_rank_metadata(checkpoint, 2, _without_its_chunk_of_w)
    report = verify_checkpoint(checkpoint, deep=False)
    assert report.status == "damaged"
    assert any(problem.rule == "chunk-gap" and problem.fqns == ("model.w",)
               for problem in report.problems), report.problems


@pytest.mark.parametrize("missing", ["metadata of rank 1", "every file of rank 1",
                                     "rank 1 named a rank far past the others"])
def test_a_rank_that_has_not_written_its_metadata_makes_it_incomplete(checkpoint, missing):
    """A rank with data files but no metadata is still saving; so is one below the highest
    that wrote its metadata, which has written nothing yet. (A rank number of 12 digits is
    told at once, as any: no range of the ranks below it is made.)"""
    from dcpctl.ops.runs.listing import list_run_directory

    if missing.startswith("rank 1 named"):
        (checkpoint / "__1.metadata").rename(checkpoint / "__999999999999.metadata")
    for path in checkpoint.glob("__1*" if missing.startswith("every") else "__1.metadata"):
        path.unlink()
    with pytest.raises(IncompleteCheckpointError) as raised:
        open_checkpoint(checkpoint)
    assert raised.value.message == (
        "incomplete checkpoint saved with use_collectives=False: rank 1 has not written its "
        "__1.metadata (a save still running, or one that died before finishing)")
    assert verify_checkpoint(checkpoint).status == "incomplete"
    checkpoint.rename(checkpoint.parent / "step-1")
    assert [row.state for row in list_run_directory(checkpoint.parent).checkpoints] == [
        "incomplete"]


def test_checksum_covers_each_rank_s_metadata(checkpoint):
    result = run_dcpctl("checksum", checkpoint)
    assert result.returncode == 0, result.stderr
    listed = [line.split()[1] for line in (checkpoint / "SHA256SUMS").read_text().splitlines()]
    assert listed == ["__0.metadata", "__0_0.distcp", "__1.metadata", "__1_0.distcp",
                      "__2.metadata", "__2_0.distcp"]
    assert verify_checkpoint(checkpoint).status == "ok"
    flip_bit(checkpoint / "__2.metadata", (checkpoint / "__2.metadata").stat().st_size - 2)
    report = verify_checkpoint(checkpoint, deep=False)
    assert report.status == "damaged"
    assert "__2.metadata" in {problem.file for problem in report.problems}


def test_prune_keeps_and_deletes_them_as_any_and_takes_each_rank_s_metadata_first(
        saved, tmp_path, monkeypatch):
    """ls called them unreadable and prune never deleted one; a deletion cut short must leave
    one incomplete, so every rank's metadata goes before its data."""
    from conftest import fail_deletion_part_way

    from dcpctl.ops.runs.listing import list_run_directory
    from dcpctl.ops.runs.prune import RetentionRules, prune_run_directory

    run_dir = tmp_path / "run"
    for step in (1, 2, 3):
        shutil.copytree(saved, run_dir / f"step-{step}")
    assert [row.state for row in list_run_directory(run_dir).checkpoints] == ["complete"] * 3
    fail_deletion_part_way(monkeypatch, "step-2")
    report = prune_run_directory(run_dir, RetentionRules(keep_last=1))
    assert [(decision.checkpoint.name, decision.status) for decision in report.decisions] == [
        ("step-1", "deleted"), ("step-2", "failed"), ("step-3", "kept")]
    assert sorted(path.name for path in run_dir.iterdir()) == ["step-2", "step-3"]
    assert sorted(path.name for path in (run_dir / "step-2").iterdir()) == [
        "__1_0.distcp", "__2_0.distcp"]
    assert [row.state for row in list_run_directory(run_dir).checkpoints] == [
        "incomplete", "complete"]


def test_in_a_bucket_it_is_read_resharded_and_loaded_as_one(saved, s3_server, tmp_path):
    """On S3 (moto and rclone), every rank's metadata comes from the one listing; the reshard
    loads through dcpctl.storage_reader, which also gives torch a rank's own metadata."""
    from conftest import load_with_dcpctl_reader, upload_directory

    bucket = s3_server.new_bucket()
    url = upload_directory(s3_server, saved, bucket, "run/step-1")
    result = run_dcpctl("verify", url, "--json")
    assert result.returncode == 0, result.stderr
    assert '"items_checked":18' in result.stdout
    result = run_dcpctl("reshard", url, "--ranks", 2, "-o", f"s3://{bucket}/out")
    assert result.returncode == 0, result.stderr
    loaded = load_with_dcpctl_reader(f"s3://{bucket}/out")
    assert all(torch.equal(loaded[fqn], value) for fqn, value in _full_tensors().items())
    result = run_dcpctl("compress", url)
    assert result.returncode == 1 and "use_collectives=False" in result.stderr
    upload_directory(s3_server, saved, bucket, "one-rank")
    client = s3_server.client()
    for rank in (1, 2):
        for name in (f"__{rank}.metadata", f"__{rank}_0.distcp"):
            client.delete_object(Bucket=bucket, Key=f"one-rank/{name}")
    # torch's load in one process reads rank 0's own metadata: its rows of the sharded tensor
    loaded = load_with_dcpctl_reader(f"s3://{bucket}/one-rank")
    assert torch.equal(loaded["model.b"], _full_tensors()["model.b"])


@pytest.mark.parametrize("damage", ["chunks cleared", "key renamed"])
def test_a_rank_whose_own_metadata_does_not_join_is_damage(checkpoint, damage):
    """Merged with the others', rank 1's metadata passed: its replicated tensor's chunk gone
    (torch's load left that rank's copy unset) or its key named for another tensor (torch's
    load failed with a KeyError) were taken for replicas, and verify said ok."""
    def change(metadata):
        if damage == "chunks cleared":
            metadata.state_dict_metadata["model.b"].chunks.clear()
            return
        key = next(key for key in metadata.storage_data if key.fqn == "model.b")
        info = metadata.storage_data.pop(key)
        metadata.storage_data[type(key)("model.w", torch.Size([3, 0]), 0)] = info

    _rewrite_rank_metadata(checkpoint, 1, change)
    report = verify_checkpoint(checkpoint)
    assert report.status == "damaged"
    messages = [(problem.file, problem.message) for problem in report.problems]
    assert messages == [("__1.metadata", "has a storage entry for the chunk of 'model.b' at [0], "
                         "which it does not hold") if damage == "chunks cleared" else
                        ("__1.metadata", "gives the chunk of 'model.b' at [0] no storage entry")]


@pytest.mark.parametrize("copied", [False, True])
def test_a_rank_s_metadata_placing_items_in_another_rank_s_file_is_refused_by_name(
        checkpoint, tmp_path, copied):
    """Rank 1's chunk placed in rank 0's file, or rank 2's metadata copied as a rank 3 with no
    files of its own, were told only as items sharing bytes, naming no rank's metadata (and
    inspect showed the copy as a fourth rank)."""
    if copied:
        shutil.copyfile(checkpoint / "__2.metadata", checkpoint / "__3.metadata")
        at_fault, said = "__3.metadata", "places object 'step' in '__2_0.distcp'"
    else:
        def change(metadata):
            key = next(key for key in metadata.storage_data if key.fqn == "model.w")
            metadata.storage_data[key].relative_path = "__0_0.distcp"

        _rewrite_rank_metadata(checkpoint, 1, change)
        at_fault, said = "__1.metadata", "places the chunk of 'model.w' at [3, 0] in '__0_0.distcp'"
    rank = at_fault[2]
    report = verify_checkpoint(checkpoint, deep=False)
    assert [(problem.rule, problem.file, problem.message) for problem in report.problems] == [
        ("metadata", at_fault, f"{said}, not a file of rank {rank}: torch's writer puts each "
         f"rank's items in its own files (__{rank}_<n>.distcp)")]
    result = run_dcpctl("reshard", checkpoint, "--ranks", 2, "-o", tmp_path / "out")
    assert result.returncode == 1 and f"{checkpoint / at_fault}: {said}" in result.stderr
    assert not (tmp_path / "out").exists()


def test_a_rank_written_with_a_leading_zero_is_no_rank_s_metadata(checkpoint):
    """`__00.metadata` beside `__0.metadata` was merged as a second rank 0 (inspect said 4
    ranks, verify found items sharing bytes); torch names rank 0's file `__0.metadata` and
    reads no other, so it is a stray file."""
    shutil.copyfile(checkpoint / "__0.metadata", checkpoint / "__00.metadata")
    assert open_checkpoint(checkpoint).rank_metadata == [
        "__0.metadata", "__1.metadata", "__2.metadata"]
    report = verify_checkpoint(checkpoint, deep=False)
    assert [(problem.rule, problem.file) for problem in report.problems] == [
        ("unknown-file", "__00.metadata")]


def test_a_larger_save_s_leftovers_beside_a_whole_one_are_never_pruned(saved, tmp_path):
    """A 4-rank save into the directory, then a 3-rank one: torch's writer leaves rank 3's
    data file, and torch loads the 3 ranks' own at world size 3. Taken for a save cut short,
    prune --incomplete-older-than deleted the checkpoint."""
    from conftest import back_date

    from dcpctl.ops.runs.prune import RetentionRules, prune_run_directory

    run_dir = tmp_path / "run"
    for step in (1, 2):
        shutil.copytree(saved, run_dir / f"step-{step}")
    shutil.copyfile(saved / "__2_0.distcp", run_dir / "step-1" / "__3_0.distcp")
    back_date(run_dir / "step-1", 30 * 86400)
    with pytest.raises(IncompleteCheckpointError) as raised:
        open_checkpoint(run_dir / "step-1")
    assert raised.value.message.endswith(
        "rank 3 has not written its __3.metadata (a save still running, or one that died "
        "before finishing; or files left by an earlier save into this directory with more "
        "ranks, beside a whole save of 3 ranks, which torch loads at that world size: move the "
        "files of the ranks without metadata away to read it)")
    report = prune_run_directory(run_dir, RetentionRules(keep_last=1,
                                                         incomplete_older_than_seconds=3600))
    decision = report.decisions[0]
    assert (decision.checkpoint.name, decision.state, decision.delete) == (
        "step-1", "incomplete", False)
    assert decision.reasons[0].startswith("unsure: rank 3 has data files but no __3.metadata")
    assert (run_dir / "step-1" / "__0.metadata").exists()


def _saved_with_collectives(rank: int, world_size: int, path: str) -> None:
    import torch.distributed.checkpoint as dcp

    dcp.save({"model": {"w": torch.full((4,), float(rank))}, "step": 3}, checkpoint_id=path)


def test_a_directory_two_kinds_of_save_wrote_into_is_never_taken_for_the_newest(
        saved, tmp_path):
    """torch's writers leave the other kind of metadata in place: a save with
    use_collectives=False into a directory of a collective save left `.metadata` describing
    data files it overwrote. ls called it complete, and prune --keep-last 1 deleted the one
    checkpoint torch could load, keeping this one, whose `.metadata` torch fails to load."""
    from make_fixtures import run_gloo_job

    from dcpctl.ops.runs.listing import list_run_directory
    from dcpctl.ops.runs.prune import RetentionRules, prune_run_directory

    collective = tmp_path / "collective"
    run_gloo_job(WORLD_SIZE, _saved_with_collectives, str(collective))
    run_dir = tmp_path / "run"
    shutil.copytree(saved, run_dir / "step-1")
    shutil.copytree(collective, run_dir / "step-2")  # then a save without collectives
    shutil.copytree(saved, run_dir / "step-2", dirs_exist_ok=True)
    shutil.copytree(saved, run_dir / "step-3")  # then a collective save
    shutil.copytree(collective, run_dir / "step-3", dirs_exist_ok=True)
    rows = list_run_directory(run_dir).checkpoints
    assert [row.state for row in rows] == ["complete", "incomplete", "incomplete"]
    for row in rows[1:]:
        assert row.entry.doubt.startswith(
            "holds .metadata and __0.metadata and 2 more, the ranks' own metadata of a save "
            "with use_collectives=False: two saves wrote into it")
    before = directory_state(run_dir)
    for rules in (RetentionRules(keep_last=1),
                  RetentionRules(keep_last=1, incomplete_older_than_seconds=0)):
        report = prune_run_directory(run_dir, rules)
        assert [decision.delete for decision in report.decisions] == [False] * 3
        for decision in report.decisions[1:]:  # it said, too, "deleted only with ..."
            assert len(decision.reasons) == 1 and decision.reasons[0].startswith("unsure: ")
    assert directory_state(run_dir) == before
    problems = verify_checkpoint(run_dir / "step-3", deep=False).problems
    assert [(problem.rule, problem.file) for problem in problems] == [
        ("unknown-file", f"__{rank}.metadata") for rank in range(WORLD_SIZE)]
    assert "a rank's own metadata, of a save with use_collectives=False" in problems[0].message


def _saved_as_safetensors(rank: int, world_size: int, path: str) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint.filesystem import SerializationFormat

    dcp.save({"same": torch.ones(3), "own": torch.full((3,), float(rank)), "also": torch.ones(2)},
             storage_writer=FileSystemWriter(
                 path, serialization_format=SerializationFormat.SAFETENSORS),
             use_collectives=False)


def test_copies_in_safetensors_files_are_compared_by_their_bytes(tmp_path):
    """A SAFETENSORS file's tensors all give the offset of its one blob: copies were keyed by
    that offset and compared with another tensor's, and none of a differing tensor's were
    told. Under --quick nothing is compared: null, not an empty list."""
    from make_fixtures import run_gloo_job

    run_gloo_job(2, _saved_as_safetensors, str(tmp_path / "ck"))
    for workers in (1, 2):
        report = verify_checkpoint(tmp_path / "ck", workers=workers)
        assert report.status == "ok" and report.divergent_copies == ["own (__1_0.distcp)"]
    assert verify_checkpoint(tmp_path / "ck", deep=False).to_json()["divergent_copies"] is None

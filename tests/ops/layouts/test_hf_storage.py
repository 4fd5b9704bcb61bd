"""Checkpoints torch's HuggingFaceStorageWriter writes from a 3-rank FSDP2 job, each rank's
chunks in its own safetensors file (and, consolidated, whole tensors beside them): inspect,
verify, checksum, convert and reshard read them as torch's HuggingFaceStorageReader does."""

from __future__ import annotations

import json
import re
import shutil
import struct

import pytest
import torch
from conftest import load_with_torch, torch_metadata
from make_fixtures import TinyModel, fully_sharded_tiny_model, run_gloo_job
from safetensors.torch import load_file

from dcpctl.errors import DataError, InvalidOptionError, UnsupportedLayoutError
from dcpctl.ops.checksum import checksum_checkpoint
from dcpctl.ops.convert.targets import convert_checkpoint
from dcpctl.ops.inspection.report import inspect_checkpoint
from dcpctl.ops.reshard.execution import reshard_checkpoint
from dcpctl.ops.verify.verifier import verify_checkpoint

pytestmark = pytest.mark.slow
SHARD = "shard-{:05d}-model-00001-of-00001.safetensors"


def _save(rank: int, world_size: int, path: str, consolidate: bool) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageWriter
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    model = fully_sharded_tiny_model(world_size)
    dcp.save(get_model_state_dict(model), storage_writer=HuggingFaceStorageWriter(
        path, save_distributed=True, enable_consolidation=consolidate))


@pytest.fixture(scope="module")
def saves(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf_storage")
    for name, consolidate in (("sharded", False), ("consolidated", True)):
        run_gloo_job(3, _save, str(root / name), consolidate)
    return root


@pytest.fixture(scope="module")
def expected():
    torch.manual_seed(0)
    return TinyModel().state_dict()


def _equal(loaded: dict, expected: dict) -> bool:
    return loaded.keys() == expected.keys() and all(
        torch.equal(loaded[name], value) for name, value in expected.items())


@pytest.mark.parametrize("name", ["sharded", "consolidated"])
def test_inspect_and_verify_read_what_torchs_reader_reads(saves, expected, name):
    report = inspect_checkpoint(saves / name)
    assert {tensor.fqn: tensor.shape for tensor in report.tensors} == {
        fqn: tuple(value.shape) for fqn, value in expected.items()}
    kind = "each rank's chunks" if name == "sharded" else "consolidated"
    assert report.layout == (f"torch HuggingFaceStorageWriter, {kind} (model weights at the "
                             "top level)")
    verified = verify_checkpoint(saves / name)
    assert verified.status == "ok", verified.problems


def test_a_hugging_face_directorys_other_files_are_not_unknown_but_stray_shards_are(saves,
                                                                                    tmp_path):
    directory = shutil.copytree(saves / "consolidated", tmp_path / "hub")
    (directory / "config.json").write_text("{}")
    (directory / "tokenizer.json").write_text("{}")
    assert verify_checkpoint(directory).status == "ok"
    (directory / "old").mkdir()
    shutil.copy(directory / "model-00001-of-00001.safetensors", directory / "old")
    problems = verify_checkpoint(directory).problems
    assert [(problem.rule, problem.file) for problem in problems] == [
        ("unknown-file", "old/model-00001-of-00001.safetensors")]


@pytest.mark.parametrize("name", ["sharded", "consolidated"])
def test_convert_to_safetensors_and_torch_give_the_whole_tensors(saves, expected, tmp_path,
                                                                 name):
    convert_checkpoint(saves / name, "safetensors", tmp_path / "hf")
    assert _equal(load_file(tmp_path / "hf" / "model.safetensors"), expected)
    convert_checkpoint(saves / name, "torch", tmp_path / "model.pt")
    assert _equal(torch.load(tmp_path / "model.pt", weights_only=True), expected)


def test_reshard_and_convert_to_dcp_write_what_stock_torch_loads(saves, expected, tmp_path):
    reshard_checkpoint(saves / "sharded", 2, str(tmp_path / "resharded"))
    assert _equal(load_with_torch(tmp_path / "resharded"), expected)
    report = convert_checkpoint(saves / "sharded", "dcp", tmp_path / "converted", ranks=2)
    assert (report.tensors, report.ranks) == (len(expected), 2)
    assert _equal(load_with_torch(tmp_path / "converted"), expected)


def test_the_one_file_of_a_save_from_one_process_converts_to_dcp(expected, tmp_path):
    """With its defaults, torch's writer saves from one process into
    `model-00001-of-00001.safetensors`, its tensors placed by DCP_SHARDING_INFO at offset 0:
    convert --to dcp took it for one rank's file of a sharded save and refused it."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageWriter

    dcp.save(expected, storage_writer=HuggingFaceStorageWriter(str(tmp_path / "hf")),
             no_dist=True)
    convert_checkpoint(tmp_path / "hf", "dcp", tmp_path / "converted", ranks=2)
    assert _equal(load_with_torch(tmp_path / "converted"), expected)


def test_one_ranks_file_alone_or_a_prefix_is_refused(saves, tmp_path):
    with pytest.raises(UnsupportedLayoutError, match="holds one rank's chunks"):
        convert_checkpoint(saves / "sharded" / SHARD.format(1), "dcp", tmp_path / "one")
    with pytest.raises(InvalidOptionError, match="--prefix does not apply"):
        convert_checkpoint(saves / "sharded", "dcp", tmp_path / "prefixed", prefix="model.")
    assert not (tmp_path / "one").exists() and not (tmp_path / "prefixed").exists()


def test_a_save_whose_consolidation_did_not_run_points_to_its_rank_files(
        saves, tmp_path, run_cli):
    """A job stopped before it consolidated leaves only `sharded/`: dcpctl said "not a DCP
    checkpoint: no .metadata", which sent users looking for a `.metadata` torch never writes."""
    half = tmp_path / "half"
    shutil.copytree(saves / "consolidated" / "sharded", half / "sharded")
    for command in (["inspect"], ["verify"], ["convert", "--to", "dcp", "-o", tmp_path / "out"]):
        result = run_cli(command[0], half, *command[1:])
        assert result.exit_code == 1, result.output
        assert "holds the ranks' files of a torch HuggingFaceStorageWriter save" in \
            result.output and f"give {half / 'sharded'} to read them" in result.output
    assert run_cli("verify", half / "sharded").exit_code == 0
    assert not (tmp_path / "out").exists()


def test_a_missing_ranks_file_and_damage_are_found(saves, tmp_path):
    gap = shutil.copytree(saves / "sharded", tmp_path / "gap")
    (gap / SHARD.format(2)).unlink()
    report = verify_checkpoint(gap)
    assert report.status == "damaged"
    assert "none of shard 2: a rank's file is missing" in report.problems[0].message
    truncated = shutil.copytree(saves / "sharded", tmp_path / "truncated")
    with open(truncated / SHARD.format(3), "r+b") as file:
        file.truncate(file.seek(0, 2) - 4)
    problem = verify_checkpoint(truncated).problems[0]
    assert problem.file == SHARD.format(3) and "do not hold" in problem.message
    flipped = shutil.copytree(saves / "sharded", tmp_path / "flipped")
    checksum_checkpoint(flipped)
    data = bytearray((flipped / SHARD.format(1)).read_bytes())
    data[-1] ^= 0x40
    (flipped / SHARD.format(1)).write_bytes(bytes(data))
    problems = verify_checkpoint(flipped).problems
    assert [(problem.rule, problem.file) for problem in problems] == [
        ("checksum-mismatch", SHARD.format(1))]


def test_a_consolidated_tensor_that_is_not_what_the_ranks_saved_is_found(saves, tmp_path):
    """Safetensors has no checksum: a consolidated file that differs from the ranks' files
    it was made from (kept in sharded/) read as sound."""
    directory = shutil.copytree(saves / "consolidated", tmp_path / "changed")
    assert verify_checkpoint(directory).status == "ok"
    model = directory / "model-00001-of-00001.safetensors"
    (length,) = struct.unpack("<Q", model.read_bytes()[:8])
    entry = json.loads(model.read_bytes()[8:8 + length])["proj.weight"]
    data = bytearray(model.read_bytes())
    data[8 + length + entry["data_offsets"][0] + 4 * 7] ^= 0x01  # element [1, 1] of 6 columns
    model.write_bytes(bytes(data))
    report = verify_checkpoint(directory)
    assert [(problem.rule, problem.file, problem.fqns) for problem in report.problems] == [
        ("consolidation", "model-00001-of-00001.safetensors", ("proj.weight",))]
    assert report.problems[0].message.startswith("element [1, 1] differs from what sharded/")
    assert verify_checkpoint(directory, deep=False).status == "ok"  # values are not read
    shutil.rmtree(directory / "sharded")
    assert verify_checkpoint(directory).status == "ok"  # nothing to compare with


def _save_a_scalar(rank: int, world_size: int, path: str) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageWriter

    dcp.save({"scale": torch.tensor(1.5), "weight": torch.arange(4.0)},
             storage_writer=HuggingFaceStorageWriter(path, save_distributed=True,
                                                     enable_consolidation=True))


def test_a_scalar_that_torchs_consolidation_lost_is_found(tmp_path):
    """torch 2.13's consolidation writes a 0-dim tensor as zero (a learnable temperature, say),
    where the ranks' files hold its value; verify said ok."""
    run_gloo_job(2, _save_a_scalar, str(tmp_path / "hf"))
    consolidated = load_file(tmp_path / "hf" / "model-00001-of-00001.safetensors")
    report = verify_checkpoint(tmp_path / "hf")
    if consolidated["scale"].item() == 1.5:  # a torch that consolidates scalars soundly
        assert report.status == "ok", report.problems
    else:
        assert [(problem.rule, problem.fqns) for problem in report.problems] == [
            ("consolidation", ("scale",))]


def _rewrite_sharding_info(path, edit) -> None:
    data = path.read_bytes()
    (length,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + length])
    info = json.loads(header["__metadata__"]["DCP_SHARDING_INFO"])
    header["__metadata__"]["DCP_SHARDING_INFO"] = edit(info)
    encoded = json.dumps(header).encode()
    encoded += b" " * (-len(encoded) % 8)
    path.write_bytes(struct.pack("<Q", len(encoded)) + encoded + data[8 + length:])


@pytest.mark.parametrize("edit,message", [
    (lambda info: "not json", "is not a JSON object of chunk offsets"),
    (lambda info: json.dumps({**info, "embed.weight": {"saved_offsets": [-1, 0]}}),
     "gives tensor 'embed.weight' no 2 non-negative saved_offsets"),
    (lambda info: json.dumps({key: value for key, value in info.items() if key != "proj.bias"}),
     "gives tensor 'proj.bias' no 1 non-negative saved_offsets"),
    (lambda info: json.dumps({**info, "embed.weight": {"saved_offsets": [0, 0]}}),
     "chunk at \\[0, 0\\] that shard-00001"),
])
def test_hostile_sharding_info_is_refused_naming_the_file(saves, tmp_path, edit, message):
    hostile = shutil.copytree(saves / "sharded", tmp_path / "hostile")
    _rewrite_sharding_info(hostile / SHARD.format(2), edit)
    problem = verify_checkpoint(hostile).problems[0]
    assert problem.file == SHARD.format(2) and re.search(message, problem.message)


def test_an_index_that_misplaces_a_tensor_is_found(saves, tmp_path):
    directory = shutil.copytree(saves / "consolidated", tmp_path / "misplaced")
    index = json.loads((directory / "model.safetensors.index.json").read_text())
    index["weight_map"]["proj.bias"] = "model-00002-of-00002.safetensors"
    (directory / "model.safetensors.index.json").write_text(json.dumps(index))
    problem = verify_checkpoint(directory).problems[0]
    assert problem.file == "model.safetensors.index.json"
    assert problem.message == ("weight_map puts 'proj.bias' in "
                               "'model-00002-of-00002.safetensors', but "
                               "model-00001-of-00001.safetensors holds it")


def test_a_consolidated_file_gone_is_found_by_its_index(expected, tmp_path):
    """Saved over three files, one deleted: its tensors were simply not there, so verify said
    ok and convert and reshard wrote the checkpoint without them, exit 0."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageWriter

    names = sorted(expected)
    dcp.save(expected, storage_writer=HuggingFaceStorageWriter(
        str(tmp_path / "hf"), fqn_to_index_mapping={name: 1 + index % 3 for index, name
                                                    in enumerate(names)}), no_dist=True)
    (tmp_path / "hf" / "model-00002-of-00003.safetensors").unlink()
    problem = verify_checkpoint(tmp_path / "hf").problems[0]
    assert problem.file == "model.safetensors.index.json"
    assert problem.message == (f"weight_map puts {names[1]!r} in "
                               "'model-00002-of-00003.safetensors', which is not there")
    with pytest.raises(DataError, match="which is not there"):
        convert_checkpoint(tmp_path / "hf", "safetensors", tmp_path / "converted")
    assert not (tmp_path / "converted").exists()


def test_a_consolidated_save_in_several_files_is_resharded_as_fsdp2_shards_it(
        expected, tmp_path):
    """A consolidated save split over several model-i-of-N files was taken for one of
    several ranks, its whole tensors for tensors every rank held whole: reshard --ranks 2
    wrote each whole into both rank files, where FSDP2 splits them along dim 0, as it does the
    same tensors from a single file."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageWriter

    names = sorted(expected)
    for files in (1, 3):
        dcp.save(expected, storage_writer=HuggingFaceStorageWriter(
            str(tmp_path / f"hf{files}"), fqn_to_index_mapping={
                name: 1 + index % files for index, name in enumerate(names)}), no_dist=True)
        reshard_checkpoint(tmp_path / f"hf{files}", 2, tmp_path / f"out{files}")
    layouts = [{fqn: [(list(chunk.offsets), list(chunk.sizes)) for chunk in entry.chunks]
                for fqn, entry in torch_metadata(tmp_path / f"out{files}").state_dict_metadata
                .items()} for files in (1, 3)]
    assert layouts[0] == layouts[1]
    split = [fqn for fqn, tensor in expected.items() if tensor.dim() and tensor.shape[0] > 1]
    assert split and all(len(layouts[1][fqn]) == 2 for fqn in split)
    assert _equal(load_with_torch(tmp_path / "out3"), expected)


def test_a_dcp_save_that_died_stays_incomplete_whatever_else_lies_there(tmp_path):
    (tmp_path / "__0_0.distcp").write_bytes(b"partial")
    (tmp_path / "model.safetensors").write_bytes(b"unrelated")
    report = verify_checkpoint(tmp_path)
    assert report.status == "incomplete"

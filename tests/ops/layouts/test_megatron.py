"""Megatron-Core `torch_dist` checkpoints: every command reads them, and the checkpoints
dcpctl writes keep what Megatron's loader needs (common.pt, metadata.json, mcore_data) and
drop the save plans that describe the old layout."""

from __future__ import annotations

import hashlib
import pickle
import struct

import zipfile

import pytest
from conftest import load_with_torch
from megatron_saves import MCORE_DATA, save_megatron_like

from dcpctl.errors import DataError
from dcpctl.format.checkpoint.checksums import read_sha256sums
from dcpctl.format.checkpoint.problems import ProblemsError
from dcpctl.format.metadata.reading import read_metadata
from dcpctl.ops.checksum import checksum_checkpoint
from dcpctl.ops.inspection.report import inspect_checkpoint
from dcpctl.ops.reshard.execution import reshard_checkpoint
from dcpctl.ops.transcode import compress_checkpoint
from dcpctl.ops.verify.verifier import verify_checkpoint

SIDE_FILES = ("common.pt", "metadata.json")


@pytest.fixture(scope="module")
def megatron_saves(tmp_path_factory):
    root = tmp_path_factory.mktemp("megatron")
    return {"0.16": save_megatron_like(root / "plans"),
            "0.14": save_megatron_like(root / "plans_mcore_data", with_mcore_data=True)}


def _sha256(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _raw_metadata_attributes(checkpoint) -> dict:
    import torch.distributed.checkpoint  # noqa: F401  registers torch's classes

    return vars(pickle.loads((checkpoint / ".metadata").read_bytes()))


@pytest.mark.parametrize("version", ["0.16", "0.14"])
def test_inspect_and_verify_read_megatron_checkpoints(megatron_saves, version):
    source = megatron_saves[version]
    assert "all_local_plans" in _raw_metadata_attributes(source)
    report = inspect_checkpoint(source)
    assert {tensor.fqn for tensor in report.tensors} == {"decoder.weight", "decoder.bias"}
    assert report.layout.startswith("Megatron-Core torch_dist (model weights at the top level")
    verified = verify_checkpoint(source)
    assert verified.status == "ok", verified.problems
    # what it read: the items, and the side files it checked (left out of the figure before)
    items = sum(path.stat().st_size for path in source.glob("*.distcp"))
    side_files = sum((source / name).stat().st_size for name in ("common.pt", "metadata.json"))
    assert verified.bytes_read == items + side_files
    expected_mcore_data = MCORE_DATA if version == "0.14" else None
    assert read_metadata(source).mcore_data == expected_mcore_data


@pytest.mark.parametrize("version", ["0.16", "0.14"])
@pytest.mark.parametrize("command", ["compress", "reshard"])
def test_rewrites_carry_side_files_and_mcore_data_and_drop_save_plans(megatron_saves, tmp_path,
                                                                      version, command):
    source = megatron_saves[version]
    output = tmp_path / "out"
    if command == "compress":
        compress_checkpoint(source, output_path=str(output))
    else:
        reshard_checkpoint(source, 3, str(output))
    for name in SIDE_FILES:
        assert _sha256(output / name) == _sha256(source / name)
    sums = read_sha256sums(output)
    assert {name: sums[name] for name in SIDE_FILES} == {
        name: _sha256(source / name) for name in SIDE_FILES}
    attributes = _raw_metadata_attributes(output)
    assert "all_local_plans" not in attributes
    assert attributes.get("mcore_data") == (MCORE_DATA if version == "0.14" else None)
    assert verify_checkpoint(output).status == "ok"
    original, rewritten = load_with_torch(source), load_with_torch(output)
    assert original.keys() == rewritten.keys()
    for key, value in original.items():
        if hasattr(value, "equal"):
            assert value.equal(rewritten[key]), key
        else:
            assert value.getvalue() == rewritten[key].getvalue(), key


def test_compress_in_place_lists_side_files_in_sha256sums(megatron_saves, tmp_path):
    import shutil

    checkpoint = tmp_path / "ckpt"
    shutil.copytree(megatron_saves["0.16"], checkpoint)
    compress_checkpoint(checkpoint)
    sums = read_sha256sums(checkpoint)
    assert all(sums[name] == _sha256(checkpoint / name) for name in SIDE_FILES)
    assert verify_checkpoint(checkpoint).status == "ok"


def test_a_damaged_side_file_is_caught_by_its_checksum(megatron_saves, tmp_path):
    import shutil

    checkpoint = tmp_path / "ckpt"
    shutil.copytree(megatron_saves["0.16"], checkpoint)
    report = checksum_checkpoint(checkpoint)
    assert set(SIDE_FILES) <= set(report.digests)
    common = checkpoint / "common.pt"
    data = bytearray(common.read_bytes())
    data[len(data) // 2] ^= 0x10
    common.write_bytes(bytes(data))
    problems = verify_checkpoint(checkpoint).problems
    assert [(problem.rule, problem.file) for problem in problems] == [
        ("archive", "common.pt"), ("checksum-mismatch", "common.pt")]  # a header hit
    with pytest.raises(DataError, match="common.pt"):
        compress_checkpoint(checkpoint, output_path=str(tmp_path / "out"))
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("damage", ["a flipped bit", "cut short"])
def test_a_damaged_common_state_is_found_without_checksums(megatron_saves, tmp_path, damage):
    """common.pt is a torch.save archive: without SHA256SUMS its CRC-32s are all that tells
    damage, which verify passed, checksum certified and every command carried over."""
    import shutil

    checkpoint = tmp_path / "ckpt"
    shutil.copytree(megatron_saves["0.16"], checkpoint)
    common = checkpoint / "common.pt"
    data = bytearray(common.read_bytes())
    if damage == "a flipped bit":
        record = next(info for info in zipfile.ZipFile(common).infolist()
                      if info.filename.endswith("data.pkl"))
        name_bytes, extra_bytes = struct.unpack_from("<HH", data, record.header_offset + 26)
        data[record.header_offset + 30 + name_bytes + extra_bytes + 2] ^= 0x10
    else:
        del data[-200:]
    common.write_bytes(bytes(data))
    problems = verify_checkpoint(checkpoint).problems
    assert [(problem.rule, problem.file) for problem in problems] == [
        ("crc-mismatch" if damage == "a flipped bit" else "archive", "common.pt")]
    for attempt in (lambda: checksum_checkpoint(checkpoint),
                    lambda: compress_checkpoint(checkpoint, output_path=str(tmp_path / "out")),
                    lambda: compress_checkpoint(checkpoint)):
        with pytest.raises(DataError, match="common.pt"):
            attempt()
    assert not (tmp_path / "out").exists() and not (checkpoint / "SHA256SUMS").exists()
    assert common.read_bytes() == bytes(data)


@pytest.mark.parametrize("damage", ["cut", "utf-16", "a byte order mark", "empty object",
                                    "a version that is a string"])
def test_a_cut_megatron_config_is_found_without_checksums(megatron_saves, tmp_path, damage):
    import json
    import shutil

    checkpoint = tmp_path / "ckpt"
    shutil.copytree(megatron_saves["0.16"], checkpoint)
    config = checkpoint / "metadata.json"
    text = config.read_text()
    config.write_bytes({
        "cut": text[:len(text) // 2].encode(), "utf-16": text.encode("utf-16"),
        "a byte order mark": b"\xef\xbb\xbf" + text.encode(), "empty object": b"{}",
        "a version that is a string": json.dumps(
            {**json.loads(text), "sharded_backend_version": "1"}).encode()}[damage])
    problems = verify_checkpoint(checkpoint).problems
    assert [(problem.rule, problem.file) for problem in problems] == [
        ("decode", "metadata.json")]
    for attempt in (lambda: checksum_checkpoint(checkpoint),
                    lambda: compress_checkpoint(checkpoint, output_path=str(tmp_path / "out"))):
        with pytest.raises(DataError, match="metadata.json: decode: not the JSON object"):
            attempt()
    assert not (tmp_path / "out").exists() and not (checkpoint / "SHA256SUMS").exists()


def test_a_linked_side_file_is_neither_followed_nor_left_out(megatron_saves, tmp_path):
    """A link in common.pt's place is damage, not a file of no one's: compress -o left it out
    of its output, exit 0, where verify of the source called it an unknown file."""
    import shutil

    checkpoint = tmp_path / "ckpt"
    shutil.copytree(megatron_saves["0.16"], checkpoint)
    outside = tmp_path / "outside.pt"
    (checkpoint / "common.pt").rename(outside)
    (checkpoint / "common.pt").symlink_to(outside)
    before = outside.read_bytes()
    problems = verify_checkpoint(checkpoint).problems
    assert [(problem.rule, problem.file) for problem in problems] == [
        ("not-regular-file", "common.pt")]
    with pytest.raises(ProblemsError, match="common.pt is not a regular file here"):
        compress_checkpoint(checkpoint, output_path=str(tmp_path / "out"))
    assert not (tmp_path / "out").exists() and outside.read_bytes() == before


def _in_a_hub_cache(checkpoint, tmp_path):
    """A copy of checkpoint as huggingface_hub's cache holds a download: every file a link
    into its repository's blobs; (the repository, the checkpoint in its snapshot)."""
    import os
    import shutil

    repository = tmp_path / "hub" / "models--org--run"
    snapshot = repository / "snapshots" / "0123abcd" / "iter_0000010"
    snapshot.mkdir(parents=True)
    (repository / "blobs").mkdir()
    for source in checkpoint.iterdir():
        blob = repository / "blobs" / f"blob-{source.name.strip('.')}"
        shutil.copyfile(source, blob)
        (snapshot / source.name).symlink_to(os.path.relpath(blob, snapshot))
    return repository, snapshot


def test_side_files_in_the_hugging_face_hub_cache_are_its_blobs(megatron_saves, tmp_path):
    """huggingface_hub's cache makes every file of a download a link to its repository's
    blobs, as data files may be: a Megatron checkpoint downloaded there had its common.pt and
    metadata.json called not regular files, and no command would write a new checkpoint of
    it."""
    _, snapshot = _in_a_hub_cache(megatron_saves["0.16"], tmp_path)
    assert verify_checkpoint(snapshot).status == "ok"
    compress_checkpoint(snapshot, output_path=str(tmp_path / "out"))
    for name in ("common.pt", "metadata.json"):
        assert (tmp_path / "out" / name).read_bytes() == (snapshot / name).read_bytes()
        assert not (tmp_path / "out" / name).is_symlink()
    assert inspect_checkpoint(snapshot).layout.startswith("Megatron-Core torch_dist")


def test_a_hub_cache_checkpoint_with_sha256sums_is_sound_and_rewritten_in_place(
        megatron_saves, tmp_path):
    """SHA256SUMS listing a file that is a link into the repository's blobs (every file of a
    download) was damage: a checkpoint uploaded with its SHA256SUMS was refused by every
    command, and so was one after `dcpctl checksum` or an in-place compress there."""
    from conftest import directory_state

    from dcpctl.ops.transcode import decompress_checkpoint

    repository, snapshot = _in_a_hub_cache(megatron_saves["0.16"], tmp_path)
    blobs = directory_state(repository / "blobs")
    checksum_checkpoint(snapshot)
    assert sorted(read_sha256sums(snapshot)) == [
        ".metadata", "__0_0.distcp", "__1_0.distcp", "common.pt", "metadata.json"]
    assert verify_checkpoint(snapshot).status == "ok"
    compress_checkpoint(snapshot)
    assert verify_checkpoint(snapshot).status == "ok"
    decompress_checkpoint(snapshot)
    assert verify_checkpoint(snapshot).status == "ok"
    assert (snapshot / "common.pt").is_symlink()  # side files are left as they are
    assert directory_state(repository / "blobs") == blobs
    assert load_with_torch(snapshot).keys() == load_with_torch(megatron_saves["0.16"]).keys()

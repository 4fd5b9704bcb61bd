"""Damage in what a command reads is never passed on as good data: a flipped bit or a zeroed
hole in a tensor's payload (stored plain, inside a zstd frame, inside a floatsplit plane), or an
item that holds another shape than its chunk, stops every command that moves data, naming the
file and item; nothing is published and the source is left as it was. With SHA256SUMS in the
source, the mismatch is named before anything is read for the output."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from conftest import directory_state, flip_bit, run_dcpctl

from dcpctl.format.checkpoint.locations import locate_chunk
from dcpctl.format.checkpoint.view import open_checkpoint
from dcpctl.format.torch_save.layout import read_torch_save_layout

pytestmark = pytest.mark.slow  # a process per case
COMMANDS = [["compress", "--level", "5"], ["decompress"], ["checksum"],
            ["compress", "-o", "{out}"], ["compress", "--codec", "floatsplit", "-o", "{out}"],
            ["reshard", "--ranks", "3", "-o", "{out}"],
            ["convert", "--to", "safetensors", "-o", "{out}"],
            ["convert", "--to", "torch", "-o", "{out}.pt"]]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Plain, zstd and floatsplit copies of a checkpoint of a few 64 KiB bfloat16 tensors."""
    import torch.distributed.checkpoint as dcp

    root = tmp_path_factory.mktemp("saved")
    torch.manual_seed(5)
    state = {f"layer{index}.weight": torch.randn(256, 128).to(torch.bfloat16)
             for index in range(3)}
    dcp.save(state, storage_writer=dcp.FileSystemWriter(root / "plain"), no_dist=True)
    for codec in ("zstd", "floatsplit"):
        result = run_dcpctl("compress", root / "plain", "--codec", codec, "-o", root / codec)
        assert result.returncode == 0, result.stderr
    return root


def _payload_range(checkpoint, fqn: str) -> tuple[str, int, int]:
    """(file, start, end) of the stored bytes of fqn's item: its tensor data when plain."""
    opened = open_checkpoint(checkpoint)
    tensor = next(tensor for tensor in opened.tensors if tensor.fqn == fqn)
    location = locate_chunk(opened, tensor, tensor.chunks[0])
    if location.codec.descriptors:
        return location.path.name, location.start, location.end
    with open(location.path, "rb") as stream:
        def read_range(start, count):
            stream.seek(location.start + start)
            return stream.read(count)
        layout = read_torch_save_layout(read_range, location.length)
    start = location.start + layout.payload_offset
    return location.path.name, start, start + layout.tensor.nbytes


def _zero_a_hole(path, offset: int, length: int = 4096) -> None:
    with open(path, "r+b") as stream:
        stream.seek(offset)
        stream.write(bytes(length))


def _damaged_copy(saved, tmp_path, codec: str, damage: str):
    checkpoint = tmp_path / "ckpt"
    shutil.copytree(saved / codec, checkpoint)
    # without SHA256SUMS: the checks of each item as it is read must find the damage
    (checkpoint / "SHA256SUMS").unlink(missing_ok=True)
    name, start, end = _payload_range(checkpoint, "layer1.weight")
    middle = (start + end) // 2
    if damage == "a flipped bit":
        flip_bit(checkpoint / name, middle, 0x10)
    else:
        _zero_a_hole(checkpoint / name, middle - 2048, min(4096, end - start - 64))
    return checkpoint


@pytest.mark.parametrize("command", COMMANDS, ids=lambda command: " ".join(command[:3]))
@pytest.mark.parametrize("codec", ["plain", "zstd", "floatsplit"])
@pytest.mark.parametrize("damage", ["a flipped bit", "a zeroed hole"])
def test_damage_stops_the_command_and_nothing_is_published(saved, tmp_path, command, codec,
                                                           damage):
    checkpoint = _damaged_copy(saved, tmp_path, codec, damage)
    before = directory_state(checkpoint)
    args = [part.format(out=tmp_path / "out") for part in command]
    result = run_dcpctl(args[0], checkpoint, *args[1:])
    assert result.returncode == 1, (result.stdout, result.stderr)
    assert result.stderr.startswith(f"Error: {checkpoint}/") and len(
        result.stderr.splitlines()) == 1, result.stderr
    assert "'layer1.weight'" in result.stderr, result.stderr
    assert directory_state(checkpoint) == before
    assert sorted(path.name for path in tmp_path.iterdir()) == ["ckpt"]


@pytest.mark.parametrize("command", COMMANDS, ids=lambda command: " ".join(command[:3]))
def test_a_file_that_no_longer_matches_sha256sums_is_named_first(saved, tmp_path, command):
    checkpoint = tmp_path / "ckpt"
    shutil.copytree(saved / "plain", checkpoint)
    assert run_dcpctl("checksum", checkpoint).returncode == 0
    name, start, end = _payload_range(checkpoint, "layer1.weight")
    flip_bit(checkpoint / name, (start + end) // 2, 0x10)
    before = directory_state(checkpoint)
    args = [part.format(out=tmp_path / "out") for part in command]
    result = run_dcpctl(args[0], checkpoint, *args[1:])
    assert result.returncode == 1
    assert result.stderr.startswith(f"Error: {checkpoint}/{name}: ")
    assert "checksum-mismatch: SHA-256 is" in result.stderr
    assert directory_state(checkpoint) == before
    assert sorted(path.name for path in tmp_path.iterdir()) == ["ckpt"]


@pytest.mark.parametrize("command", COMMANDS, ids=lambda command: " ".join(command[:3]))
@pytest.mark.parametrize("loss", ["gone", "a symlink"])
def test_a_file_sha256sums_lists_that_is_gone_stops_the_command(saved, tmp_path, command, loss):
    """Where the metadata does not name a file (a trainer's side file, the shards of a
    checkpoint torch's HF writer left without `.metadata`), SHA256SUMS alone tells it is gone:
    the data commands went on, and an in-place compress wrote SHA256SUMS anew without it."""
    checkpoint = tmp_path / "ckpt"
    shutil.copytree(saved / "plain", checkpoint)
    torch.save({"iteration": 7}, checkpoint / "common.pt")  # Megatron's common state
    assert run_dcpctl("checksum", checkpoint).returncode == 0
    (checkpoint / "common.pt").rename(tmp_path / "elsewhere.pt")
    if loss == "a symlink":  # neither read nor carried: as good as gone
        (checkpoint / "common.pt").symlink_to(tmp_path / "elsewhere.pt")
    before = directory_state(checkpoint)
    args = [part.format(out=tmp_path / "out") for part in command]
    result = run_dcpctl(args[0], checkpoint, *args[1:])
    assert result.returncode == 1, result.stdout
    assert result.stderr == (f"Error: {checkpoint}/common.pt: " + (
        "missing-file: listed in SHA256SUMS but absent\n" if loss == "gone" else
        "not-regular-file: Megatron-Core torch_dist's common.pt is not a regular file here (a "
        "FIFO, a directory, or a symlink out of the checkpoint)\n"))
    assert directory_state(checkpoint) == before
    assert sorted(path.name for path in tmp_path.iterdir()) == ["ckpt", "elsewhere.pt"]


def test_an_item_holding_another_shape_than_its_chunk_is_refused(run_cli, tmp_path):
    """A 10 x 6 tensor saved whole, its metadata claiming 6 x 10: as many bytes, so only
    reading the item shows it."""
    import pickle

    import torch.distributed.checkpoint as dcp
    from conftest import torch_metadata

    checkpoint = tmp_path / "ckpt"
    dcp.save({"weight": torch.arange(60.0).reshape(10, 6)},
             storage_writer=dcp.FileSystemWriter(checkpoint), no_dist=True)
    metadata = torch_metadata(checkpoint)
    entry = metadata.state_dict_metadata["weight"]
    entry.size = torch.Size([6, 10])
    entry.chunks[0].sizes = torch.Size([6, 10])
    (checkpoint / ".metadata").write_bytes(pickle.dumps(metadata))
    before = directory_state(checkpoint)
    for command in COMMANDS:
        args = [part.format(out=tmp_path / "out") for part in command]
        result = run_cli(args[0], checkpoint, *args[1:])
        assert result.exit_code == 1, (command, result.output)
        assert "float32 tensor of shape [10, 6]" in result.output, (command, result.output)
        assert directory_state(checkpoint) == before
        assert sorted(path.name for path in tmp_path.iterdir()) == ["ckpt"]


def test_an_object_item_scrambled_past_recognition_is_refused(copy_fixture, run_cli, tmp_path):
    """torch's zstd frames carry no checksum: one flip in a frame's literals table decodes a
    non-tensor item to garbage that looks like no zip at either end. It was taken for an
    io.BytesIO's raw bytes and passed every check, though torch's load planner torch.loads
    every non-tensor item (its save planner torch.saves each one)."""
    import zstandard

    checkpoint = copy_fixture("zstd_fsdp2_2ranks")
    flip_bit(checkpoint / "__1_0.distcp", 4064 // 8, 1 << (4064 % 8))
    frame = (checkpoint / "__1_0.distcp").read_bytes()[468:468 + 467]
    decoded = zstandard.ZstdDecompressor().decompressobj().decompress(frame)
    assert not decoded.startswith(b"PK") and b"PK" not in decoded[-22:]  # no zip left
    before = directory_state(checkpoint)
    result = run_cli("verify", checkpoint, "--json")
    assert result.exit_code == 1
    assert "optim.param_groups.0.eps" in result.output and '"archive"' in result.output
    result = run_cli("decompress", checkpoint, "-o", tmp_path / "out")
    assert result.exit_code == 1 and "is not a torch.save archive" in result.output
    assert not (tmp_path / "out").exists() and directory_state(checkpoint) == before


@pytest.mark.parametrize("quick", [True, False], ids=["quick", "deep"])
@pytest.mark.parametrize("leading", ["out", "inside"])
def test_verify_names_a_listed_file_replaced_by_a_symlink_as_ls_and_the_commands_do(
        saved, tmp_path, quick, leading):
    """verify reported a listed file that became a symlink out as a fault of SHA256SUMS, where
    ls, prune and every data command name the file (checksums.absent_listed_files): one rule
    for all. A link inside the checkpoint may stand for a listed file, as for a data file (a
    hub cache's every file is a link); the file it leads to is then a file of its own."""
    checkpoint = tmp_path / "ckpt"
    shutil.copytree(saved / "plain", checkpoint)
    torch.save({"iteration": 7}, checkpoint / "common.pt")
    assert run_dcpctl("checksum", checkpoint).returncode == 0
    moved = (checkpoint if leading == "inside" else tmp_path) / "copy.pt"
    (checkpoint / "common.pt").rename(moved)
    (checkpoint / "common.pt").symlink_to(moved)
    result = run_dcpctl("verify", checkpoint, "--json", *(["--quick"] if quick else []))
    assert result.returncode == 1
    problems = {(problem["rule"], problem["file"])
                for problem in json.loads(result.stdout)["problems"]}
    assert problems == ({("not-regular-file", "common.pt")} if leading == "out"
                        else {("unknown-file", "copy.pt")})

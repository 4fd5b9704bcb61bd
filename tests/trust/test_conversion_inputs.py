"""What `convert` and `reshard` interpret (planner_data's key paths, objects they unpickle, the
files `convert --to dcp` reads, the bits torch keeps beside a tensor) is checked before anything
is written: no entry is dropped or changed without a word, nothing runs away."""

from __future__ import annotations

import json
import pickle
import struct
import zipfile

import pytest
import torch
import torch.distributed.checkpoint as dcp
import zstandard
from conftest import torch_metadata

SOURCE = "objects_2ranks"


@pytest.fixture
def checkpoint(copy_fixture):
    return copy_fixture(SOURCE)


def _with_planner_data(checkpoint, edit) -> None:
    metadata = torch_metadata(checkpoint)
    edit(metadata)
    (checkpoint / ".metadata").write_bytes(pickle.dumps(metadata))


def _renamed(metadata, fqn: str, new_fqn: str, key_path: tuple) -> None:
    """The entry fqn under a new name, key path and storage key, as a save that named it so
    would have written it."""
    from torch.distributed.checkpoint.metadata import MetadataIndex

    metadata.state_dict_metadata[new_fqn] = metadata.state_dict_metadata.pop(fqn)
    metadata.storage_data = {
        (MetadataIndex(new_fqn, key.offset, key.index) if key.fqn == fqn else key): info
        for key, info in metadata.storage_data.items()}
    del metadata.planner_data[fqn]
    metadata.planner_data[new_fqn] = key_path


@pytest.mark.parametrize("new_fqn, key_path, words", [
    ("config", ("config",), "another entry's value is at or under"),
    ("step.deeper", ("step", "deeper"), "runs through the value of"),
    ("weights.1000000000", ("weights", 10**9), "not a name or an index"),
    ("config.0", ("config", 0), "both a dict and a list"),
])
def test_key_paths_that_cannot_all_hold_their_values_are_refused(run_cli, tmp_path, checkpoint,
                                                                 new_fqn, key_path, words):
    """objects_2ranks nests `step`, `config.lr`, `config.nested.depth`, `history`...: the entry
    `history` is renamed so that its key path (which joins to its name, as torch's are) clashes
    with another's. Without the check, torch's way keeps one and drops the other."""
    _with_planner_data(checkpoint, lambda metadata: _renamed(metadata, "history", new_fqn,
                                                             key_path))
    result = run_cli("convert", checkpoint, "--to", "torch", "-o", tmp_path / "state.pt")
    assert result.exit_code == 1, result.output
    assert words in result.output and len(result.output.splitlines()) == 1
    assert not (tmp_path / "state.pt").exists()


def test_a_key_path_deeper_than_the_pickler_goes_is_refused(run_cli, tmp_path, checkpoint):
    """An entry nested 5,000 keys deep (its name 5,000 parts joined with dots) stopped
    convert --to torch on an internal RecursionError."""
    key_path = ("h",) * 5000
    _with_planner_data(checkpoint, lambda metadata: _renamed(metadata, "history",
                                                             ".".join(key_path), key_path))
    result = run_cli("convert", checkpoint, "--to", "torch", "-o", tmp_path / "state.pt")
    assert result.exit_code == 1, result.output
    assert "nests deeper than Python's pickler can write" in result.output
    assert len(result.output.splitlines()) == 1 and not (tmp_path / "state.pt").exists()


@pytest.mark.parametrize("command", [["verify"], ["compress", "-o", "{out}"],
                                     ["reshard", "--ranks", "2", "-o", "{out}"],
                                     ["convert", "--to", "torch", "-o", "{out}.pt"]])
def test_a_key_path_that_names_another_entry_is_refused(run_cli, tmp_path, checkpoint, command):
    """One damaged string in planner_data (a flipped bit: `config.name` nested as
    `config.nbme`) would have convert write the entry under a name the state dict never had,
    and verify call the checkpoint whole."""
    _with_planner_data(checkpoint, lambda metadata: metadata.planner_data.update(
        {"config.name": ("config", "nbme")}))
    args = [part.format(out=tmp_path / "out") for part in command]
    result = run_cli(args[0], checkpoint, *args[1:])
    assert result.exit_code == 1, result.output
    assert ("planner_data gives 'config.name' the key path ['config', 'nbme'], which names "
            "'config.nbme'") in result.output
    assert not list(tmp_path.glob("out*"))


@pytest.mark.parametrize("edit, words", [
    (lambda planner_data: planner_data.update({"config.lr": ("config", {"lr": 1})}),
     "but not each fqn (a name) to a key path of names and indices"),
    (lambda planner_data: planner_data.update({("config", "lr"): ("config", "lr")}),
     "but not each fqn (a name) to a key path of names and indices"),
], ids=["path-holds-a-dict", "key-not-a-name"])
def test_planner_data_damaged_past_its_form_is_refused(run_cli, tmp_path, checkpoint, edit,
                                                       words):
    """One flipped bit of a memo reference made a part of a key path, or a key, something else
    (a dict, a tuple): verify called it whole and compress passed it on."""
    _with_planner_data(checkpoint, lambda metadata: edit(metadata.planner_data))
    for command in (["verify"], ["compress", "-o", tmp_path / "out"]):
        result = run_cli(command[0], checkpoint, *command[1:])
        assert result.exit_code == 1 and words in result.output, result.output
    assert not (tmp_path / "out").exists()


def test_planner_data_that_is_not_a_mapping_is_refused(run_cli, tmp_path, checkpoint):
    _with_planner_data(checkpoint, lambda metadata: setattr(metadata, "planner_data", ["x"]))
    result = run_cli("convert", checkpoint, "--to", "torch", "-o", tmp_path / "state.pt")
    assert result.exit_code == 1 and "planner_data is not a mapping" in result.output


@pytest.mark.parametrize("start, words", [
    (b"PK\x03\x04", "more than 268435456 bytes"),  # starts as an archive: stopped at the bound
    (b"", "its bytes do not start with a zip record"),  # stopped at its first bytes
])
def test_an_object_that_decodes_to_gigabytes_is_refused_in_bounded_memory(run_cli, tmp_path,
                                                                          checkpoint, start,
                                                                          words):
    bomb = zstandard.ZstdCompressor().compress(start + bytes(1 << 30))
    metadata = torch_metadata(checkpoint)
    key = next(key for key in metadata.storage_data if key.offset is None)
    info = metadata.storage_data[key]
    with open(checkpoint / info.relative_path, "ab") as stream:
        info.offset, info.length = stream.tell(), len(bomb)
        stream.write(bomb)
    info.transform_descriptors = ["stream.zstd/1"]
    (checkpoint / ".metadata").write_bytes(pickle.dumps(metadata))
    result = run_cli("convert", checkpoint, "--to", "torch", "-o", tmp_path / "state.pt")
    assert result.exit_code == 1, result.output
    assert f"item {key.fqn!r}" in result.output and words in result.output


@pytest.mark.parametrize("deflated, padding", [("/data/", b""), ("data.pkl", bytes(256 << 20))],
                         ids=["storage-record", "data.pkl-bomb"])  # not 256 MiB in an ID
def test_a_torch_save_file_with_compressed_records_is_refused(run_cli, tmp_path, deflated,
                                                              padding):
    """A deflated storage record would be copied as the tensor's bytes; a deflated data.pkl can
    be a bomb (here 256 MiB of padding after the pickle) that torch.load inflates whole."""
    torch.save({"a": torch.randint(0, 256, (4096,), dtype=torch.uint8)}, tmp_path / "plain.pt")
    with zipfile.ZipFile(tmp_path / "plain.pt") as archive:
        pickled = next(name for name in archive.namelist() if name.endswith("data.pkl"))
        records = {name: archive.read(name) for name in archive.namelist()}
    records[pickled] += padding
    with zipfile.ZipFile(tmp_path / "source.pt", "w") as out:
        for name, data in records.items():
            out.writestr(zipfile.ZipInfo(name), data, compress_type=zipfile.ZIP_DEFLATED
                         if deflated in name else zipfile.ZIP_STORED)
    result = run_cli("convert", tmp_path / "source.pt", "--to", "dcp", "-o", tmp_path / "out")
    assert result.exit_code == 1, result.output
    assert "is compressed" in result.output and "torch.save never does" in result.output
    assert not (tmp_path / "out").exists()


def test_a_torch_save_file_holding_a_conjugate_or_negative_view_is_refused(run_cli, tmp_path):
    values = torch.randn(3, dtype=torch.complex64)
    for name, tensor in {"conj": values.conj(), "neg": values.conj().imag}.items():
        assert tensor.is_conj() or tensor.is_neg()
        torch.save({name: tensor}, tmp_path / f"{name}.pt")
        result = run_cli("convert", tmp_path / f"{name}.pt", "--to", "dcp",
                         "-o", tmp_path / name)
        assert result.exit_code == 1 and "conjugate or negative view" in result.output
        assert not (tmp_path / name).exists()


@pytest.mark.parametrize("command", [["reshard", "--ranks", "2", "-o", "{out}"],
                                     ["convert", "--to", "safetensors", "-o", "{out}"],
                                     ["convert", "--to", "torch", "-o", "{out}.pt"]])
def test_a_checkpoint_item_saved_as_a_conjugate_view_is_not_read_as_its_bytes(run_cli, tmp_path,
                                                                              command):
    """torch's DCP saves x.conj() as it is, with the conj bit in the item's pickle; its values
    are the conjugates of its stored bytes. Read as bytes, every imaginary part would flip."""
    dcp.save({"c": torch.randn(4, 3, dtype=torch.complex64).conj()},
             checkpoint_id=tmp_path / "ckpt", no_dist=True)
    assert run_cli("verify", tmp_path / "ckpt").exit_code == 0  # torch loads it: it is whole
    args = [part.format(out=tmp_path / "out") for part in command]
    result = run_cli(args[0], tmp_path / "ckpt", *args[1:])
    assert result.exit_code == 1 and "conjugate view" in result.output, result.output
    assert sorted(path.name for path in tmp_path.iterdir()) == ["ckpt"]


def test_a_safetensors_shape_past_int64_is_refused(run_cli, tmp_path):
    header = json.dumps({"a": {"dtype": "F32", "shape": [0, 10**30], "data_offsets": [0, 0]}})
    (tmp_path / "huge.safetensors").write_bytes(
        struct.pack("<Q", len(header)) + header.encode())
    result = run_cli("convert", tmp_path / "huge.safetensors", "--to", "dcp", "-o", tmp_path / "o")
    assert result.exit_code == 1 and "past what torch can hold" in result.output
    assert not (tmp_path / "o").exists()


def _safetensors_file(path, entries: dict, data: bytes, padding: int = 0,
                      length_delta: int = 0) -> None:
    header = json.dumps(entries).encode()
    header += b" " * (-len(header) % 8 + padding)
    path.write_bytes(struct.pack("<Q", len(header) + length_delta) + header + data)


@pytest.mark.parametrize("entries, data, padding, length_delta, words", [
    ({"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]},
      "b": {"dtype": "F32", "shape": [4], "data_offsets": [8, 24]}}, 24, 0, 0,
     "tensor 'b' starts at byte"),
    ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
      "b": {"dtype": "F32", "shape": [2], "data_offsets": [24, 32]}}, 32, 0, 0,
     "tensor 'b' starts at byte"),
    ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, 16, 0, 0,
     "the file at byte"),
    ({"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}, 16, 8, -8,
     "the file at byte"),  # a header length short of the header: data read 8 bytes early
], ids=["overlapping", "gap", "trailing-bytes", "header-length-short"])
def test_a_safetensors_file_the_library_refuses_is_refused(run_cli, tmp_path, entries, data,
                                                           padding, length_delta, words):
    from safetensors.torch import load_file
    path = tmp_path / "bad.safetensors"
    _safetensors_file(path, entries, bytes(range(data)), padding, length_delta)
    with pytest.raises(Exception):
        load_file(path)
    result = run_cli("convert", path, "--to", "dcp", "-o", tmp_path / "o")
    assert result.exit_code == 1 and words in result.output, result.output
    assert not (tmp_path / "o").exists()


def _rewritten_torch_save(source, target, edit, reverse: bool = False) -> None:
    """source zipped again by Python's zipfile, each record's bytes through edit, in the
    reverse order with reverse."""
    with zipfile.ZipFile(source) as archive, zipfile.ZipFile(target, "w") as rewritten:
        infos = archive.infolist()
        for info in reversed(infos) if reverse else infos:
            rewritten.writestr(info.filename, edit(info.filename, archive.read(info.filename)))


def test_a_torch_save_file_whose_tensor_bytes_fail_their_crc_is_refused(run_cli, tmp_path):
    """torch.load reads a flipped bit of a tensor as a value; the archive's CRC-32 says it."""
    torch.save({"w": torch.arange(1000.0)}, tmp_path / "model.pt")
    data = bytearray((tmp_path / "model.pt").read_bytes())
    data[data.index(b"data/0") + 200] ^= 0x01
    (tmp_path / "model.pt").write_bytes(data)
    torch.load(tmp_path / "model.pt", weights_only=True)  # torch takes it
    result = run_cli("convert", tmp_path / "model.pt", "--to", "dcp", "-o", tmp_path / "o")
    assert result.exit_code == 1 and "does not match its CRC-32" in result.output
    assert not (tmp_path / "o").exists()


def test_a_torch_save_file_whose_storage_record_is_longer_than_its_storage_is_refused(
        run_cli, tmp_path):
    torch.save({"w": torch.arange(4.0)}, tmp_path / "model.pt")
    _rewritten_torch_save(tmp_path / "model.pt", tmp_path / "long.pt", lambda name, data: (
        data + bytes(4) if name.endswith("/data/0") else data))
    with pytest.raises(Exception):
        torch.load(tmp_path / "long.pt", weights_only=True)
    result = run_cli("convert", tmp_path / "long.pt", "--to", "dcp", "-o", tmp_path / "o")
    assert result.exit_code == 1 and "cannot tell where the bytes of 'w' lie" in result.output
    assert not (tmp_path / "o").exists()


def _converted_back(run_cli, source, output) -> dict:
    """convert source --to dcp -o output, loaded back by torch."""
    from conftest import load_with_torch

    result = run_cli("convert", source, "--to", "dcp", "-o", output)
    assert result.exit_code == 0, result.output
    return load_with_torch(output)


def _assert_tensors_equal(loaded: dict, expected: dict) -> None:
    assert loaded.keys() == expected.keys()
    for name, tensor in expected.items():
        assert torch.equal(loaded[name], tensor), name


def test_a_torch_save_file_whose_storage_records_were_renamed_converts_as_torch_loads_it(
        run_cli, tmp_path):
    """torch's loader works each storage's offset out from where its own writer would put it
    (the storages back to back, in the order data.pkl names them), not from the record's name;
    a file whose records data/1 and data/2 traded names loads `b` from data/2, and convert
    carried `b` from where torch had pointed, data/1's bytes, without a word."""
    torch.save({"a": torch.full((4,), 1.0), "b": torch.full((4,), 2.0),
                "c": torch.full((4,), 3.0)}, tmp_path / "model.pt")
    data = (tmp_path / "model.pt").read_bytes()
    swapped = data.replace(b"/data/1", b"/data/\0").replace(b"/data/2", b"/data/1").replace(
        b"/data/\0", b"/data/2")
    (tmp_path / "swapped.pt").write_bytes(swapped)
    expected = torch.load(tmp_path / "swapped.pt", weights_only=True)
    assert torch.equal(expected["b"], torch.full((4,), 3.0))  # torch reads by name
    _assert_tensors_equal(_converted_back(run_cli, tmp_path / "swapped.pt", tmp_path / "o"),
                          expected)


def test_a_torch_save_file_zipped_again_by_another_tool_converts(run_cli, tmp_path):
    """Its records lie elsewhere than torch's writer puts them (here in the reverse order):
    it was refused, `cannot tell where a tensor's bytes lie`, though torch loads it."""
    expected = {"a": torch.arange(5.0), "b": torch.arange(7.0) * 2, "empty": torch.zeros(0),
                "view": torch.arange(12.0).reshape(3, 4)[:, 1]}
    torch.save(expected, tmp_path / "model.pt")
    _rewritten_torch_save(tmp_path / "model.pt", tmp_path / "rezipped.pt",
                          lambda name, data: data, reverse=True)
    _assert_tensors_equal(torch.load(tmp_path / "rezipped.pt", weights_only=True), expected)
    _assert_tensors_equal(_converted_back(run_cli, tmp_path / "rezipped.pt", tmp_path / "o"),
                          expected)


def test_a_torch_save_file_with_two_records_of_one_name_is_refused(run_cli, tmp_path):
    """Which of the two torch's zip reader takes is its own business."""
    torch.save({"a": torch.full((4,), 1.0), "b": torch.full((4,), 2.0)}, tmp_path / "model.pt")
    data = (tmp_path / "model.pt").read_bytes()
    (tmp_path / "twice.pt").write_bytes(data.replace(b"/data/1", b"/data/0"))
    result = run_cli("convert", tmp_path / "twice.pt", "--to", "dcp", "-o", tmp_path / "o")
    assert result.exit_code == 1 and "holds two zip records named 'model/data/0'" in (
        result.output), result.output
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("value, what", [
    (torch.ones(4).to_sparse(), "a torch.sparse_coo tensor"),
    (torch.eye(2).to_sparse_csr(), "a torch.sparse_csr tensor"),
    (torch.ones(4).untyped_storage(), "a storage, not a tensor"),
])
def test_a_sparse_tensor_or_a_bare_storage_is_refused_by_name(run_cli, tmp_path, value, what):
    """A sparse tensor failed as `internal error: NotImplementedError: Cannot access storage
    of SparseTensorImpl`; a storage, as `cannot tell where the bytes of 'w' lie`."""
    torch.save({"w": torch.ones(5), "nested": {"s": value}}, tmp_path / "model.pt")
    result = run_cli("convert", tmp_path / "model.pt", "--to", "dcp", "-o", tmp_path / "o")
    assert (result.exit_code, result.output) == (1, (
        f"Error: {tmp_path / 'model.pt'}: 'nested.s' is {what}: dcpctl converts state dicts "
        "of plain (strided) tensors\n"))
    assert not (tmp_path / "o").exists()


def test_a_quantized_tensor_is_refused_as_one(run_cli, tmp_path):
    """It was refused as `cannot be loaded with weights_only=True (Could not run
    'aten::_empty_affine_quantized' ...)`, though torch.load(weights_only=True) loads it, with
    two of torch's warnings on stderr."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # quantized tensors are deprecated
        quantized = torch.quantize_per_tensor(torch.ones(4), 0.1, 0, torch.qint8)
    torch.save({"q": quantized, "w": torch.ones(2)}, tmp_path / "q.pt")
    result = run_cli("convert", tmp_path / "q.pt", "--to", "dcp", "-o", tmp_path / "o")
    assert (result.exit_code, result.output) == (1, (
        f"Error: {tmp_path / 'q.pt'}: holds a quantized tensor, which dcpctl does not convert "
        "(save its dequantize() or int_repr() instead)\n"))


def test_a_tensor_saved_from_the_meta_device_is_named(run_cli, tmp_path):
    torch.save({"m": torch.empty(3, device="meta"), "w": torch.ones(2)}, tmp_path / "meta.pt")
    result = run_cli("convert", tmp_path / "meta.pt", "--to", "dcp", "-o", tmp_path / "o")
    assert (result.exit_code, result.output) == (1, (
        f"Error: {tmp_path / 'meta.pt'}: 'm' has no storage record in the file (a tensor saved "
        "from the meta device has none)\n"))


def test_an_object_torchs_safe_loader_refuses_is_named_with_its_reason(run_cli, tmp_path):
    """The refusal quoted the first line of torch's message: advice on loading unsafely, cut
    mid-sentence, with the terminal escapes torch puts in it."""
    import io

    dcp.save({"w": torch.ones(2), "stream": io.BytesIO(b"ab")}, checkpoint_id=tmp_path / "ck")
    result = run_cli("convert", tmp_path / "ck", "--to", "torch", "-o", tmp_path / "out.pt")
    assert result.exit_code == 1, result.output
    assert "(Unsupported global: GLOBAL _io.BytesIO was not an allowed global by default)" \
        in result.output
    assert "x1b" not in result.output and len(result.output.splitlines()) == 1


def test_a_damaged_object_is_named_when_looked_into_for_tensors(run_cli, tmp_path, checkpoint):
    """convert --to safetensors reads each object's zip directory (does it hold tensors?): its
    refusal of a damaged one gave no file, item or byte range, where every other command did."""
    from dcpctl.format.checkpoint.view import open_checkpoint

    entry = next(entry for entry in open_checkpoint(checkpoint).objects if entry.fqn == "step")
    storage = entry.storage
    data_file = checkpoint / storage.relative_path
    data = bytearray(data_file.read_bytes())
    end_record = data.rindex(b"PK\x06\x06", storage.offset, storage.offset + storage.length)
    data[end_record + 37] ^= 0x01  # its zip64 end record's entry count, now past 2 ** 40
    data_file.write_bytes(bytes(data))
    result = run_cli("convert", checkpoint, "--to", "safetensors", "--include", "*",
                     "-o", tmp_path / "out")
    assert result.exit_code == 1, result.output
    assert result.stderr.startswith(
        f"Error: {data_file}: item 'step' at bytes {storage.offset}.."
        f"{storage.offset + storage.length}: "), result.stderr
    assert not (tmp_path / "out").exists()

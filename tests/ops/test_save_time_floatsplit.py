"""floatsplit at save time: a training job saves through `dcpctl.storage_writer` (torch's
FileSystemWriter with the FloatSplit extension), from several gloo ranks, with `dcp.save` and
`dcp.async_save`; what it writes is item for item what `dcpctl compress --codec floatsplit`
writes at the same level, loads on any world size, and every command reads it."""

from __future__ import annotations

import io
import json
import pickle
import re
import tracemalloc

import pytest
import torch
from conftest import load_with_dcpctl_reader, load_with_torch, run_dcpctl, torch_metadata
from floatsplit_streams import FLOAT_BLOCKS, block_structure
from make_fixtures import run_gloo_job

import dcpctl
from dcpctl.errors import InvalidOptionError
from dcpctl.format.codecs.floatsplit.stream_format import BYTES_BLOCK, END_BLOCK
from dcpctl.format.codecs.names import FLOATSPLIT_DESCRIPTOR

WIDTH = 192  # bf16 rows of 384 bytes: every rank's shard of a weight is split into planes


class SmallModel(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(300, WIDTH)
        self.proj = torch.nn.Linear(WIDTH, WIDTH)
        self.register_buffer("rope", torch.randn(64, 32))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.proj(self.embed(tokens)).sum() + self.rope.sum()


def _model(world_size: int) -> torch.nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = SmallModel().to(torch.bfloat16)
    mesh = init_device_mesh("cpu", (world_size,))
    fully_shard(model.embed, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _trainer_state(rank: int, world_size: int) -> dict:
    """A bf16 model and its AdamW state (fp32 moments), an object and a per-rank object."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model = _model(world_size)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.arange(16) % 300).backward()
    optimizer.step()
    model_state, optimizer_state = get_state_dict(model, optimizer)
    rank_object = io.BytesIO()
    torch.save({"rank": rank, "seen": list(range(100))}, rank_object)
    rank_object.seek(0)
    return {"model": model_state, "optim": optimizer_state, "step": 12,
            "dataloader": {f"dp_rank_{rank}": rank_object}}


def _save_all_ways(rank: int, world_size: int, root: str) -> None:
    import torch.distributed.checkpoint as dcp

    state = _trainer_state(rank, world_size)
    dcp.save(state, checkpoint_id=f"{root}/plain")
    dcp.save(state, storage_writer=dcpctl.storage_writer(f"{root}/floatsplit", thread_count=2))
    dcp.save(state, storage_writer=dcpctl.storage_writer(f"{root}/floatsplit-3", level=3))
    dcp.async_save(state, storage_writer=dcpctl.storage_writer(f"{root}/async")).result()
    dcp.save(state, storage_writer=dcpctl.storage_writer(f"{root}/zstd", codec="zstd"))


@pytest.fixture(scope="module")
def saves(tmp_path_factory):
    root = tmp_path_factory.mktemp("save_time")
    run_gloo_job(2, _save_all_ways, str(root))
    return root


def stored_items(checkpoint) -> dict:
    """MetadataIndex -> (transform descriptors, stored bytes) of every item."""
    items = {}
    for index, info in torch_metadata(checkpoint).storage_data.items():
        with open(checkpoint / info.relative_path, "rb") as data_file:
            data_file.seek(info.offset)
            items[index] = (info.transform_descriptors, data_file.read(info.length))
    return items


@pytest.mark.parametrize("name, level", [("floatsplit", "1"), ("async", "1"),
                                         ("floatsplit-3", "3")])
def test_a_save_writes_what_compress_writes(saves, tmp_path, name, level):
    """By default a save codes at the fast level 1; at any level, it writes what compress
    writes at that level."""
    compressed = tmp_path / "compressed"
    result = run_dcpctl("compress", saves / "plain", "--codec", "floatsplit", "--level", level,
                        "-o", compressed)
    assert result.returncode == 0, result.stderr
    saved, expected = stored_items(saves / name), stored_items(compressed)
    assert saved.keys() == expected.keys()
    for index, (descriptors, data) in saved.items():
        assert descriptors == [FLOATSPLIT_DESCRIPTOR]
        assert data == expected[index][1], index
    weight = next(data for index, (_, data) in saved.items() if index.fqn == "model.proj.weight")
    assert set(FLOAT_BLOCKS) & {block[0] for block in block_structure(weight)}
    rank_object = next(data for index, (_, data) in saved.items() if "dp_rank_1" in index.fqn)
    assert {block[0] for block in block_structure(rank_object)} <= {BYTES_BLOCK, END_BLOCK}


def test_a_save_with_crc32s_turned_off_still_writes_what_compress_writes(tmp_path):
    """torch.save writes zero CRC-32s then: the save took the head for no tensor's and coded
    float tensors as plain zstd, larger than compress writes."""
    import torch.distributed.checkpoint as dcp

    state = {"w": (torch.randn(128, 64) * 0.02).to(torch.bfloat16), "f": torch.randn(64, 64)}
    torch.serialization.set_crc32_options(False)
    try:
        dcp.save(state, checkpoint_id=tmp_path / "plain", no_dist=True)
        dcp.save(state, storage_writer=dcpctl.storage_writer(tmp_path / "saved"), no_dist=True)
    finally:
        torch.serialization.set_crc32_options(True)
    result = run_dcpctl("compress", tmp_path / "plain", "--codec", "floatsplit", "--level", "1",
                        "-o", tmp_path / "compressed")
    assert result.returncode == 0, result.stderr
    saved, expected = stored_items(tmp_path / "saved"), stored_items(tmp_path / "compressed")
    assert saved == expected
    assert all(set(FLOAT_BLOCKS) & {block[0] for block in block_structure(data)}
               for _, data in saved.values())


@pytest.mark.parametrize("name", ["floatsplit", "floatsplit-3", "async", "zstd"])
def test_it_loads_equal_to_the_plain_save(saves, name):
    plain = load_with_torch(saves / "plain")
    loaded = load_with_dcpctl_reader(str(saves / name))
    assert loaded.keys() == plain.keys()
    for key, value in plain.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(loaded[key], value), key
        elif isinstance(value, io.BytesIO):
            assert loaded[key].getvalue() == value.getvalue(), key
        else:
            assert loaded[key] == value, key


def test_the_zstd_writer_is_stock_torch(saves):
    assert load_with_torch(saves / "zstd").keys() == load_with_torch(saves / "plain").keys()
    assert {info.transform_descriptors[0] for info in
            torch_metadata(saves / "zstd").storage_data.values()} == {"stream.zstd/1"}


def test_it_is_smaller_than_torchs_zstandard(saves):
    def tensor_bytes(name):
        return sum(len(data) for index, (_, data) in stored_items(saves / name).items()
                   if index.fqn.startswith("model."))

    assert tensor_bytes("floatsplit") < 0.9 * tensor_bytes("zstd")


def _load_model_on_ranks(rank: int, world_size: int, checkpoint: str, out: str) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    model = _model(world_size)
    state = {"model": get_model_state_dict(model)}
    dcp.load(state, storage_reader=dcpctl.storage_reader(checkpoint))
    full = {name: value.full_tensor() if hasattr(value, "full_tensor") else value
            for name, value in state["model"].items()}
    if rank == 0:
        torch.save(full, out)


@pytest.mark.slow
def test_three_ranks_load_what_two_saved(saves, tmp_path):
    out = tmp_path / "loaded.pt"
    run_gloo_job(3, _load_model_on_ranks, str(saves / "floatsplit"), str(out))
    plain = load_with_torch(saves / "plain")
    loaded = torch.load(out)
    assert loaded.keys() and all(torch.equal(value, plain[f"model.{name}"])
                                 for name, value in loaded.items())


def _save_in_a_background_process(rank: int, world_size: int, root: str) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

    dcp.async_save(_trainer_state(rank, world_size),
                   storage_writer=dcpctl.storage_writer(f"{root}/process", thread_count=2),
                   async_checkpointer_type=AsyncCheckpointerType.PROCESS).result()


@pytest.mark.slow
def test_an_async_save_from_a_background_process(saves, tmp_path):
    """torch pickles the writer, extension included, into a checkpoint process of its own."""
    run_gloo_job(2, _save_in_a_background_process, str(tmp_path))
    saved, expected = stored_items(tmp_path / "process"), stored_items(saves / "floatsplit")
    assert saved.keys() == expected.keys()
    assert all(data == expected[index][1] for index, (_, data) in saved.items())


def test_every_command_reads_it(saves, tmp_path):
    checkpoint = saves / "floatsplit"
    report = json.loads(run_dcpctl("inspect", checkpoint, "--json").stdout)
    assert report["tensors"] and run_dcpctl("verify", checkpoint).returncode == 0
    plain = load_with_torch(saves / "plain")
    for args in (["decompress", "-o", tmp_path / "plain"],
                 ["compress", "--codec", "zstd", "-o", tmp_path / "stock"],
                 ["reshard", "--ranks", "3", "--codec", "none", "-o", tmp_path / "three"]):
        result = run_dcpctl(args[0], checkpoint, *args[1:])
        assert result.returncode == 0, result.stderr
        restored = load_with_torch(args[-1])
        assert all(torch.equal(restored[key], value) for key, value in plain.items()
                   if isinstance(value, torch.Tensor))
    result = run_dcpctl("convert", checkpoint, "--to", "safetensors", "-o", tmp_path / "hf")
    assert result.returncode == 0, result.stderr
    from safetensors.torch import load_file
    weights = load_file(tmp_path / "hf" / "model.safetensors")
    assert weights.keys() == {"embed.weight", "proj.weight", "proj.bias", "rope"}
    assert all(torch.equal(value, plain[f"model.{name}"]) for name, value in weights.items())


class _Sink(io.RawIOBase):
    def __init__(self) -> None:
        self.stored = 0
        self.closed_by_writer = False

    def writable(self) -> bool:
        return True

    def write(self, data) -> int:
        self.stored += memoryview(data).nbytes
        return memoryview(data).nbytes

    def close(self) -> None:
        self.closed_by_writer = True
        super().close()


def test_the_extension_holds_a_few_blocks_not_the_tensor():
    """torch.save hands the whole storage over in one write; the extension codes it where it
    lies, holding at most a block or two of its own."""
    tensor = (torch.randn(32 << 20) * 0.02).to(torch.bfloat16)  # 64 MiB
    warm_up = dcpctl.FloatSplit().transform_to(_Sink())  # imports allocate, once
    torch.save(tensor[:100_000], warm_up)
    warm_up.close()
    sink = _Sink()
    tracemalloc.start()
    stream = dcpctl.FloatSplit().transform_to(sink)
    torch.save(tensor, stream)
    stream.close()
    _, peak_bytes = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert sink.closed_by_writer and sink.stored < 0.8 * tensor.nbytes
    assert peak_bytes < 16 << 20, peak_bytes


def test_the_extension_survives_pickling_for_async_saves_in_a_process():
    extension = pickle.loads(pickle.dumps(dcpctl.FloatSplit(level=5)))
    assert extension.get_descriptor() == FLOATSPLIT_DESCRIPTOR
    sink = _Sink()
    stream = extension.transform_to(sink)
    torch.save(torch.ones(10), stream)
    stream.close()
    assert sink.stored > 0


def test_storage_writer_refuses_what_it_cannot_write(tmp_path):
    with pytest.raises(InvalidOptionError, match="unknown codec 'lz4'"):
        dcpctl.storage_writer(tmp_path, codec="lz4")
    with pytest.raises(InvalidOptionError, match="takes no level"):
        dcpctl.storage_writer(tmp_path, codec="zstd", level=9)
    with pytest.raises(InvalidOptionError, match="outside 1..22"):
        dcpctl.storage_writer(tmp_path, level=30)
    for level in (2.5, True):  # 2.5 failed inside the save; True was taken for level 1
        with pytest.raises(InvalidOptionError, match="is no whole number"):
            dcpctl.storage_writer(tmp_path, level=level)
    for count in (0, 1.5):  # 0 failed inside the save: `min() arg is an empty sequence`
        with pytest.raises(InvalidOptionError, match="thread_count is a whole number"):
            dcpctl.storage_writer(tmp_path, thread_count=count)
    from torch.distributed.checkpoint.filesystem import SerializationFormat
    with pytest.raises(InvalidOptionError, match="around its extensions"):
        dcpctl.storage_writer(tmp_path, serialization_format=SerializationFormat.SAFETENSORS)
    assert dcpctl.storage_writer(tmp_path, codec="none",
                                 serialization_format=SerializationFormat.SAFETENSORS)


@pytest.mark.parametrize("fqn", ["ids", "small", "state.note"])
@pytest.mark.parametrize("codec", ["floatsplit", "zstd", "none"])
def test_a_flipped_bit_in_an_item_fails_the_load_or_changes_nothing(tmp_path, codec, fqn):
    """torch.load checks none of an archive's CRC-32s, torch's zstd frames keep no checksum,
    and floatsplit codes an integer tensor, a float tensor too small to split at level 1 or an
    object as plain bytes, with no CRC-32 of its own: one flipped bit loaded as a wrong value,
    with no error (36 of 60 random flips in a zstd checkpoint)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    saved = {"ids": torch.arange(20_000), "small": torch.randn(1000),
             "state": {"step": 7, "note": "x" * 5000}}
    dcp.save(saved, storage_writer=dcpctl.storage_writer(tmp_path / "ck", codec=codec),
             no_dist=True)
    info = next(info for index, info in torch_metadata(tmp_path / "ck").storage_data.items()
                if index.fqn == fqn)
    path, offset, length = tmp_path / "ck" / info.relative_path, info.offset, info.length
    original = path.read_bytes()
    outcomes = []
    for position in range(offset, offset + length, max(1, length // 16)):
        damaged = bytearray(original)
        damaged[position] ^= 0x10
        path.write_bytes(bytes(damaged))
        loaded = {"ids": torch.zeros(20_000, dtype=torch.int64), "small": torch.zeros(1000),
                  "state": {"step": 0, "note": ""}}
        try:
            dcp.load(loaded, storage_reader=dcpctl.storage_reader(tmp_path / "ck"),
                     no_dist=True)
        except CheckpointException as error:  # the decoder's own checks, or the archive's
            outcomes.append("damaged" if re.search(
                "damaged: (record '[^']+' .* has CRC-32|the item is no intact torch.save "
                "archive)", str(error)) else "refused")
        else:  # a flip that changes no byte the load uses (zstd's unused bits, say)
            assert (torch.equal(loaded["ids"], saved["ids"])
                    and torch.equal(loaded["small"], saved["small"])
                    and loaded["state"] == saved["state"]), f"wrong values, flip at {position}"
            outcomes.append("equal")
    assert "damaged" in outcomes and outcomes.count("equal") <= len(outcomes) // 2, outcomes


def test_a_file_url_saves_at_the_path_it_names(tmp_path, monkeypatch):
    """`storage_writer("file:///abs/ck")` saved into `./file:/abs/ck` under the working
    directory, and storage_reader of the same URL found nothing there."""
    import torch.distributed.checkpoint as dcp

    monkeypatch.chdir(tmp_path)
    url = f"file://{tmp_path}/ck"
    dcp.save({"w": torch.ones(3)}, storage_writer=dcpctl.storage_writer(url), no_dist=True)
    assert (tmp_path / "ck" / ".metadata").is_file() and not (tmp_path / "file:").exists()
    state = {"w": torch.zeros(3)}
    dcp.load(state, storage_reader=dcpctl.storage_reader(url), no_dist=True)
    assert torch.equal(state["w"], torch.ones(3))


@pytest.mark.parametrize("scheme", ["s3", "S3"])
def test_a_save_into_a_bucket(s3_server, tmp_path, scheme):
    import torch.distributed.checkpoint as dcp

    url = f"s3://{s3_server.new_bucket()}/run/step-5"
    state = {"w": (torch.randn(256, 256) * 0.02).to(torch.bfloat16), "step": 5}
    writer = dcpctl.storage_writer(url.replace("s3", scheme, 1), thread_count=2)
    dcp.save(state, storage_writer=writer, no_dist=True)
    loaded = load_with_dcpctl_reader(url)
    assert torch.equal(loaded["w"], state["w"]) and loaded["step"] == 5
    result = run_dcpctl("verify", url)
    assert result.returncode == 0, result.stderr
    report = json.loads(run_dcpctl("inspect", url, "--json").stdout)
    assert set(report["compression"]) == {"floatsplit"}


def test_a_flipped_bit_in_a_bucket_fails_the_load(s3_server):
    """The bucket's reader hands torch each item as its range arrives: checked as a local
    load's are (a plain item's tensor bytes, which nothing else checks)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    bucket = s3_server.new_bucket()
    url = f"s3://{bucket}/run/step-5"
    dcp.save({"w": torch.arange(4096.0)}, storage_writer=dcpctl.storage_writer(url, codec="none"),
             no_dist=True)
    client = s3_server.client()
    key = "run/step-5/__0_0.distcp"
    data = bytearray(client.get_object(Bucket=bucket, Key=key)["Body"].read())
    data[len(data) // 2] ^= 0x10  # inside the tensor's 16 KiB record
    client.put_object(Bucket=bucket, Key=key, Body=bytes(data))
    with pytest.raises(CheckpointException, match="item 'w': damaged: record '[^']+/data/0'"):
        load_with_dcpctl_reader(url)


@pytest.mark.parametrize("at", [0.3, 0.6, 0.9])
def test_a_flipped_bit_in_a_float_plane_fails_the_load(tmp_path, at):
    """torch.load checks no CRC-32: a flip in a raw plane of a floatsplit item loaded as a
    wrong value, with no error, through dcpctl.storage_reader."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    state = {"w": torch.randn(256, 256)}
    dcp.save(state, storage_writer=dcpctl.storage_writer(tmp_path / "ck"), no_dist=True)
    info = next(iter(torch_metadata(tmp_path / "ck").storage_data.values()))
    path = tmp_path / "ck" / info.relative_path
    data = bytearray(path.read_bytes())
    data[info.offset + int(info.length * at)] ^= 0x04
    path.write_bytes(bytes(data))
    loaded = {"w": torch.empty(256, 256)}
    with pytest.raises(CheckpointException, match="the tensor's bytes decode to CRC-32 .* "
                                                  "damaged"):
        dcp.load(loaded, storage_reader=dcpctl.storage_reader(tmp_path / "ck"), no_dist=True)

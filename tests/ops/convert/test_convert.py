"""convert: DCP to safetensors and torch.save, and back to DCP, checked against stock torch."""

from __future__ import annotations

import json
import math
import zipfile
import zlib
from pathlib import Path

import pytest
import torch
from conftest import (FIXTURE_NAMES, MANIFEST, REPO_ROOT, TORCH_LOADABLE_FIXTURES, fixture_path,
                      load_with_torch, torch_metadata)
from make_fixtures import tensor_sha256
from rank_loading import assert_matches_manifest, describe_after_loading_on_ranks
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from dcpctl.errors import DataError, OutputError, SelectionError, UnsupportedLayoutError
from dcpctl.format.checkpoint.payloads import PayloadReader
from dcpctl.format.checkpoint.view import open_checkpoint
from dcpctl.format.dtypes import dtype_by_name
from dcpctl.ops.convert import placed_tensors
from dcpctl.ops.convert.key_selection import KeySelection, Rename
from dcpctl.ops.convert.tensor_bytes import iter_tensor_bytes
from dcpctl.ops.convert.to_dcp import convert_to_dcp
from dcpctl.ops.convert.to_safetensors import convert_to_safetensors
from dcpctl.ops.convert.to_torch_save import convert_to_torch_save

EVERYTHING = KeySelection(include=("*",))
WHISPER = REPO_ROOT.parent / "shared" / "data" / "real" / "whisper_tiny_en_fp16.safetensors"


def load_safetensors_output(directory: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a converted output, through its index when it has one."""
    index_path = directory / "model.safetensors.index.json"
    if not index_path.exists():
        return load_file(directory / "model.safetensors")
    tensors = {}
    for name, file_name in json.loads(index_path.read_text())["weight_map"].items():
        with safe_open(directory / file_name, "pt") as handle:
            tensors[name] = handle.get_tensor(name)
    return tensors


def expected_names(name: str) -> dict[str, str]:
    """Output name -> fqn by the documented defaults: the `model.` tensors with `model.`
    stripped when there is an optimizer beside them, else every tensor under its fqn."""
    fqns = list(MANIFEST[name]["tensors"])
    if any(fqn.startswith("optim") for fqn in fqns):
        return {fqn.removeprefix("model."): fqn for fqn in fqns if fqn.startswith("model.")}
    return {fqn: fqn for fqn in fqns}


@pytest.mark.parametrize("name", FIXTURE_NAMES)
def test_every_fixture_converts_to_what_dcp_load_gives(name, tmp_path):
    report = convert_to_safetensors(fixture_path(name), tmp_path / "out",
                                    KeySelection(strip_prefix=None), threads=2)
    converted = load_safetensors_output(tmp_path / "out")
    names = expected_names(name)
    assert set(converted) == set(names)
    reference = load_with_torch(fixture_path(name)) if name in TORCH_LOADABLE_FIXTURES else None
    for output_name, fqn in names.items():
        described = MANIFEST[name]["tensors"][fqn]
        value = converted[output_name]
        assert str(value.dtype) == f"torch.{described['dtype']}"
        assert list(value.shape) == described["shape"]
        assert tensor_sha256(value) == described["sha256"], fqn
        if reference is not None:
            assert torch.equal(value, reference[fqn])
    assert report.tensors == len(names)
    assert report.tensors_left_out == len(MANIFEST[name]["tensors"]) - len(names)
    assert report.objects_left_out == len(MANIFEST[name]["objects"])


@pytest.mark.parametrize("name", ["objects_2ranks", "mesh2d_4ranks"])
def test_dtype_casts_floating_tensors_only(name, tmp_path):
    convert_to_safetensors(fixture_path(name), tmp_path / "out", EVERYTHING,
                           cast_to=dtype_by_name("bfloat16"))
    converted = load_safetensors_output(tmp_path / "out")
    for fqn, value in load_with_torch(fixture_path(name)).items():
        if isinstance(value, torch.Tensor):
            expected = value.to(torch.bfloat16) if value.is_floating_point() else value
            assert converted[fqn].dtype == expected.dtype and torch.equal(converted[fqn], expected)


@pytest.mark.parametrize("source,target", [("float16", "float32"), ("float64", "bfloat16")])
def test_a_cast_nan_has_the_same_bits_however_the_tensor_is_split(tmp_path, source, target):
    """torch casts a NaN of these dtypes to bits that depend on where it falls in what it
    casts (its vector loop and its tail loop disagree): one tensor, cast from one chunk and
    from five, came out with two sets of bits."""
    import torch.distributed.checkpoint as dcp

    from dcpctl.ops.reshard.execution import reshard_checkpoint

    width = torch.finfo(getattr(torch, source)).bits
    exponent = {"float16": 5, "float64": 11}[source]
    mantissa = width - 1 - exponent
    patterns = [(sign << (width - 1)) | (((1 << exponent) - 1) << mantissa) | payload
                for sign in (0, 1) for payload in (1, 1 << (mantissa - 1), 3 << (mantissa - 2))]
    integer = {16: torch.int16, 64: torch.int64}[width]
    bits = torch.tensor([value - (1 << width) if value >= 1 << (width - 1) else value
                         for value in patterns] * 3, dtype=integer)
    weights = {"w": bits.view(getattr(torch, source)).reshape(-1, 1)}
    dcp.save(weights, checkpoint_id=str(tmp_path / "one"), no_dist=True)
    reshard_checkpoint(tmp_path / "one", 5, str(tmp_path / "five"))
    cast = {}
    for layout in ("one", "five"):
        convert_to_safetensors(tmp_path / layout, tmp_path / f"{layout}-st", EVERYTHING,
                               cast_to=dtype_by_name(target))
        cast[layout] = load_safetensors_output(tmp_path / f"{layout}-st")["w"]
    assert bool(cast["one"].isnan().all())
    integer = torch.int16 if target == "bfloat16" else torch.int32
    assert torch.equal(cast["one"].view(integer), cast["five"].view(integer))
    # the target's quiet NaN of each one's sign, whatever its payload and the machine
    quiet_bits = {"float32": 0x7FC00000, "bfloat16": 0x7FC0}[target]
    magnitude = (1 << (torch.finfo(getattr(torch, target)).bits - 1)) - 1
    assert {int(value) & magnitude for value in cast["one"].view(integer).flatten()} == {
        quiet_bits & magnitude}
    assert torch.equal(torch.signbit(cast["one"]).flatten(),
                       torch.signbit(weights["w"]).flatten())


def test_threads_hold_no_more_than_a_bounded_sum_of_pieces(tmp_path, monkeypatch):
    """Each thread holds a piece (a chunk, or a whole tensor not split by rows): at 8 threads
    a checkpoint of 8 tensors of 64 MiB took 0.49 GB, its size. Threads stop at as many of the
    largest piece as fit in PIECES_IN_HAND_BYTES, or two where it is larger."""
    from dcpctl.ops.convert.tensor_bytes import largest_piece_bytes

    checkpoint = open_checkpoint(fixture_path("mesh2d_4ranks"))
    pieces = {tensor.fqn: largest_piece_bytes(tensor) for tensor in checkpoint.tensors}
    column_split = next(tensor for tensor in checkpoint.tensors
                        if len({chunk.offsets[-1] for chunk in tensor.chunks}) > 1)
    assert pieces[column_split.fqn] == column_split.nbytes  # assembled whole
    itemsize = column_split.dtype.itemsize  # a cast holds the larger of the two
    assert largest_piece_bytes(column_split, dtype_by_name("float64")) == \
        column_split.nbytes // itemsize * max(itemsize, 8)
    used = []
    real = placed_tensors.run_in_order
    monkeypatch.setattr(placed_tensors, "run_in_order",
                        lambda produce, tasks, write, threads: (used.append(threads),
                                                                real(produce, tasks, write,
                                                                     threads)))
    for budget, expected in ((max(pieces.values()) * 3, 3), (1, 2)):  # two where it is larger
        monkeypatch.setattr(placed_tensors, "PIECES_IN_HAND_BYTES", budget)
        report = convert_to_safetensors(fixture_path("mesh2d_4ranks"), tmp_path / f"out-{budget}",
                                        EVERYTHING, threads=8)
        assert used.pop() == expected
        assert report.threads == expected  # the report gives the threads that ran, not 8
        report = convert_to_torch_save(fixture_path("mesh2d_4ranks"), tmp_path / f"{budget}.pt",
                                       EVERYTHING, threads=8)
        assert used.pop() == expected and report.threads == expected


def test_row_split_tensors_stream_a_chunk_at_a_time(tmp_path):
    checkpoint = open_checkpoint(fixture_path("fsdp2_adamw_3ranks"))
    embed = next(t for t in checkpoint.tensors if t.fqn == "model.embed.weight")
    pieces = list(iter_tensor_bytes(PayloadReader(tmp_path), checkpoint, embed))
    assert [len(piece.data) for piece in pieces] == [4 * 6 * 4, 4 * 6 * 4, 2 * 6 * 4]
    # each chunk comes with the CRC-32 its read worked out: a torch.save record of it needs no
    # second pass; a cast has none
    assert [piece.crc for piece in pieces] == [zlib.crc32(piece.data) for piece in pieces]
    cast = list(iter_tensor_bytes(PayloadReader(tmp_path), checkpoint, embed,
                                  dtype_by_name("bfloat16")))
    assert [piece.crc for piece in cast] == [None] * 3


def test_tensors_laid_out_whole_come_without_a_crc(tmp_path):
    checkpoint = open_checkpoint(fixture_path("mesh2d_4ranks"))
    tensor = next(tensor for tensor in checkpoint.tensors
                  if len({chunk.offsets[-1] for chunk in tensor.chunks}) > 1)  # split by columns
    pieces = list(iter_tensor_bytes(PayloadReader(tmp_path), checkpoint, tensor))
    assert len(pieces) == 1 and pieces[0].crc is None
    assert len(pieces[0].data) == math.prod(tensor.shape) * tensor.dtype.itemsize


def test_shards_hold_the_limit_and_the_index_maps_every_tensor(tmp_path):
    limit = 100
    report = convert_to_safetensors(fixture_path("fsdp2_adamw_3ranks"), tmp_path / "out",
                                    EVERYTHING, max_shard_bytes=limit)
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    shard_names = sorted(p.name for p in (tmp_path / "out").glob("*.safetensors"))
    count = len(shard_names)
    assert count > 2 and shard_names == [f"model-{n:05d}-of-{count:05d}.safetensors"
                                         for n in range(1, count + 1)]
    total = 0
    for shard_name in shard_names:
        tensors = load_file(tmp_path / "out" / shard_name)
        data_bytes = sum(t.numel() * t.element_size() for t in tensors.values())
        assert data_bytes <= limit or len(tensors) == 1
        assert all(index["weight_map"][name] == shard_name for name in tensors)
        total += data_bytes
    assert set(index["weight_map"]) == set(MANIFEST["fsdp2_adamw_3ranks"]["tensors"])
    assert index["metadata"]["total_size"] == total == report.tensor_bytes


def test_safetensors_to_dcp_and_back_is_bit_exact(tmp_path):
    convert_to_safetensors(fixture_path("objects_2ranks"), tmp_path / "first", EVERYTHING)
    convert_to_dcp(tmp_path / "first", tmp_path / "dcp", ranks=3)
    convert_to_safetensors(tmp_path / "dcp", tmp_path / "second", EVERYTHING)
    assert ((tmp_path / "first" / "model.safetensors").read_bytes()
            == (tmp_path / "second" / "model.safetensors").read_bytes())


def test_sharded_safetensors_to_dcp_and_back_keeps_every_tensor(tmp_path):
    convert_to_safetensors(fixture_path("fsdp2_adamw_3ranks"), tmp_path / "first", EVERYTHING,
                           max_shard_bytes=100)
    report = convert_to_dcp(tmp_path / "first", tmp_path / "dcp", ranks=2, prefix="model.")
    assert report.source_format == "safetensors" and [f.name for f in report.files] == [
        "__0_0.distcp", "__1_0.distcp"]
    convert_to_safetensors(tmp_path / "dcp", tmp_path / "second",
                           KeySelection(strip_prefix="model."), max_shard_bytes=100)
    first = load_safetensors_output(tmp_path / "first")
    second = load_safetensors_output(tmp_path / "second")
    assert {k: tensor_sha256(v) for k, v in first.items()} == {
        k: tensor_sha256(v) for k, v in second.items()}


@pytest.mark.parametrize("name", TORCH_LOADABLE_FIXTURES)
def test_torch_output_equals_dcp_to_torch_save(name, tmp_path):
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    report = convert_to_torch_save(fixture_path(name), tmp_path / "mine.pt", EVERYTHING)
    dcp_to_torch_save(fixture_path(name), tmp_path / "torch.pt")
    assert_same_state(torch.load(tmp_path / "mine.pt", weights_only=True),
                      torch.load(tmp_path / "torch.pt", weights_only=True))
    with zipfile.ZipFile(tmp_path / "mine.pt") as archive:
        assert archive.testzip() is None  # every CRC-32 was filled in
    assert report.objects == len(MANIFEST[name]["objects"])


@pytest.mark.parametrize("name", ["mesh2d_4ranks", "fsdp2_adamw_3ranks",
                                  "trainers/torchtitan_0.3.0_2ranks/checkpoint/step-2"])
def test_torch_output_of_tensors_and_plain_objects_imports_no_torch(name, tmp_path):
    """Importing torch takes seconds, most of a small conversion: it is needed only to load
    objects beyond plain data (weights_only) or cast dtypes, and the pickle names torch's
    functions, storages and dtypes by name. The fixtures' objects (an optimizer's
    param_groups, torchtitan's train state) are plain data."""
    import subprocess
    import sys

    source, output = fixture_path(name), tmp_path / "mine.pt"
    code = ("import sys; from dcpctl.ops.convert.to_torch_save import convert_to_torch_save; "
            "from dcpctl.ops.convert.key_selection import KeySelection; "
            f"convert_to_torch_save({str(source)!r}, {str(output)!r}, "
            "KeySelection(include=('*',))); print('torch' in sys.modules)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            check=True)
    assert result.stdout.strip() == "False"
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(source, tmp_path / "torch.pt")
    assert_same_state(torch.load(output, weights_only=True),
                      torch.load(tmp_path / "torch.pt", weights_only=True))


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_objects_beyond_plain_data_are_loaded_by_torch(tmp_path):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    state = {"w": torch.arange(6.0), "meta": {"shape": torch.Size([2, 3]),
                                              "dtype": torch.bfloat16, "step": 4}}
    dcp.save(state, checkpoint_id=str(tmp_path / "ck"), no_dist=True)
    convert_to_torch_save(tmp_path / "ck", tmp_path / "mine.pt", EVERYTHING)
    dcp_to_torch_save(tmp_path / "ck", tmp_path / "torch.pt")
    mine = torch.load(tmp_path / "mine.pt", weights_only=True)
    assert mine["meta"]["shape"] == torch.Size([2, 3]) and mine["meta"]["dtype"] is torch.bfloat16
    assert_same_state(mine, torch.load(tmp_path / "torch.pt", weights_only=True))


@pytest.mark.parametrize("zstd", [False, True])
def test_an_object_holding_tensors_is_refused_not_left_out_of_safetensors(tmp_path, zstd):
    """A save with flatten_state_dict=False keeps each nested dict of tensors as one object,
    and safetensors takes tensors only: the model came out without its layers, exit 0."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import DefaultSavePlanner
    from torch.distributed.checkpoint._extension import ZStandard

    state = {"lm_head.weight": torch.ones(2, 2), "layers": {"0": {"w": torch.arange(4.0)}},
             "step": 3, "optimizer": {"lr": torch.tensor(0.1)}}
    writer = dcp.FileSystemWriter(tmp_path / "ck", _extensions=[ZStandard()] if zstd else None)
    dcp.save(state, storage_writer=writer, no_dist=True,
             planner=DefaultSavePlanner(flatten_state_dict=False))
    for include in ((), ("*",), ("lm_head.weight", "layers.*"), ("lay*",)):
        with pytest.raises(UnsupportedLayoutError,
                           match="'layers' is an object holding tensors .*--exclude"):
            convert_to_safetensors(tmp_path / "ck", tmp_path / "out",
                                   KeySelection(include=include or None))
        assert not (tmp_path / "out").exists()
    for selection in (KeySelection(exclude=("layers",)), KeySelection(include=("lm_head.*",)),
                      KeySelection(include=("*",), exclude=("layers", "optimizer"))):
        convert_to_safetensors(tmp_path / "ck", tmp_path / "out", selection, overwrite=True)
        assert list(load_file(tmp_path / "out" / "model.safetensors")) == ["lm_head.weight"]


def test_torch_output_of_some_elements_of_a_list_keeps_their_places(tmp_path):
    """A list index is bounded by the checkpoint's entries, not by those selected."""
    import torch.distributed.checkpoint as dcp

    state = {"l": [torch.full((1,), float(index)) for index in range(3)], "o": [1, 2, 3]}
    dcp.save(state, checkpoint_id=str(tmp_path / "ck"), no_dist=True)
    convert_to_torch_save(tmp_path / "ck", tmp_path / "out.pt", KeySelection(include=("l.2",)))
    loaded = torch.load(tmp_path / "out.pt", weights_only=True)
    assert loaded["l"][:2] == [None, None] and torch.equal(loaded["l"][2], state["l"][2])


def assert_same_state(mine, theirs, path=()):
    """Equal nested structure, key order, types and tensor values."""
    assert type(mine) is type(theirs), path
    if isinstance(mine, dict):
        assert list(mine) == list(theirs), path
        for key in mine:
            assert_same_state(mine[key], theirs[key], path + (key,))
    elif isinstance(mine, list):
        assert len(mine) == len(theirs), path
        for index, (a, b) in enumerate(zip(mine, theirs)):
            assert_same_state(a, b, path + (index,))
    elif isinstance(mine, torch.Tensor):
        assert mine.dtype == theirs.dtype and torch.equal(mine, theirs), path
    else:
        assert mine == theirs, path


def test_torch_save_to_dcp_lays_out_chunks_as_a_real_fsdp2_save(tmp_path):
    name = "fsdp2_adamw_3ranks"
    convert_to_torch_save(fixture_path(name), tmp_path / "state.pt", EVERYTHING)
    report = convert_to_dcp(tmp_path / "state.pt", tmp_path / "dcp", ranks=3)
    assert report.source_format == "torch" and report.objects == len(MANIFEST[name]["objects"])
    mine, real = torch_metadata(tmp_path / "dcp"), torch_metadata(fixture_path(name))
    assert mine.state_dict_metadata == real.state_dict_metadata
    assert mine.planner_data == real.planner_data
    loaded, reference = load_with_torch(tmp_path / "dcp"), load_with_torch(fixture_path(name))
    assert_same_state(loaded, reference)


def test_views_and_odd_dtypes_in_torch_save_files(tmp_path):
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    state = {"transposed": base.t(), "row": base[2], "half": torch.randn(5).half(),
             "flags": torch.tensor([True, False]), "nested": {"list": [torch.ones(2), 3]}}
    torch.save(state, tmp_path / "views.pt")
    convert_to_dcp(tmp_path / "views.pt", tmp_path / "dcp", ranks=2, prefix="model.")
    loaded = load_with_torch(tmp_path / "dcp")
    assert torch.equal(loaded["model.transposed"], base.t())
    assert torch.equal(loaded["model.row"], base[2])
    assert torch.equal(loaded["model.half"], state["half"])
    assert torch.equal(loaded["model.nested.list.0"], torch.ones(2))
    assert loaded["model.nested.list.1"] == 3


@pytest.mark.slow
def test_dcp_output_loads_on_its_ranks_into_the_fsdp2_state(tmp_path):
    name = "fsdp2_adamw_3ranks"
    convert_to_torch_save(fixture_path(name), tmp_path / "state.pt", EVERYTHING)
    convert_to_dcp(tmp_path / "state.pt", tmp_path / "dcp", ranks=3)
    assert_matches_manifest(describe_after_loading_on_ranks(tmp_path / "dcp", name, 3), name)


@pytest.mark.skipif(not WHISPER.exists(), reason="the real weights are not here")
def test_real_weights_go_to_dcp_and_back_unchanged(tmp_path):
    convert_to_dcp(WHISPER, tmp_path / "dcp", ranks=4, prefix="model.")
    convert_to_safetensors(tmp_path / "dcp", tmp_path / "hf", KeySelection(strip_prefix="model."),
                           max_shard_bytes=30 * 10**6)
    converted = load_safetensors_output(tmp_path / "hf")
    with safe_open(WHISPER, "pt") as source:
        assert set(converted) == set(source.keys())
        for name in source.keys():
            assert torch.equal(converted[name], source.get_tensor(name)), name


def test_refusals(tmp_path):
    with pytest.raises(SelectionError, match="both renamed"):
        convert_to_safetensors(fixture_path("mesh2d_4ranks"), tmp_path / "a",
                               KeySelection(renames=(Rename.parse("^.*$=same"),)))
    torch.save({"z": torch.zeros(2, dtype=torch.complex128)}, tmp_path / "complex.pt")
    convert_to_dcp(tmp_path / "complex.pt", tmp_path / "complex")
    with pytest.raises(UnsupportedLayoutError, match="'z'.*complex128"):
        convert_to_safetensors(tmp_path / "complex", tmp_path / "b", EVERYTHING)
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "keep").write_text("x")
    with pytest.raises(OutputError, match="not empty"):
        convert_to_safetensors(fixture_path("mesh2d_4ranks"), tmp_path / "taken", EVERYTHING)
    with pytest.raises(OutputError, match="exists"):
        convert_to_torch_save(fixture_path("mesh2d_4ranks"), tmp_path / "complex.pt", EVERYTHING)
    assert (tmp_path / "taken" / "keep").read_text() == "x"
    torch.save({"pair": (torch.ones(1), torch.ones(1))}, tmp_path / "tuple.pt")
    with pytest.raises(UnsupportedLayoutError, match="'pair' is an object holding tensors"):
        convert_to_dcp(tmp_path / "tuple.pt", tmp_path / "c")
    torch.save({"path": Path("x")}, tmp_path / "unsafe.pt")
    with pytest.raises(UnsupportedLayoutError, match="weights_only"):
        convert_to_dcp(tmp_path / "unsafe.pt", tmp_path / "d")
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        ["complex.pt", "complex", "taken", "tuple.pt", "unsafe.pt"])


def test_a_failed_conversion_leaves_nothing_behind(tmp_path, monkeypatch):
    def fail_on_second_tensor(payloads, checkpoint, tensor, dtype=None):
        fail_on_second_tensor.calls += 1
        if fail_on_second_tensor.calls == 2:
            raise RuntimeError("disk on fire")
        return iter_tensor_bytes(payloads, checkpoint, tensor, dtype)

    fail_on_second_tensor.calls = 0
    monkeypatch.setattr(placed_tensors, "iter_tensor_bytes", fail_on_second_tensor)
    with pytest.raises(RuntimeError, match="disk on fire"):
        convert_to_safetensors(fixture_path("mesh2d_4ranks"), tmp_path / "out", EVERYTHING)
    assert list(tmp_path.iterdir()) == []


def test_overwrite_replaces_an_earlier_output(tmp_path):
    save_file({"old": torch.ones(1)}, tmp_path / "model.safetensors")
    convert_to_safetensors(fixture_path("mesh2d_4ranks"), tmp_path, EVERYTHING, overwrite=True)
    assert set(load_file(tmp_path / "model.safetensors")) == {"grid", "bias", "table"}


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_a_strided_view_saved_by_dcp_converts_as_its_values(tmp_path):
    import torch.distributed.checkpoint as dcp

    base = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    dcp.save({"transposed": base.t(), "plain": base}, checkpoint_id=tmp_path / "dcp",
             no_dist=True)
    convert_to_safetensors(tmp_path / "dcp", tmp_path / "hf", EVERYTHING)
    converted = load_file(tmp_path / "hf" / "model.safetensors")
    assert torch.equal(converted["transposed"], base.t()) and torch.equal(converted["plain"], base)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_torch_output_with_newer_dtypes_loads_mapped_and_converts_back(tmp_path):
    import torch.distributed.checkpoint as dcp

    state = {"f8": torch.randn(4, 3).to(torch.float8_e4m3fn),
             "u16": torch.tensor([1, 2, 60000], dtype=torch.uint16), "empty": torch.zeros(0, 2),
             "scalar": torch.tensor(3.0), "config": {"sizes": [1, 2], "name": "x"}}
    dcp.save(state, checkpoint_id=tmp_path / "dcp", no_dist=True)
    convert_to_torch_save(tmp_path / "dcp", tmp_path / "state.pt", EVERYTHING)
    for mmap in (False, True):
        loaded = torch.load(tmp_path / "state.pt", weights_only=True, mmap=mmap)
        assert loaded["config"] == state["config"]
        for name in ("f8", "u16", "empty", "scalar"):
            assert loaded[name].dtype == state[name].dtype
            assert tensor_sha256(loaded[name]) == tensor_sha256(state[name]), name
    convert_to_dcp(tmp_path / "state.pt", tmp_path / "again", ranks=2)
    again = load_with_torch(tmp_path / "again")
    assert tensor_sha256(again["f8"]) == tensor_sha256(state["f8"])
    assert again["config.name"] == "x"


class _CraftedView:
    """Pickles as torch.save pickles a view: a storage, an offset, sizes and strides."""

    def __init__(self, storage, offset, size, stride) -> None:
        self.arguments = (storage, offset, size, stride)

    def __reduce__(self):
        import collections

        return (torch._utils._rebuild_tensor_v2,
                (*self.arguments, False, collections.OrderedDict()))


@pytest.mark.parametrize("offset,size,stride", [(0, (2,), (2**62,)), (0, (2**62 + 1,), (1,)),
                                                (2**62, (1,), (1,))])
def test_a_view_that_fits_its_storage_only_in_wrapped_int64_is_refused(tmp_path, offset, size,
                                                                       stride):
    """torch's loader works the extent out in int64 and takes these; reading them was an
    internal OverflowError."""
    values = torch.arange(4, dtype=torch.float32)
    storage = torch.storage.TypedStorage(wrap_storage=values.untyped_storage(),
                                         dtype=values.dtype, _internal=True)
    torch.save({"a": _CraftedView(storage, offset, size, stride)}, tmp_path / "crafted.pt")
    with pytest.raises(DataError, match="'a' is a view of shape .* that does not lie inside "
                                        "its storage of 16 bytes"):
        convert_to_dcp(tmp_path / "crafted.pt", tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_float8_e8m0_goes_to_safetensors_and_back(tmp_path):
    """safetensors stores it as F8_E8M0; it was refused both ways as a dtype it lacks."""
    import torch.distributed.checkpoint as dcp

    state = {"scales": torch.tensor([0.5, 1.0, 2.0, 1024.0]).to(torch.float8_e8m0fnu)}
    dcp.save(state, checkpoint_id=tmp_path / "dcp", no_dist=True)
    convert_to_safetensors(tmp_path / "dcp", tmp_path / "hf", EVERYTHING)
    loaded = load_file(tmp_path / "hf" / "model.safetensors")
    assert loaded["scales"].dtype == torch.float8_e8m0fnu
    assert tensor_sha256(loaded["scales"]) == tensor_sha256(state["scales"])
    convert_to_dcp(tmp_path / "hf", tmp_path / "again")
    assert tensor_sha256(load_with_torch(tmp_path / "again")["scales"]) == tensor_sha256(
        state["scales"])


def test_packed_float4_goes_to_safetensors_and_back(tmp_path):
    """It was refused as a dtype safetensors cannot store (F4 stores it), and F4 as unknown."""
    import torch.distributed.checkpoint as dcp

    packed = torch.arange(40, dtype=torch.uint8).reshape(4, 5, 2).view(torch.float4_e2m1fn_x2)
    dcp.save({"f4": packed}, checkpoint_id=tmp_path / "dcp", no_dist=True)
    convert_to_safetensors(tmp_path / "dcp", tmp_path / "hf", EVERYTHING)
    with safe_open(tmp_path / "hf" / "model.safetensors", "pt") as handle:
        loaded = handle.get_tensor("f4")
    assert loaded.dtype == packed.dtype and loaded.shape == packed.shape
    assert torch.equal(loaded.view(torch.uint8), packed.view(torch.uint8))
    convert_to_dcp(tmp_path / "hf", tmp_path / "again")
    again = load_with_torch(tmp_path / "again")["f4"]
    assert again.dtype == packed.dtype and torch.equal(again.view(torch.uint8),
                                                       packed.view(torch.uint8))


def test_complex128_is_refused_with_a_remedy_that_works(tmp_path):
    import torch.distributed.checkpoint as dcp

    dcp.save({"z": torch.ones(2, dtype=torch.complex128)}, checkpoint_id=tmp_path / "dcp",
             no_dist=True)
    with pytest.raises(UnsupportedLayoutError, match=r"cannot store \(leave it out with "):
        convert_to_safetensors(tmp_path / "dcp", tmp_path / "hf", EVERYTHING,
                               cast_to=dtype_by_name("float32"))


def test_every_tensor_safetensors_cannot_store_is_named_in_one_refusal(tmp_path, run_cli):
    """Not one per run: a user excluding the first found would meet the next one only then."""
    import torch.distributed.checkpoint as dcp

    dcp.save({"a_c128": torch.ones(2, dtype=torch.complex128), "ok": torch.ones(2),
              "b_c32": torch.ones(2, dtype=torch.complex32)},
             checkpoint_id=tmp_path / "dcp", no_dist=True)
    result = run_cli("convert", tmp_path / "dcp", "--to", "safetensors", "--include", "*",
                     "-o", tmp_path / "hf")
    assert result.exit_code == 1
    assert ("2 tensors have dtypes safetensors cannot store: 'a_c128' (torch.complex128), "
            "'b_c32' (torch.complex32) (leave them out with --exclude)") in result.stderr
    assert not (tmp_path / "hf").exists()


def test_every_object_the_weights_only_loader_refuses_is_named_in_one_refusal(
        tmp_path, run_cli):
    import torch.distributed.checkpoint as dcp

    dcp.save({"a_path": Path("x"), "w": torch.ones(2), "b_path": Path("y"), "n": 3},
             checkpoint_id=tmp_path / "dcp", no_dist=True)
    result = run_cli("convert", tmp_path / "dcp", "--to", "torch", "-o", tmp_path / "out.pt")
    assert result.exit_code == 1
    assert result.stderr.startswith(
        f"Error: {tmp_path / 'dcp'}: 2 objects cannot be loaded with weights_only=True: "
        "'a_path' (")
    assert "; 'b_path' (" in result.stderr
    assert result.stderr.endswith("; leave them out with --exclude\n")
    assert run_cli("convert", tmp_path / "dcp", "--to", "torch", "-o", tmp_path / "out.pt",
                   "--exclude", "*_path").exit_code == 0


def test_a_torch_save_file_with_an_empty_tensor_is_laid_out_as_torchs(tmp_path, run_cli):
    """A data descriptor after an empty tensor's record (torch.save writes none) moved every
    record after it: torch's mmap load, which works offsets out by its writer's layout, read
    `c` from the wrong bytes, and dcpctl refused its own file as a torch.save input."""
    import torch.distributed.checkpoint as dcp
    import torch.utils.serialization as serialization

    state = {f"a{index:02d}": torch.arange(4, dtype=torch.int8) for index in range(10)}
    state.update({"b_empty": torch.empty(0), "c": torch.arange(16, dtype=torch.int64)})
    dcp.save(state, checkpoint_id=tmp_path / "ck", no_dist=True)
    assert run_cli("convert", tmp_path / "ck", "--to", "torch", "-o", tmp_path / "out.pt"
                   ).exit_code == 0
    serialization.config.load.calculate_storage_offsets = True
    try:
        loaded = torch.load(tmp_path / "out.pt", mmap=True, weights_only=True)
    finally:
        serialization.config.load.calculate_storage_offsets = False
    assert all(torch.equal(loaded[name], value) for name, value in state.items())
    assert run_cli("convert", tmp_path / "out.pt", "--to", "dcp", "-o", tmp_path / "back"
                   ).exit_code == 0


def test_a_torch_save_file_of_parameters_converts_to_dcp(tmp_path):
    """`torch.save(dict(model.named_parameters()))` holds nn.Parameters, which were refused as
    not plain tensors."""
    model = torch.nn.Linear(4, 3)
    torch.save(dict(model.named_parameters()), tmp_path / "params.pt")
    convert_to_dcp(tmp_path / "params.pt", tmp_path / "dcp", ranks=2)
    loaded = load_with_torch(tmp_path / "dcp")
    assert all(torch.equal(loaded[name], value.detach())
               for name, value in model.named_parameters())


def test_a_stray_unreadable_safetensors_file_beside_an_indexed_model_is_left_alone(tmp_path):
    """Looking for torch's HF writer's chunk headers read every safetensors file of the
    directory: a stray one (an interrupted download) beside an indexed model stopped it."""
    model = tmp_path / "hf"
    model.mkdir()
    save_file({"a": torch.ones(2)}, model / "model-00001-of-00002.safetensors")
    save_file({"b": torch.zeros(3)}, model / "model-00002-of-00002.safetensors")
    (model / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {
        "a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}))
    (model / "adapter_model.safetensors").write_bytes(b"")
    convert_to_dcp(model, tmp_path / "dcp")
    loaded = load_with_torch(tmp_path / "dcp")
    assert torch.equal(loaded["a"], torch.ones(2)) and torch.equal(loaded["b"], torch.zeros(3))


@pytest.mark.parametrize("to", ["safetensors", "torch"])
def test_a_packed_float4_tensor_is_refused_a_cast_by_name(tmp_path, run_cli, to):
    """float4_e2m1fn_x2 counts as floating point, so --dtype took it, and torch's copy failed:
    an internal error."""
    import torch.distributed.checkpoint as dcp

    packed = torch.zeros(4, 4, dtype=torch.uint8).view(torch.float4_e2m1fn_x2)
    dcp.save({"f4": packed, "w": torch.ones(3)}, checkpoint_id=str(tmp_path / "ck"),
             no_dist=True)
    result = run_cli("convert", tmp_path / "ck", "--to", to, "-o", tmp_path / "out",
                     "--dtype", "bfloat16")
    assert result.exit_code == 1
    assert result.output == (f"Error: {tmp_path / 'ck'}: tensor 'f4' is float4_e2m1fn_x2, two "
                             "values packed in each byte, which torch casts to no other dtype; "
                             "leave it out with --exclude, or convert without --dtype\n")


def test_a_shard_holding_a_tensor_its_index_does_not_name_gives_it_too(tmp_path):
    """As transformers loads every tensor of the files an index lists (a stale index that
    leaves some out is met on the Hub)."""
    model = tmp_path / "hf"
    model.mkdir()
    save_file({"a": torch.ones(2)}, model / "model-00001-of-00002.safetensors")
    save_file({"b": torch.zeros(3), "mtp.w": torch.ones(4)},
              model / "model-00002-of-00002.safetensors")
    (model / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {
        "a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}))
    convert_to_dcp(model, tmp_path / "dcp")
    loaded = load_with_torch(tmp_path / "dcp")
    assert sorted(loaded) == ["a", "b", "mtp.w"] and torch.equal(loaded["mtp.w"], torch.ones(4))


@pytest.mark.parametrize("prefix, keys", [("model.", ["model"]), ("model", ["model"]),
                                          ("a.b.", ["a", "b"]), ("x..y.", None), (".", None),
                                          (".model.", None)])
def test_a_prefix_with_an_empty_key_is_refused_not_dropped(tmp_path, run_cli, prefix, keys):
    torch.save({"w": torch.arange(3.0)}, tmp_path / "w.pt")
    result = run_cli("convert", tmp_path / "w.pt", "--to", "dcp", "-o", tmp_path / "dcp",
                     "--prefix", prefix)
    if keys is None:
        assert result.exit_code == 2, result.output
        assert f"--prefix {prefix!r} leaves a key empty" in result.stderr
        assert not (tmp_path / "dcp").exists()
        return
    assert result.exit_code == 0, result.output
    fqn = ".".join([*keys, "w"])
    assert torch.equal(load_with_torch(tmp_path / "dcp")[fqn], torch.arange(3.0))
    assert tuple(torch_metadata(tmp_path / "dcp").planner_data[fqn]) == (*keys, "w")


def test_a_dtype_dcpctl_does_not_know_is_named_with_its_file_and_key(tmp_path, run_cli):
    torch.save({"ok": torch.ones(2), "flags": torch.zeros(4, dtype=torch.bits8)},
               tmp_path / "bits.pt")
    result = run_cli("convert", tmp_path / "bits.pt", "--to", "dcp", "-o", tmp_path / "dcp")
    assert result.exit_code == 1
    assert result.stderr == (f"Error: {tmp_path / 'bits.pt'}: 'flags' has dtype torch.bits8, "
                             "which dcpctl does not convert\n")


def test_the_report_says_what_prefix_came_off_the_names(tmp_path, run_cli):
    """A Hugging Face model whose every name starts with `model.` (tied embeddings, no
    lm_head.weight) came back from DCP without it, and nothing said so."""
    source = fixture_path("fsdp2_adamw_3ranks")
    result = run_cli("convert", source, "--to", "safetensors", "-o", tmp_path / "hf", "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["stripped_prefix"] == "model."
    result = run_cli("convert", source, "--to", "safetensors", "-o", tmp_path / "hf2")
    assert "'model.' taken off the names that start with it (--strip-prefix '' keeps it)" \
        in result.stdout
    result = run_cli("convert", source, "--to", "safetensors", "-o", tmp_path / "hf3",
                     "--strip-prefix", "", "--json")
    assert json.loads(result.stdout)["stripped_prefix"] == ""
    result = run_cli("convert", source, "--to", "torch", "-o", tmp_path / "t.pt", "--json")
    assert json.loads(result.stdout)["stripped_prefix"] is None


def test_selection_refusals_name_the_source(tmp_path, run_cli):
    source = fixture_path("fsdp2_adamw_3ranks")
    for target, output in (("safetensors", "hf"), ("torch", "t.pt")):
        result = run_cli("convert", source, "--to", target, "-o", tmp_path / output,
                         "--include", "nothing*")
        assert result.exit_code == 1
        assert result.stderr.startswith(f"Error: {source}: nothing to convert: "), result.stderr

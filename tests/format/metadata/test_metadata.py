"""Safe reading and faithful writing of `.metadata`."""

from __future__ import annotations

import dataclasses
import io
import os
import pickle
import subprocess
import sys
from pathlib import Path, PurePosixPath

import pytest
import torch
from conftest import FIXTURE_NAMES, fixture_path, torch_metadata

from dcpctl.errors import MetadataError, UnsafeMetadataError
from dcpctl.format.dtypes import DTYPES_BY_NAME, DTYPES_BY_SAFETENSORS_CODE, dtype_by_name
from dcpctl.format.metadata.reading import parse_metadata, read_metadata
from dcpctl.format.metadata.writing import serialize_metadata


@pytest.mark.parametrize("name", FIXTURE_NAMES)
def test_rewritten_metadata_reads_back_equal(name):
    metadata = read_metadata(fixture_path(name))
    assert parse_metadata(serialize_metadata(metadata)) == metadata


@pytest.mark.parametrize("name", FIXTURE_NAMES)
def test_rewritten_metadata_unpickles_equal_with_torch(name):
    rewritten = pickle.loads(serialize_metadata(read_metadata(fixture_path(name))))
    assert rewritten == torch_metadata(fixture_path(name))


def test_plain_values_and_paths_are_written_as_pickle_writes_them():
    metadata = read_metadata(fixture_path("fsdp2_adamw_3ranks"))
    planner_data = {"text": "ünï", "long": "x" * 300, "ints": [0, 255, 256, -1, 2**31, -2**40],
                    "float": -0.5, "bytes": b"\x00" * 300, "tuple": (1, ("a", None)),
                    "flags": (True, False), "set": {3}, "frozen": frozenset({"f"}),
                    "many": list(range(2500)), "empty": [(), {}, [], set(), frozenset()]}
    metadata.planner_data = planner_data
    metadata.storage_meta.checkpoint_id = PurePosixPath("/runs/step-10")
    data = serialize_metadata(metadata)
    assert parse_metadata(data) == metadata
    from_torch = pickle.loads(data)
    assert from_torch.planner_data == planner_data
    assert from_torch.storage_meta.checkpoint_id == Path("/runs/step-10")


def test_a_container_that_contains_itself_is_refused():
    metadata = read_metadata(fixture_path("fsdp2_adamw_3ranks"))
    loop = []
    loop.append(loop)
    metadata.planner_data = {"loop": loop}
    with pytest.raises(MetadataError, match="contains itself"):
        serialize_metadata(metadata)


def test_reading_and_writing_metadata_do_not_import_torch():
    code = ("import sys; from dcpctl.ops.inspection.report import inspect_checkpoint; "
            "from dcpctl.format.metadata.reading import read_metadata; "
            "from dcpctl.format.metadata.writing import serialize_metadata; "
            f"inspect_checkpoint({str(fixture_path('fsdp2_adamw_3ranks'))!r}); "
            f"serialize_metadata(read_metadata({str(fixture_path('mesh2d_4ranks'))!r})); "
            "print('torch' in sys.modules)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            check=True)
    assert result.stdout.strip() == "False"


class _CreatesFile:
    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (os.system, (f"touch {self.path}",))


def test_pickle_that_would_run_code_is_refused_and_runs_nothing(tmp_path):
    marker = tmp_path / "pwned"
    payload = pickle.dumps({"state_dict_metadata": _CreatesFile(marker)})
    with pytest.raises(UnsafeMetadataError, match="posix.system|os.system"):
        parse_metadata(payload, "hostile/.metadata")
    assert not marker.exists()
    pickle.loads(payload)  # the same payload does run under plain pickle
    assert marker.exists()


@pytest.mark.parametrize("module,name", [
    ("builtins", "eval"), ("torch", "load"), ("torch.serialization", "load"),
    ("subprocess", "Popen"), ("torch", "nn"), ("copyreg", "__newobj__"), ("builtins", "type"),
])
def test_any_global_outside_the_allowlist_is_refused(module, name):
    payload = f"c{module}\n{name}\n(tR.".encode()
    with pytest.raises(UnsafeMetadataError, match=f"{module}.{name}"):
        parse_metadata(payload, "x/.metadata")


def test_reconstructor_only_builds_metadata_records():
    payload = b"ccopyreg\n_reconstructor\n(cbuiltins\nobject\ncbuiltins\nobject\nNtR."
    with pytest.raises(UnsafeMetadataError, match="_reconstructor"):
        parse_metadata(payload, "x/.metadata")


def test_unknown_layout_name_is_refused():
    payload = b"ctorch.serialization\n_get_layout\n(Vos.system\ntR."
    with pytest.raises(UnsafeMetadataError, match="layout"):
        parse_metadata(payload, "x/.metadata")


@pytest.mark.parametrize("data,message", [
    (b"", "empty"),
    (b"this is not a pickle at all", "not a readable DCP metadata pickle"),
    (pickle.dumps({"a": 1}), "holds a dict, not DCP Metadata"),
    (pickle.dumps([1, 2, 3]), "holds a list"),
])
def test_garbage_metadata_is_a_metadata_error(data, message):
    with pytest.raises(MetadataError, match=message):
        parse_metadata(data, "x/.metadata")


@pytest.mark.parametrize("name", FIXTURE_NAMES)
def test_truncated_metadata_is_a_metadata_error(name):
    data = (fixture_path(name) / ".metadata").read_bytes()
    for cut in (1, len(data) // 2, len(data) - 1):
        with pytest.raises(MetadataError):
            parse_metadata(data[:cut], "x/.metadata")


def test_what_fits_in_torch_is_what_torch_makes():
    """A shape whose element count is 0 can still overflow torch's own counting (left to
    right in uint64, and its contiguous strides): (2**32, 2**32, 0) passed every check and
    came out as files torch and safetensors refuse to load."""
    import random

    from dcpctl.format.dtypes import fits_in_torch

    chooser = random.Random(7)
    powers = [0, 1, 2, 3, 2**20, 2**31, 2**32, 2**40, 2**61, 2**62, 2**63 - 1]
    for _ in range(3000):
        shape = tuple(chooser.choice(powers) for _ in range(chooser.randint(0, 4)))
        itemsize = chooser.choice([1, 2, 8])
        try:
            torch.empty(shape, dtype={1: torch.uint8, 2: torch.int16, 8: torch.int64}[itemsize],
                        device="meta")
            made = True
        except RuntimeError:
            made = False
        assert fits_in_torch(shape, itemsize) == made, (shape, itemsize)


def _edited_metadata(edit) -> bytes:
    metadata = torch_metadata(fixture_path("fsdp2_adamw_3ranks"))
    edit(metadata)
    return pickle.dumps(metadata)


def test_chunk_outside_its_tensor_is_refused():
    def grow_chunk(metadata):
        chunk = metadata.state_dict_metadata["model.embed.weight"].chunks[0]
        chunk.sizes = torch.Size([11, 6])

    with pytest.raises(MetadataError, match="model.embed.weight.*outside"):
        parse_metadata(_edited_metadata(grow_chunk), "x/.metadata")


def test_storage_for_an_unknown_fqn_is_refused():
    def orphan(metadata):
        del metadata.state_dict_metadata["model.embed.weight"]

    with pytest.raises(MetadataError, match="model.embed.weight.*lacks"):
        parse_metadata(_edited_metadata(orphan), "x/.metadata")


def test_negative_byte_range_is_refused():
    def negative(metadata):
        next(iter(metadata.storage_data.values())).offset = -5

    with pytest.raises(MetadataError, match="non-negative"):
        parse_metadata(_edited_metadata(negative), "x/.metadata")


def test_dtype_table_agrees_with_torch():
    for name, dtype in DTYPES_BY_NAME.items():
        torch_dtype = getattr(torch, name)
        assert dtype.itemsize == torch_dtype.itemsize, name
        assert dtype.is_floating_point == torch_dtype.is_floating_point, name
    from safetensors.torch import _TYPES

    for code, torch_dtype in _TYPES.items():
        assert DTYPES_BY_SAFETENSORS_CODE[code].name == str(torch_dtype).removeprefix("torch.")
    assert dtype_by_name("torch.half").name == "float16"


def _many_tensors_metadata(count: int = 2000):
    """fsdp2_adamw_3ranks' metadata grown to `count` more tensors, each a copy of one entry."""
    metadata = read_metadata(fixture_path("fsdp2_adamw_3ranks"))
    entry = metadata.state_dict_metadata["model.embed.weight"]
    storage = {key: info for key, info in metadata.storage_data.items()
               if key.fqn == "model.embed.weight"}
    for index in range(count):
        fqn = f"copies.{index}.weight"
        metadata.state_dict_metadata[fqn] = dataclasses.replace(
            entry, chunks=[dataclasses.replace(chunk) for chunk in entry.chunks])
        for key, info in storage.items():
            metadata.storage_data[dataclasses.replace(key, fqn=fqn)] = dataclasses.replace(info)
        metadata.planner_data[fqn] = ("copies", str(index), "weight")
    return metadata


def _refusal(edit) -> str:
    metadata = _many_tensors_metadata()
    edit(metadata)
    with pytest.raises(MetadataError) as raised:
        parse_metadata(serialize_metadata(metadata), "x/.metadata")
    return str(raised.value)


def test_many_sound_tensors_read_back_equal():
    metadata = _many_tensors_metadata()
    assert parse_metadata(serialize_metadata(metadata)) == metadata


def test_a_local_metadata_is_unpickled_as_it_is_read_never_whole(tmp_path, monkeypatch):
    """At a million chunks `.metadata` is 142 MB: it is read in pieces of the read buffer while
    the unpickler goes, not held whole beside what it unpickles to."""
    from dcpctl.format.metadata import reading

    metadata = _many_tensors_metadata(6000)
    data = serialize_metadata(metadata)
    assert len(data) > 2 * reading._READ_BUFFER_BYTES
    (tmp_path / ".metadata").write_bytes(data)
    largest_read = []
    opened = reading.open_for_reading

    class Recorded(io.RawIOBase):
        def __init__(self, path):
            self.raw = opened(path)

        def readable(self):
            return True

        def fileno(self):
            return self.raw.fileno()

        def readinto(self, buffer):
            count = self.raw.readinto(buffer)
            largest_read.append(count)
            return count

        def close(self):
            self.raw.close()
            super().close()

    monkeypatch.setattr(reading, "open_for_reading", Recorded)
    assert read_metadata(tmp_path) == metadata
    assert sum(largest_read) == len(data)
    assert max(largest_read) <= reading._READ_BUFFER_BYTES


@pytest.mark.parametrize("value", [1.0, True, -1, "1", None])
def test_one_chunk_offset_that_is_not_a_non_negative_int_is_refused(value):
    def edit(metadata):
        chunk = metadata.state_dict_metadata["copies.1500.weight"].chunks[1]
        chunk.offsets = (value, *chunk.offsets[1:])

    assert "'copies.1500.weight'" in _refusal(edit)


def test_one_tensor_size_that_is_a_bool_is_refused():
    def edit(metadata):
        entry = metadata.state_dict_metadata["copies.1999.weight"]
        entry.size = (entry.size[0], True)

    assert "copies.1999.weight" in _refusal(edit)


def test_chunk_of_the_wrong_rank_is_refused():
    def edit(metadata):
        chunk = metadata.state_dict_metadata["copies.700.weight"].chunks[0]
        chunk.offsets, chunk.sizes = (0,), (1,)

    assert "copies.700.weight' has a chunk that is not 2-d" in _refusal(edit)


def test_one_chunk_past_its_tensor_among_many_is_named():
    def edit(metadata):
        chunk = metadata.state_dict_metadata["copies.1234.weight"].chunks[2]
        chunk.sizes = (chunk.sizes[0] + 1, chunk.sizes[1])

    assert "copies.1234.weight': chunk at" in _refusal(edit)


def test_storage_key_offset_that_is_not_a_tuple_of_ints_is_refused():
    def edit(metadata):
        key = next(key for key in metadata.storage_data if key.fqn == "copies.5.weight")
        info = metadata.storage_data.pop(key)
        metadata.storage_data[dataclasses.replace(key, offset=(0.0, 0))] = info

    assert "storage_data key for 'copies.5.weight' has offset" in _refusal(edit)


def test_transforms_that_are_not_names_are_refused():
    def edit(metadata):
        key = next(key for key in metadata.storage_data if key.fqn == "copies.9.weight")
        metadata.storage_data[key].transform_descriptors = ("stream.zstd/1", 3)

    assert "'copies.9.weight' has transforms" in _refusal(edit)


def test_a_record_without_its_fields_is_a_metadata_error():
    payload = (b"\x80\x04ctorch.distributed.checkpoint.metadata\nMetadata\n)\x81.")
    with pytest.raises(MetadataError, match="lacks a field"):
        parse_metadata(payload, "x/.metadata")


def test_transforms_are_read_as_tuples_and_an_empty_list_as_none():
    metadata = _many_tensors_metadata(10)
    infos = list(metadata.storage_data.values())
    infos[0].transform_descriptors, infos[1].transform_descriptors = ["stream.zstd/1"], []
    read = list(parse_metadata(serialize_metadata(metadata)).storage_data.values())
    assert [info.transform_descriptors for info in read[:3]] == [("stream.zstd/1",), None, None]


@pytest.mark.parametrize("version", [["1.0.0"], 1, b"1.0.0"])
def test_version_that_is_not_a_string_is_refused(version):
    def edit(metadata):
        metadata.version = version

    with pytest.raises(MetadataError, match=f"x/.metadata: version is a {type(version).__name__}, "
                                            "not a string"):
        parse_metadata(_edited_metadata(edit), "x/.metadata")


def test_metadata_without_a_version_reads():
    def edit(metadata):
        metadata.version = None

    assert parse_metadata(_edited_metadata(edit), "x/.metadata").version is None


@pytest.mark.parametrize("storage_meta", [5, "ids", {"save_id": "x"}])
def test_storage_meta_that_is_not_torchs_record_is_refused(storage_meta):
    metadata = torch_metadata(fixture_path("mesh2d_4ranks"))
    metadata.storage_meta = storage_meta
    with pytest.raises(MetadataError, match=f"x/.metadata: storage_meta is a "
                                            f"{type(storage_meta).__name__}, not torch's"):
        parse_metadata(pickle.dumps(metadata), "x/.metadata")


def test_a_bytearray_too_large_to_allocate_is_refused_without_a_stray_line():
    """CPython prints "SystemError: deallocated bytearray object has exported buffers" for
    some of these (at random: it reads an unset field); the error line must be all there is."""
    code = ("from dcpctl.format.metadata.reading import parse_metadata\n"
            "from dcpctl.errors import MetadataError\n"
            "for size in [2**40, 2**50, 2**62, 2**63 - 1] * 10:\n"
            "    try:\n"
            "        parse_metadata(b'\\x80\\x05\\x96' + size.to_bytes(8, 'little') + b'.', 'x')\n"
            "    except MetadataError as error:\n"
            "        assert 'asks for more memory than a pickle of' in str(error), error\n"
            "    else:\n"
            "        raise AssertionError('read')\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0 and result.stderr == "", result.stderr


def _with_save_plans(metadata):
    """What Megatron-Core's torch_dist saver leaves in `.metadata`: its local save plans."""
    from torch.distributed.checkpoint.metadata import MetadataIndex
    from torch.distributed.checkpoint.planner import (SavePlan, TensorWriteData, WriteItem,
                                                      WriteItemType)
    items = [WriteItem(index=MetadataIndex(fqn, entry.chunks[0].offsets), type=WriteItemType.SHARD,
                       tensor_data=TensorWriteData(entry.chunks[0], entry.properties, entry.size))
             for fqn, entry in metadata.state_dict_metadata.items() if hasattr(entry, "chunks")]
    metadata.all_local_plans = [SavePlan(items=items[:2]), SavePlan(items=items[2:])]


def test_megatron_save_plans_are_read_inert_and_dropped():
    metadata = torch_metadata(fixture_path("fsdp2_adamw_3ranks"))
    plain = parse_metadata(pickle.dumps(metadata), "x/.metadata")
    _with_save_plans(metadata)
    read = parse_metadata(pickle.dumps(metadata), "x/.metadata")
    assert read == plain and not hasattr(read, "all_local_plans")


def test_a_save_plan_anywhere_but_all_local_plans_is_refused():
    def edit(metadata):
        _with_save_plans(metadata)
        metadata.planner_data = metadata.all_local_plans

    with pytest.raises(MetadataError, match="planner_data"):
        parse_metadata(_edited_metadata(edit), "x/.metadata")


def test_an_unknown_write_item_type_is_refused():
    payload = b"ctorch.distributed.checkpoint.planner\nWriteItemType\n(K\x07tR."
    with pytest.raises(UnsafeMetadataError, match="WriteItemType 7"):
        parse_metadata(payload, "x/.metadata")


def test_an_attribute_torch_does_not_write_is_refused_not_dropped():
    def edit(metadata):
        metadata.loader_hint = "keep me"

    with pytest.raises(MetadataError, match="attributes.*loader_hint"):
        parse_metadata(_edited_metadata(edit), "x/.metadata")


def _nested(depth: int) -> list:
    value: list = []
    for _ in range(depth):
        value = [value]
    return value


@pytest.mark.parametrize("mcore_data,message", [
    (["not", "a", "dict"], "mcore_data is a list"),
    ({"w": {"grid": _nested(40)}}, "mcore_data nests deeper"),
])
def test_megatron_mcore_data_must_be_a_dict_of_plain_values(mcore_data, message):
    def edit(metadata):
        metadata.mcore_data = mcore_data

    with pytest.raises(MetadataError, match=message):
        parse_metadata(_edited_metadata(edit), "x/.metadata")


def test_megatron_mcore_data_reads_and_writes_back():
    def edit(metadata):
        metadata.mcore_data = {"decoder.weight": {"nd_reformulated_orig_global_shape": (4, 8)}}

    read = parse_metadata(_edited_metadata(edit), "x/.metadata")
    assert read.mcore_data == {"decoder.weight": {"nd_reformulated_orig_global_shape": (4, 8)}}
    assert parse_metadata(serialize_metadata(read)) == read
    assert pickle.loads(serialize_metadata(read)).mcore_data == read.mcore_data


@pytest.mark.parametrize("state, refused", [
    ({"fqn": "w", "offset": (0,), "index": 0}, False),  # what torch pickles
    ({"fqn": "w", "offset": (0,)}, False),  # fields at their defaults left out
    ({"fqn": "w"}, False),
    ({"fqn": "w", "offset": (0,), "placement": 0}, True),  # as many fields, one not torch's
    ({"fqn": "w", "offset": (0,), "index": 0, "placement": 0}, True),
    ({"offset": (0,), "index": 0, "placement": 0}, True),
    ({"offset": (0,), "index": 0}, True),
    ([("fqn", "w"), ("offset", (0,)), ("index", 0)], True),
])
def test_a_storage_key_is_built_only_from_torch_s_fields(state, refused):
    from dcpctl.format.metadata.records import MetadataIndex

    key = MetadataIndex.__new__(MetadataIndex)
    if refused:
        with pytest.raises(MetadataError, match="holds a MetadataIndex whose pickled fields"):
            key.__setstate__(state)
    else:
        key.__setstate__(state)
        assert (key.fqn, key.offset, key.index) == (state["fqn"], state.get("offset"),
                                                    state.get("index"))

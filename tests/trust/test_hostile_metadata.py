"""A `.metadata` from a stranger can make the unpickler build what it likes. What it builds is
bounded by what the file can honestly describe: no crash, no runaway memory or time, a one-line
error naming the file."""

from __future__ import annotations

import pickle
import shutil
import struct
import subprocess
import sys
import time

import pytest
import torch
from conftest import fixture_path, torch_metadata
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, TensorStorageMetadata

MARKER = "__dcpctl_test_marker__"


def _write_metadata(checkpoint, metadata) -> None:
    # protocol 2 has no frames, whose declared lengths a splice would break
    (checkpoint / ".metadata").write_bytes(pickle.dumps(metadata, protocol=2))


def _splice(checkpoint, opcodes: bytes) -> None:
    """Put raw pickle opcodes where the pickled MARKER string stands (the memo slot it is put
    in after stays, now holding what the opcodes built)."""
    data = (checkpoint / ".metadata").read_bytes()
    pickled_marker = b"X" + struct.pack("<I", len(MARKER)) + MARKER.encode()  # BINUNICODE
    assert data.count(pickled_marker) == 1
    (checkpoint / ".metadata").write_bytes(data.replace(pickled_marker, opcodes))


def _inspect_in_a_process(checkpoint) -> tuple[subprocess.CompletedProcess, float, int]:
    """`dcpctl inspect` run apart (a crash must show as a crash), its seconds and peak RSS."""
    # VmHWM, not ru_maxrss: that one keeps the high-water mark of the forking parent
    code = ("import re, sys\nfrom dcpctl.cli.main import main\nsys.argv = ['dcpctl', "
            f"'inspect', {str(checkpoint)!r}]\ntry:\n    main()\nfinally:\n    print(re.search("
            "r'VmHWM:\\s+(\\d+)', open('/proc/self/status').read()).group(1), file=sys.stderr)")
    started = time.perf_counter()
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    lines = result.stderr.splitlines()
    peak_kib = int(lines[-1]) if lines and lines[-1].isdigit() else -1
    return result, time.perf_counter() - started, peak_kib


@pytest.fixture
def checkpoint(tmp_path):
    path = tmp_path / "ckpt"
    shutil.copytree(fixture_path("mesh2d_4ranks"), path)
    return path


def _refused(result, words: str) -> None:
    assert result.returncode == 1, (result.returncode, result.stderr[-300:])
    assert result.stderr.startswith("Error: ") and ".metadata" in result.stderr
    assert words in result.stderr, result.stderr[:300]
    assert len(result.stderr.splitlines()) == 2  # the error, then the peak RSS line


def test_a_deeply_nested_tuple_used_as_a_key_is_refused_not_a_crash(checkpoint):
    metadata = torch_metadata(checkpoint)
    metadata.planner_data = {MARKER: ("x",)}
    _write_metadata(checkpoint, metadata)
    _splice(checkpoint, b")" + b"\x85" * 2_000_000)  # ((((),),),) two million deep
    result, seconds, peak_kib = _inspect_in_a_process(checkpoint)
    _refused(result, "planner_data")
    # measured here: 1.0 s, 237 MiB (the unpickler's stack grows with the file, 2 MB here)
    assert seconds < 30 and 0 < peak_kib < 512 * 1024, (seconds, peak_kib)


def test_a_deeply_nested_list_is_refused_not_an_internal_error(checkpoint):
    metadata = torch_metadata(checkpoint)
    metadata.planner_data = {"grid": MARKER}
    _write_metadata(checkpoint, metadata)
    _splice(checkpoint, b"]" * 200_000 + b"a" * 199_999)
    result, _, _ = _inspect_in_a_process(checkpoint)
    _refused(result, "nests deeper")


class _Rebuilt:
    """Pickles as `callable(*arguments)`: what a hostile file can ask the unpickler to run."""

    def __init__(self, callable_, *arguments) -> None:
        self.reduced = (callable_, arguments)

    def __reduce__(self):
        return self.reduced


@pytest.mark.parametrize("attack", ["size of a long string", "ordered dict of many pairs",
                                    "long path"])
def test_memoized_values_rebuilt_many_times_cost_nothing(checkpoint, attack):
    """A 1 MiB string (or 100,000 pairs) pickled once and handed 400 times to a constructor
    that would copy it: 400 MiB (or 40 million entries) built from a file of about 1 MiB."""
    import collections
    import pathlib

    metadata = torch_metadata(checkpoint)
    grid = metadata.state_dict_metadata["grid"]
    long_text = "7" * (1 << 20)
    pairs = [(str(index), index) for index in range(100_000)]
    for index in range(400):
        if attack == "size of a long string":
            rebuilt = _Rebuilt(torch.Size, long_text)
        elif attack == "ordered dict of many pairs":
            rebuilt = _Rebuilt(collections.OrderedDict, pairs)
        else:
            rebuilt = _Rebuilt(pathlib.PurePosixPath, *[long_text] * 4)
        metadata.state_dict_metadata[f"copy{index}"] = TensorStorageMetadata(
            grid.properties, rebuilt, [])
    _write_metadata(checkpoint, metadata)
    assert (checkpoint / ".metadata").stat().st_size < 3 << 20
    result, seconds, peak_kib = _inspect_in_a_process(checkpoint)
    assert result.returncode == 1 and result.stderr.startswith("Error: "), result.stderr[-300:]
    assert peak_kib < 400 * 1024, peak_kib


def test_one_tensor_entry_shared_by_many_fqns_is_refused_at_once(checkpoint):
    """A thousand fqns, one tensor entry of 100,000 chunks: a hundred million chunks to
    check from a file of a few MB."""
    metadata = torch_metadata(checkpoint)
    chunks = [ChunkStorageMetadata(torch.Size([index]), torch.Size([1]))
              for index in range(100_000)]
    shared = TensorStorageMetadata(metadata.state_dict_metadata["grid"].properties,
                                   torch.Size([100_000]), chunks)
    for index in range(1000):
        metadata.state_dict_metadata[f"copy{index}"] = shared
    _write_metadata(checkpoint, metadata)
    result, seconds, _ = _inspect_in_a_process(checkpoint)
    _refused(result, "one tensor entry or chunk list")
    assert seconds < 30


@pytest.mark.parametrize("place", ["planner_data", "mcore_data", "storage_meta"])
def test_a_chunk_record_placed_in_plain_data_too_is_written_back_as_it_was_read(
        checkpoint, tmp_path, run_cli, place):
    """A chunk record takes its fields from the dict the pickle built, and a pickle can place
    that same dict in plain data too, which a rewrite carries over: neither reading the chunk
    nor what opening the checkpoint sets on it (its storage entry) may change it there."""
    from torch.distributed.checkpoint.metadata import StorageMeta

    metadata = torch_metadata(checkpoint)
    chunk_state = metadata.state_dict_metadata["grid"].chunks[0].__dict__
    if place == "planner_data":
        metadata.planner_data = {"grid": chunk_state}  # a custom planner's data
    elif place == "mcore_data":
        metadata.mcore_data = {"grid": chunk_state}
    else:
        metadata.storage_meta = StorageMeta(checkpoint_id=chunk_state)
    _write_metadata(checkpoint, metadata)
    expected = dict(chunk_state)
    output = tmp_path / "compressed"
    result = run_cli("compress", checkpoint, "-o", output)
    assert result.exit_code == 0, result.output
    rewritten = torch_metadata(output)
    carried = {"planner_data": lambda: rewritten.planner_data["grid"],
               "mcore_data": lambda: rewritten.mcore_data["grid"],
               "storage_meta": lambda: rewritten.storage_meta.checkpoint_id}[place]()
    assert carried == expected


@pytest.mark.parametrize("state", ["a class with __slots__'s", "an extra field",
                                   "a field missing"])
def test_a_chunk_whose_pickled_fields_are_not_torchs_is_refused_in_one_line(checkpoint, state):
    """torch's ChunkStorageMetadata pickles its two fields as a dict; a chunk given any other
    state is refused, not half built, and a field a rewrite would drop is not dropped."""
    import copyreg

    metadata = torch_metadata(checkpoint)
    chunk = metadata.state_dict_metadata["grid"].chunks[0]
    fields = dict(vars(chunk))
    if state == "an extra field":
        fields["placement"] = "replicated"
    elif state == "a field missing":
        del fields["sizes"]
    rebuilt = _Rebuilt(copyreg._reconstructor, type(chunk), object, None)
    rebuilt.reduced += ((None, fields) if state == "a class with __slots__'s" else fields,)
    metadata.state_dict_metadata["grid"].chunks[0] = rebuilt
    (checkpoint / ".metadata").write_bytes(pickle.dumps(metadata, protocol=4))
    result, _, _ = _inspect_in_a_process(checkpoint)
    _refused(result, "holds a ChunkStorageMetadata whose pickled fields are not torch's "
                     "offsets, sizes")


@pytest.mark.parametrize("record", ["MetadataIndex", "_StorageInfo"])
def test_a_storage_key_or_entry_with_a_field_torch_lacks_is_refused(checkpoint, record):
    """A rewrite would drop a field dcpctl does not know: refused rather than dropped."""
    from dcpctl.errors import MetadataError
    from dcpctl.format.metadata.reading import parse_metadata

    metadata = torch_metadata(checkpoint)
    key, info = next(iter(metadata.storage_data.items()))
    object.__setattr__(key if record == "MetadataIndex" else info, "placement", "replicated")
    with pytest.raises(MetadataError, match=f"holds a {record} whose pickled fields are not"):
        parse_metadata(pickle.dumps(metadata, protocol=4), "x/.metadata")
    object.__delattr__(key if record == "MetadataIndex" else info, "placement")
    assert len(parse_metadata(pickle.dumps(metadata, protocol=4)).storage_data) == len(
        metadata.storage_data)


@pytest.mark.parametrize("state", [("a", "strided"), ("requires_grad", "yes"),
                                   ("memory_format", 7), ("pin_memory", 1)])
def test_tensor_properties_that_are_not_torchs_are_refused_in_one_line(
        checkpoint, tmp_path, run_cli, monkeypatch, state):
    """torch pickles TensorProperties as a tuple (dtype, layout, requires_grad, memory format
    code, pin_memory); a damaged one was read as it came and broke a rewrite with an internal
    error (a memory format code that is a string)."""
    from torch.distributed.checkpoint.metadata import TensorProperties

    field, value = state

    def damaged(properties):
        fields = [properties.dtype, properties.layout, properties.requires_grad, 0,
                  properties.pin_memory]
        if field == "a":
            return tuple(fields[:3])
        fields[{"requires_grad": 2, "memory_format": 3, "pin_memory": 4}[field]] = value
        return tuple(fields)

    metadata = torch_metadata(checkpoint)
    monkeypatch.setattr(TensorProperties, "__getstate__", damaged)
    _write_metadata(checkpoint, metadata)
    monkeypatch.undo()
    for command in (["verify"], ["compress", "-o", tmp_path / "out"]):
        result = run_cli(command[0], checkpoint, *command[1:])
        assert result.exit_code == 1, result.output
        assert "holds a TensorProperties whose pickled state is not torch's" in result.output
        assert "internal error" not in result.output
    assert not (tmp_path / "out").exists()


def test_storage_meta_of_an_older_torch_is_read_and_written_back_with_torchs_defaults(
        checkpoint, tmp_path, run_cli):
    """torch before `modules` pickled StorageMeta without it: reading left the field unset, and
    every rewrite stopped with an internal error."""
    from torch.distributed.checkpoint.metadata import StorageMeta

    metadata = torch_metadata(checkpoint)
    metadata.storage_meta = StorageMeta(checkpoint_id="run-7", save_id="s")
    del metadata.storage_meta.modules
    _write_metadata(checkpoint, metadata)
    assert b"modules" not in (checkpoint / ".metadata").read_bytes()
    result = run_cli("compress", checkpoint, "-o", tmp_path / "out")
    assert result.exit_code == 0, result.output
    rewritten = torch_metadata(tmp_path / "out").storage_meta
    assert (rewritten.checkpoint_id, rewritten.save_id, rewritten.load_id,
            rewritten.modules) == ("run-7", "s", None, [])


@pytest.mark.parametrize("field, value, words", [
    ("owner", "someone", "holds a StorageMeta whose pickled fields are not torch's"),
    ("modules", "torch.nn", "storage_meta's modules are not a list of names")])
def test_storage_meta_with_fields_not_torchs_is_refused(checkpoint, tmp_path, run_cli, field,
                                                        value, words):
    from torch.distributed.checkpoint.metadata import StorageMeta

    metadata = torch_metadata(checkpoint)
    metadata.storage_meta = StorageMeta()
    setattr(metadata.storage_meta, field, value)
    _write_metadata(checkpoint, metadata)
    result = run_cli("compress", checkpoint, "-o", tmp_path / "out")
    assert result.exit_code == 1 and words in result.output, result.output
    assert len(result.output.splitlines()) == 1


def test_a_memo_index_far_past_the_file_is_refused_in_bounded_memory(checkpoint):
    """CPython's C unpickler sizes its memo table by the largest index a pickle names: one
    LONG_BINPUT of index 2**28 in a file of 2 KB asked for 4 GiB (zeroed), and 2**31 for
    32 GiB. dcpctl's processes cap what an unpickling may take (unpickling_memory.py)."""
    metadata = torch_metadata(checkpoint)
    metadata.planner_data = {"note": MARKER}
    _write_metadata(checkpoint, metadata)
    _splice(checkpoint, b"X\x01\x00\x00\x00x" + b"r" + struct.pack("<I", 1 << 28))
    result, seconds, peak_kib = _inspect_in_a_process(checkpoint)
    _refused(result, "asks for more memory than a pickle of")
    # measured here: 0.3 s and 60 MiB, against 6 s and 4.2 GiB uncapped
    assert seconds < 30 and 0 < peak_kib < 512 * 1024, (seconds, peak_kib)


@pytest.mark.parametrize("value", [1.5, b"1", " 0 ", 3])
def test_a_memory_format_encoding_not_torchs_is_refused_not_coerced(
        checkpoint, monkeypatch, value):
    """torch pickles the memory format as its enum called with its value; any int() took was
    taken (1.5 as 1), where torch's own reading refuses all but the enum's values."""
    from torch.distributed.checkpoint.metadata import _MEM_FORMAT_ENCODING

    from dcpctl.errors import UnsafeMetadataError
    from dcpctl.format.metadata.reading import parse_metadata

    metadata = torch_metadata(checkpoint)
    monkeypatch.setattr(_MEM_FORMAT_ENCODING, "__reduce_ex__",
                        lambda self, protocol: (_MEM_FORMAT_ENCODING, (value,)))
    data = pickle.dumps(metadata, protocol=4)
    monkeypatch.undo()
    with pytest.raises(UnsafeMetadataError, match="unknown memory format encoding"):
        parse_metadata(data, "x/.metadata")

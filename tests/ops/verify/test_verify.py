"""`verify` finds each injected fault, names it, and passes every clean checkpoint."""

from __future__ import annotations

import itertools
import math
import pickle
import re

import pytest
import torch
from conftest import FIXTURE_NAMES, REPO_ROOT, fixture_path, flip_bit, torch_metadata
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.distributed.checkpoint.metadata import MetadataIndex

from dcpctl.format.checkpoint.problems import ALL_RULES
from dcpctl.format.checkpoint.structure import (_tiles_as_grid, _tiles_by_rows,
                                                find_overlapping_boxes)
from dcpctl.format.checkpoint.view import TensorEntry, open_checkpoint
from dcpctl.format.dtypes import DTYPES_BY_NAME
from dcpctl.format.metadata.records import ChunkMetadata
from dcpctl.format.torch_save.layout import read_torch_save_layout
from dcpctl.ops.checksum import checksum_checkpoint
from dcpctl.ops.verify.verifier import verify_checkpoint


def rules(report) -> set[str]:
    return {problem.rule for problem in report.problems}


def only_problem(report, rule):
    found = [problem for problem in report.problems if problem.rule == rule]
    assert len(found) == 1, report.problems
    return found[0]


def tensor_data_offset(checkpoint_dir, fqn: str) -> tuple[str, int]:
    """(file, offset in it) of a byte in the middle of the first chunk's tensor data."""
    checkpoint = open_checkpoint(checkpoint_dir)
    tensor = next(t for t in checkpoint.tensors if t.fqn == fqn)
    storage = tensor.chunks[0].storage
    with open(checkpoint_dir / storage.relative_path, "rb") as stream:
        def read_range(start, count):
            stream.seek(storage.offset + start)
            return stream.read(count)
        layout = read_torch_save_layout(read_range, storage.length)
    return storage.relative_path, storage.offset + layout.payload_offset + layout.tensor.nbytes // 2


def edit_metadata(checkpoint_dir, edit) -> None:
    """Rewrite .metadata through torch's own classes."""
    metadata = torch_metadata(checkpoint_dir)
    edit(metadata)
    (checkpoint_dir / ".metadata").write_bytes(pickle.dumps(metadata))


@pytest.mark.parametrize("name", FIXTURE_NAMES)
@pytest.mark.parametrize("with_sums", [False, True])
def test_clean_checkpoints_verify(name, with_sums, copy_fixture):
    checkpoint = copy_fixture(name)
    if with_sums:
        checksum_checkpoint(checkpoint)
    for deep in (True, False):
        report = verify_checkpoint(checkpoint, deep=deep)
        assert report.problems == [] and report.status == "ok" and report.exit_code == 0
        assert report.checksummed_files == (len(report_files(checkpoint)) if with_sums else None)
    deep_report = verify_checkpoint(checkpoint, threads=1)
    assert deep_report.items_checked == len(torch_metadata(checkpoint).storage_data)


def report_files(checkpoint_dir):
    return [path for path in checkpoint_dir.iterdir() if path.name != "SHA256SUMS"]


def test_flipped_tensor_bit_is_found_by_checksum_and_by_crc(copy_fixture):
    checkpoint = copy_fixture("fsdp2_adamw_3ranks")
    checksum_checkpoint(checkpoint)
    file_name, offset = tensor_data_offset(checkpoint, "model.proj.weight")
    flip_bit(checkpoint / file_name, offset)

    deep = verify_checkpoint(checkpoint)
    assert deep.status == "damaged" and rules(deep) == {"checksum-mismatch", "crc-mismatch"}
    assert only_problem(deep, "checksum-mismatch").file == file_name
    crc = only_problem(deep, "crc-mismatch")
    assert crc.fqns == ("model.proj.weight",) and crc.file == file_name
    assert crc.start <= offset < crc.end and "archive/data/0" in crc.message

    assert rules(verify_checkpoint(checkpoint, deep=False)) == {"checksum-mismatch"}
    (checkpoint / "SHA256SUMS").unlink()
    assert rules(verify_checkpoint(checkpoint)) == {"crc-mismatch"}


def test_flipped_bit_in_a_zstd_item_is_found(copy_fixture):
    checkpoint = copy_fixture("zstd_fsdp2_2ranks")
    metadata = open_checkpoint(checkpoint)
    tensor = next(t for t in metadata.tensors if t.fqn == "model.embed.weight")
    storage = tensor.chunks[0].storage
    flip_bit(checkpoint / storage.relative_path, storage.offset + storage.length // 2)
    report = verify_checkpoint(checkpoint)
    assert report.status == "damaged"
    assert rules(report) <= {"decode", "archive", "crc-mismatch"}
    for problem in report.problems:
        assert problem.fqns == ("model.embed.weight",)
        assert (problem.file, problem.start, problem.end) == (
            storage.relative_path, storage.offset, storage.offset + storage.length)


def test_bytes_after_a_zstd_items_frame_are_found(copy_fixture):
    """decompress refuses them, so verify does too (torch's reader would ignore them)."""
    checkpoint = copy_fixture("zstd_fsdp2_2ranks")
    storage_data = torch_metadata(checkpoint).storage_data
    key, last = max(((key, info) for key, info in storage_data.items()
                     if info.relative_path == "__0_0.distcp"), key=lambda pair: pair[1].offset)
    with open(checkpoint / last.relative_path, "ab") as stream:
        stream.write(b"\0" * 16)

    def lengthen(metadata):
        metadata.storage_data[key].length += 16

    edit_metadata(checkpoint, lengthen)
    problem = only_problem(verify_checkpoint(checkpoint), "decode")
    assert "bytes follow the end of the zstd frame" in problem.message
    assert problem.fqns == (key.fqn,) and problem.end == last.offset + last.length + 16


def test_truncated_file(copy_fixture):
    checkpoint = copy_fixture("fsdp2_adamw_3ranks")
    path = checkpoint / "__1_0.distcp"
    path.write_bytes(path.read_bytes()[:20_000])
    for deep in (True, False):
        problem = only_problem(verify_checkpoint(checkpoint, deep=deep), "truncated")
        assert problem.file == "__1_0.distcp" and problem.start == 20_000
        assert problem.end == 44_661 and len(problem.fqns) > 5


def test_missing_and_extra_files(copy_fixture):
    checkpoint = copy_fixture("objects_2ranks")
    (checkpoint / "__0_3.distcp").unlink()
    (checkpoint / "notes.txt").write_text("hello")
    report = verify_checkpoint(checkpoint)
    assert rules(report) == {"missing-file", "unknown-file"}
    missing = only_problem(report, "missing-file")
    assert missing.file == "__0_3.distcp" and missing.fqns == ("weights.mask",)
    assert only_problem(report, "unknown-file").file == "notes.txt"


def test_empty_files_of_idle_writer_threads_are_not_unknown(tmp_path):
    """torch's FileSystemWriter opens a file per thread: with more threads than items, some
    stay empty. A data file that holds bytes the metadata does not name is still unknown."""
    import torch.distributed.checkpoint as dcp

    checkpoint = tmp_path / "saved"
    dcp.save({"w": torch.ones(4), "step": 3}, no_dist=True,
             storage_writer=dcp.FileSystemWriter(checkpoint, thread_count=4))
    empty = sorted(path.name for path in checkpoint.glob("*.distcp") if path.stat().st_size == 0)
    assert empty and verify_checkpoint(checkpoint).problems == []
    (checkpoint / empty[0]).write_bytes(b"x")
    assert only_problem(verify_checkpoint(checkpoint), "unknown-file").file == empty[0]
    (checkpoint / empty[0]).unlink()
    (checkpoint / empty[0]).symlink_to(tmp_path / "elsewhere")
    (tmp_path / "elsewhere").write_bytes(b"")  # a link is no file of the writer's, empty or not
    assert only_problem(verify_checkpoint(checkpoint), "unknown-file").file == empty[0]


def test_overlapping_chunks(copy_fixture):
    checkpoint = copy_fixture("fsdp2_adamw_3ranks")

    def overlap(metadata):
        chunk = metadata.state_dict_metadata["model.embed.weight"].chunks[1]
        key = next(k for k in metadata.storage_data
                   if k.fqn == "model.embed.weight" and k.offset == chunk.offsets)
        chunk.offsets = torch.Size([2, 0])
        metadata.storage_data[MetadataIndex(key.fqn, chunk.offsets, key.index)] = \
            metadata.storage_data.pop(key)

    edit_metadata(checkpoint, overlap)
    report = verify_checkpoint(checkpoint)
    problem = only_problem(report, "chunk-overlap")
    assert problem.fqns == ("model.embed.weight",) and "[2, 0]" in problem.message
    assert rules(report) == {"chunk-overlap"}


def test_missing_chunk_leaves_a_gap(copy_fixture):
    checkpoint = copy_fixture("mesh2d_4ranks")

    def drop_chunk(metadata):
        chunks = metadata.state_dict_metadata["grid"].chunks
        dropped = chunks.pop()
        del metadata.storage_data[next(k for k in metadata.storage_data
                                       if k.fqn == "grid" and k.offset == dropped.offsets)]

    edit_metadata(checkpoint, drop_chunk)
    report = verify_checkpoint(checkpoint)
    assert rules(report) == {"chunk-gap"}
    assert "33 of the 42 elements" in only_problem(report, "chunk-gap").message


def test_dtype_that_contradicts_the_items(copy_fixture):
    checkpoint = copy_fixture("fsdp2_adamw_3ranks")
    edit_metadata(checkpoint, lambda metadata: setattr(
        metadata.state_dict_metadata["model.norm.weight"].properties, "dtype", torch.int32))
    report = verify_checkpoint(checkpoint)
    assert rules(report) == {"tensor-mismatch"}
    assert all(p.fqns == ("model.norm.weight",) for p in report.problems)
    assert len(report.problems) == 3  # one per rank's chunk
    assert verify_checkpoint(checkpoint, deep=False).status == "ok"


def test_metadata_that_is_not_dcp(copy_fixture):
    checkpoint = copy_fixture("mesh2d_4ranks")
    checksum_checkpoint(checkpoint)
    (checkpoint / ".metadata").write_bytes(pickle.dumps({"not": "dcp"}))
    report = verify_checkpoint(checkpoint)
    metadata_problem = only_problem(report, "metadata")
    assert metadata_problem.file == ".metadata" and "not DCP Metadata" in metadata_problem.message
    # The checksums are still checked, and name .metadata as changed.
    assert only_problem(report, "checksum-mismatch").file == ".metadata"


def test_hostile_metadata_runs_no_code(copy_fixture, tmp_path):
    checkpoint = copy_fixture("mesh2d_4ranks")
    marker = tmp_path / "ran"

    class Hostile:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    (checkpoint / ".metadata").write_bytes(pickle.dumps(Hostile()))
    report = verify_checkpoint(checkpoint)
    problem = only_problem(report, "metadata")
    assert "io.open" in problem.message and not marker.exists()
    assert report.status == "unreadable" and report.exit_code == 1


def test_a_class_outside_dcp_s_is_unreadable_not_damage_unless_more_is_wrong(tmp_path):
    """A quantized tensor's dtype in .metadata (torch.qint8), which torch's dcp.load reads:
    verify called the checkpoint damaged, where ls and prune call it unreadable."""
    import torch
    import torch.distributed.checkpoint as dcp

    dcp.save({"w": torch.ones(2), "q": torch.quantize_per_tensor(torch.randn(4), 0.1, 0,
                                                                 torch.qint8)},
             checkpoint_id=tmp_path / "q", no_dist=True)
    report = verify_checkpoint(tmp_path / "q")
    assert report.status == "unreadable" and report.exit_code == 1
    assert "torch.qint8, which is not a DCP metadata class" in only_problem(
        report, "metadata").message
    (tmp_path / "q" / "SHA256SUMS").write_text(f"{'0' * 64}  .metadata\n")
    report = verify_checkpoint(tmp_path / "q")
    assert report.status == "damaged" and only_problem(report, "checksum-mismatch")


def test_a_metadata_the_file_system_fails_to_read_is_no_damage(copy_fixture, monkeypatch):
    """EIO reading `.metadata` (a failing disk) made the checkpoint damaged to verify, where ls
    and prune call it unreadable: nothing was judged."""
    import errno
    import os

    from dcpctl.format.metadata import reading

    checkpoint = copy_fixture("mesh2d_4ranks")
    opened = reading.open_for_reading

    def failing(path, *args, **kwargs):
        if os.fspath(path) == os.fspath(checkpoint / ".metadata"):
            raise OSError(errno.EIO, os.strerror(errno.EIO), os.fspath(path))
        return opened(path, *args, **kwargs)

    monkeypatch.setattr(reading, "open_for_reading", failing)
    report = verify_checkpoint(checkpoint, deep=False)
    assert report.status == "unreadable" and report.exit_code == 1
    assert only_problem(report, "metadata").message == "cannot read (Input/output error)"


@pytest.mark.parametrize("impostor", ["fifo", "directory"])
def test_a_metadata_that_is_no_regular_file_is_damage(copy_fixture, impostor):
    """Not a failure of the file system to read it: something else stands there."""
    import os

    checkpoint = copy_fixture("mesh2d_4ranks")
    (checkpoint / ".metadata").unlink()
    if impostor == "fifo":
        os.mkfifo(checkpoint / ".metadata")
    else:
        (checkpoint / ".metadata").mkdir()
    report = verify_checkpoint(checkpoint, deep=False)
    assert report.status == "damaged"
    assert only_problem(report, "metadata").message == "cannot read (not a regular file)"


def test_metadata_refused_for_anything_but_a_class_name_is_damaged(copy_fixture):
    """Only a class outside DCP's makes a checkpoint unreadable: a pickle of persistent ids,
    which neither torch's metadata nor any writer's holds, is damage."""
    import io

    class WithPersistentIds(pickle.Pickler):
        def persistent_id(self, value):
            return "id" if value == "x" else None

    checkpoint = copy_fixture("mesh2d_4ranks")
    buffer = io.BytesIO()
    WithPersistentIds(buffer).dump(["x"])
    (checkpoint / ".metadata").write_bytes(buffer.getvalue())
    report = verify_checkpoint(checkpoint)
    assert report.status == "damaged"
    assert "persistent ids" in only_problem(report, "metadata").message


def test_incomplete_checkpoint(copy_fixture):
    checkpoint = copy_fixture("fsdp2_adamw_3ranks")
    (checkpoint / ".metadata").unlink()
    report = verify_checkpoint(checkpoint)
    assert report.status == "incomplete" and report.exit_code == 1
    assert "incomplete" in only_problem(report, "incomplete").message


def test_sha256sums_that_disagree_with_the_directory(copy_fixture):
    checkpoint = copy_fixture("mesh2d_4ranks")
    checksum_checkpoint(checkpoint)
    sums = checkpoint / "SHA256SUMS"
    lines = sums.read_text().splitlines()
    sums.write_text("\n".join(lines[:-1] + ["0" * 64 + "  __9_0.distcp"]) + "\n")
    report = verify_checkpoint(checkpoint, deep=False)
    assert rules(report) == {"missing-file", "not-checksummed"}
    assert only_problem(report, "missing-file").file == "__9_0.distcp"
    assert only_problem(report, "not-checksummed").file == lines[-1].split()[-1]
    sums.write_bytes(b"\xff\xfe binary")
    assert rules(verify_checkpoint(checkpoint, deep=False)) == {"checksums-file"}


@pytest.mark.parametrize("listed", ["../outside.distcp", "sub//__0_0.distcp", "./__0_0.distcp",
                                    "/etc/hostname"])
def test_sha256sums_naming_what_is_not_a_plain_file_name(copy_fixture, tmp_path, listed):
    """verify called such a file damaged while checksum rewrote it and reshard went ahead:
    every command refuses it alike now."""
    from dcpctl.errors import DataError
    from dcpctl.ops.reshard.execution import reshard_checkpoint

    checkpoint = copy_fixture("mesh2d_4ranks")
    checksum_checkpoint(checkpoint)
    with open(checkpoint / "SHA256SUMS", "a") as sums:
        sums.write("0" * 64 + f"  {listed}\n")
    report = verify_checkpoint(checkpoint, deep=False)
    assert rules(report) == {"checksums-file"}
    assert listed in only_problem(report, "checksums-file").message
    with pytest.raises(DataError, match="not a plain file name"):
        checksum_checkpoint(checkpoint)
    with pytest.raises(DataError, match="not a plain file name"):
        reshard_checkpoint(checkpoint, 2, str(tmp_path / "out"))
    assert not (tmp_path / "out").exists()


def test_sha256sums_in_upper_case_hex_hold_as_sha256sum_reads_them(copy_fixture):
    checkpoint = copy_fixture("mesh2d_4ranks")
    checksum_checkpoint(checkpoint)
    sums = checkpoint / "SHA256SUMS"
    sums.write_text("".join(line[:64].upper() + line[64:] + "\n"
                            for line in sums.read_text().splitlines()))
    assert verify_checkpoint(checkpoint, deep=True).status == "ok"


@pytest.mark.parametrize("wrong_first", [True, False])
def test_sha256sums_giving_a_file_two_digests_is_refused(copy_fixture, tmp_path, wrong_first):
    """`sha256sum -c` fails the line with the wrong digest, whichever comes first; taking the
    last line for the file called a damaged file whole when the right digest came last."""
    from dcpctl.errors import DataError
    from dcpctl.ops.transcode import compress_checkpoint

    checkpoint = copy_fixture("mesh2d_4ranks")
    checksum_checkpoint(checkpoint)
    sums = checkpoint / "SHA256SUMS"
    right = next(line for line in sums.read_text().splitlines() if "__0_0.distcp" in line)
    wrong = "0" * 64 + "  __0_0.distcp"
    pair = [wrong, right] if wrong_first else [right, wrong]
    sums.write_text("\n".join(pair) + "\n" + sums.read_text())
    report = verify_checkpoint(checkpoint, deep=False)
    assert rules(report) == {"checksums-file"}
    assert "gives '__0_0.distcp' another digest than line 1" in only_problem(
        report, "checksums-file").message
    with pytest.raises(DataError, match="another digest than line 1"):
        compress_checkpoint(checkpoint, output_path=str(tmp_path / "out"))


def test_a_packed_float4_tensor_of_a_safetensors_save_verifies(tmp_path):
    """torch's SAFETENSORS serialization heads a float4_e2m1fn_x2 chunk [5, 2] with F4
    [5, 4] (safetensors counts 4-bit values): verify and checksum called it a tensor-mismatch."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.filesystem import SerializationFormat

    packed = torch.arange(10, dtype=torch.uint8).reshape(5, 2).view(torch.float4_e2m1fn_x2)
    dcp.save({"w": packed, "f": torch.ones(3)}, no_dist=True, storage_writer=dcp.FileSystemWriter(
        tmp_path / "ck", serialization_format=SerializationFormat.SAFETENSORS))
    assert verify_checkpoint(tmp_path / "ck").problems == []
    checksum_checkpoint(tmp_path / "ck")
    assert verify_checkpoint(tmp_path / "ck").problems == []


def test_safetensors_header_checked_against_metadata(copy_fixture):
    checkpoint = copy_fixture("safetensors_fsdp2_2ranks")
    edit_metadata(checkpoint, lambda metadata: setattr(
        metadata.state_dict_metadata["model.head.bias"].properties, "dtype", torch.int32))
    report = verify_checkpoint(checkpoint)
    assert rules(report) == {"tensor-mismatch"}
    assert {p.file for p in report.problems} == {"__0_0.distcp", "__1_0.distcp"}


@pytest.mark.parametrize("boxes, overlapping", [
    ([((0,), (4,)), ((4,), (4,)), ((8,), (2,))], False),
    ([((0,), (4,)), ((3,), (4,))], True),
    ([((0, 0), (4, 3)), ((0, 3), (4, 3)), ((4, 0), (3, 3)), ((4, 3), (3, 3))], False),
    ([((0, 0), (4, 3)), ((0, 3), (4, 3)), ((4, 0), (3, 3)), ((3, 5), (3, 1))], True),
    ([((), ()), ((), ())], True),
    ([((0, 0), (2, 10)), ((0, 10), (2, 10)), ((0, 5), (2, 1))], True),
])
def test_find_overlapping_boxes(boxes, overlapping):
    assert (find_overlapping_boxes(boxes) is not None) == overlapping


@settings(max_examples=300, deadline=None)
@given(rows=st.integers(0, 12), columns=st.integers(0, 3),
       cuts=st.lists(st.tuples(st.integers(0, 14), st.integers(0, 6), st.integers(-1, 1),
                               st.integers(-1, 1)), max_size=6))
def test_row_tiling_agrees_with_the_general_check(rows, columns, cuts):
    """The fast test for chunks that split rows never passes chunks the box sweep would
    refuse (an overlap or a gap), and passes every exact row split it is given."""
    chunks = [ChunkMetadata((start, max(column_shift, 0)), (size, columns + column_grow))
              for start, size, column_shift, column_grow in cuts]
    tensor = TensorEntry("t", DTYPES_BY_NAME["float32"], (rows, columns), chunks)
    boxes = [(chunk.offsets, chunk.sizes) for chunk in chunks if math.prod(chunk.sizes)]
    tiles = (find_overlapping_boxes(boxes) is None and all(
        min(offsets) >= 0 and all(o + s <= n for o, s, n in zip(offsets, sizes, (rows, columns)))
        for offsets, sizes in boxes) and sum(math.prod(s) for _, s in boxes) == rows * columns)
    if _tiles_by_rows(tensor):
        assert tiles
    if rows and columns:  # an empty tensor is left to the general check
        bounds = sorted({0, rows, *(min(start, rows) for start, *_ in cuts)})
        split = [ChunkMetadata((a, 0), (b - a, columns)) for a, b in zip(bounds, bounds[1:])]
        assert _tiles_by_rows(TensorEntry("t", DTYPES_BY_NAME["float32"], (rows, columns),
                                          split + [ChunkMetadata((rows, 0), (0, columns))]))


@settings(max_examples=300, deadline=None)
@given(shape=st.lists(st.integers(0, 7), min_size=1, max_size=3),
       cuts=st.lists(st.lists(st.integers(0, 8), max_size=3), min_size=3, max_size=3),
       changes=st.lists(st.tuples(st.integers(0, 40), st.integers(0, 2), st.integers(-2, 2),
                                  st.sampled_from(["move", "grow", "drop", "double"])),
                        max_size=3))
def test_grid_tiling_agrees_with_the_general_check(shape, cuts, changes):
    """The fast test for chunks that are the cells of a grid never passes chunks the box
    sweep would refuse, and passes every exact grid it is given: each dim cut where `cuts`
    says, then some chunks moved, grown or shrunk, dropped or doubled."""
    rank = len(shape)
    bounds = [sorted({0, extent, *(min(cut, extent) for cut in dim_cuts)})
              for extent, dim_cuts in zip(shape, cuts)]
    runs = [list(zip(dim_bounds, dim_bounds[1:])) for dim_bounds in bounds]
    grid = [ChunkMetadata(tuple(start for start, _ in cell),
                          tuple(end - start for start, end in cell))
            for cell in itertools.product(*runs)]
    if math.prod(shape):
        assert _tiles_as_grid(TensorEntry("t", DTYPES_BY_NAME["float32"], tuple(shape), grid))
    chunks = list(grid)
    for index, dim, delta, change in changes:
        if not chunks:
            break
        position = index % len(chunks)
        chunk = chunks[position]
        offsets, sizes = list(chunk.offsets), list(chunk.sizes)
        if change == "drop":
            del chunks[position]
        elif change == "double":
            chunks.append(chunk)
        elif change == "move":
            offsets[dim % rank] = max(0, offsets[dim % rank] + delta)
        else:
            sizes[dim % rank] = max(0, sizes[dim % rank] + delta)
        if change in ("move", "grow"):
            chunks[position] = ChunkMetadata(tuple(offsets), tuple(sizes))
    changed = TensorEntry("t", DTYPES_BY_NAME["float32"], tuple(shape), chunks)
    boxes = [(chunk.offsets, chunk.sizes) for chunk in chunks if math.prod(chunk.sizes)]
    tiles = (find_overlapping_boxes(boxes) is None and all(
        all(o + s <= n for o, s, n in zip(offsets, sizes, shape)) for offsets, sizes in boxes)
        and sum(math.prod(sizes) for _, sizes in boxes) == math.prod(shape))
    if _tiles_as_grid(changed):
        assert tiles


@pytest.mark.parametrize("shape, chunks", [
    ((8,), [((0,), (4,)), ((2,), (4,))]),  # runs that overlap, and a gap their sizes hide
    ((4, 4), [((0, 0), (2, 2)), ((0, 2), (2, 2)), ((2, 0), (2, 2)), ((0, 0), (2, 2))]),  # twice
    ((4, 4), [((0, 0), (2, 2)), ((0, 2), (2, 2)), ((2, 0), (2, 2))]),  # a cell missing
    ((4, 4), [((0, 0), (2, 2)), ((0, 2), (2, 2)), ((2, 0), (2, 4)), ((2, 2), (2, 2))]),
])
def test_chunks_that_are_no_grid_are_not_taken_for_one(shape, chunks):
    tensor = TensorEntry("t", DTYPES_BY_NAME["float32"], shape,
                         [ChunkMetadata(offsets, sizes) for offsets, sizes in chunks])
    assert not _tiles_as_grid(tensor)


def test_a_grid_of_chunks_is_checked_without_the_sweep(monkeypatch):
    """A tensor sharded along two dims (rows by columns) was checked by the sweep, which keeps
    a band of the grid open: a 300 x 300 grid took 20 s in verify --quick, 150 x 150 2.7 s."""
    from dcpctl.format.checkpoint import structure

    grid = [ChunkMetadata((2 * i, 64 * j), (2, 64)) for i in range(150) for j in range(150)]
    tensor = TensorEntry("t", DTYPES_BY_NAME["bfloat16"], (300, 9600), grid)
    monkeypatch.setattr(structure, "find_overlapping_boxes", None)  # fails if called
    assert structure._chunk_cover_problems(tensor) == []


class _CountedInt(int):
    """An int that counts the comparisons made with it (as either operand: Python asks a
    subclass's reflected method first)."""

    comparisons = 0

    def __lt__(self, other):
        _CountedInt.comparisons += 1
        return int.__lt__(self, other)

    def __gt__(self, other):
        _CountedInt.comparisons += 1
        return int.__gt__(self, other)


def _counted(boxes):
    return [(tuple(map(_CountedInt, offsets)), tuple(map(_CountedInt, sizes)))
            for offsets, sizes in boxes]


def test_find_overlapping_boxes_scales_to_many_chunks():
    """Row and column shardings of k chunks cost about k log k comparisons, a grid of k chunks
    about k sqrt(k): never the k^2 of comparing every pair (counted, not timed: the 5,000
    row chunks compared pairwise would take 2.5 * 10^7 comparisons)."""
    count = 5_000
    rows = _counted([((4 * index, 0), (4, 8)) for index in range(count)])
    columns = _counted([((0, 4 * index), (8, 4)) for index in range(count)])
    grid = _counted([((8 * i, 8 * j), (8, 8)) for i in range(64) for j in range(64)])
    for boxes, comparisons_per_box in ((rows, 50), (columns, 50), (grid, 200)):
        _CountedInt.comparisons = 0
        assert find_overlapping_boxes(boxes) is None
        assert _CountedInt.comparisons < comparisons_per_box * len(boxes)
    assert find_overlapping_boxes(rows + _counted([((10, 2), (1, 1))])) is not None


@pytest.mark.parametrize("name", ["fsdp2_adamw_3ranks", "objects_2ranks", "zstd_fsdp2_2ranks"])
def test_compress_and_decompress_outputs_verify_with_their_sha256sums(name, tmp_path):
    """The SHA256SUMS that compress/decompress write as they write check out, and a bit
    flipped afterwards is caught by both the checksum and the CRC."""
    from dcpctl.format.codecs.registry import IDENTITY, zstd_codec
    from dcpctl.ops.transcode import transcode_checkpoint

    for codec in (zstd_codec(), IDENTITY):
        output = tmp_path / codec.name
        transcode_checkpoint(fixture_path(name), codec, str(output))
        report = verify_checkpoint(output)
        assert report.status == "ok", report.problems
        assert report.checksummed_files == len(report_files(output))
    file_name, offset = tensor_data_offset(output, "model.embed.weight" if "fsdp2" in name
                                           else "weights.dense")
    flip_bit(output / file_name, offset)
    assert rules(verify_checkpoint(output)) == {"checksum-mismatch", "crc-mismatch"}


def test_progress_reports_every_byte_read(copy_fixture):
    checkpoint = copy_fixture("zstd_fsdp2_2ranks")
    checksum_checkpoint(checkpoint)
    calls = []
    report = verify_checkpoint(checkpoint, threads=2,
                               on_progress=lambda done, total: calls.append((done, total)))
    assert sum(done for done, _ in calls) == report.bytes_read == sum(
        path.stat().st_size for path in report_files(checkpoint))
    assert {total for _, total in calls} == {report.bytes_read}


def _first_key(metadata, fqn, offset=None):
    return next(key for key in metadata.storage_data if key.fqn == fqn
                and (offset is None or tuple(key.offset) == offset))


def _unknown_transform(metadata):
    metadata.storage_data[_first_key(metadata, "grid")].transform_descriptors = ["stream.lz4/1"]


def _overlapping_items(metadata):
    metadata.storage_data[_first_key(metadata, "table")].offset -= 100


def _storage_under_another_key(metadata):
    key = _first_key(metadata, "bias")
    metadata.storage_data[MetadataIndex("bias", torch.Size([1]), key.index)] = \
        metadata.storage_data.pop(key)


def _short_length(metadata):
    metadata.storage_data[_first_key(metadata, "grid")].length = 40


@pytest.mark.parametrize("edit, expected_rules", [
    (_unknown_transform, {"unsupported-transform"}),
    (_overlapping_items, {"item-overlap", "archive"}),
    (_storage_under_another_key, {"no-storage", "orphan-storage"}),
    (_short_length, {"stored-length", "archive"}),
])
def test_metadata_edits_each_break_a_named_rule(edit, expected_rules, copy_fixture):
    checkpoint = copy_fixture("mesh2d_4ranks")
    edit_metadata(checkpoint, edit)
    report = verify_checkpoint(checkpoint)
    assert rules(report) == expected_rules, report.problems
    assert all(problem.fqns for problem in report.problems)


def _listed_in_reverse(metadata):
    metadata.storage_data = dict(reversed(metadata.storage_data.items()))


def test_items_the_metadata_lists_out_of_order_are_checked_for_overlap_all_the_same(
        copy_fixture):
    """Items listed in each file's order and apart are told apart without a sort; items listed
    in another order are sorted, and only an overlap is damage: listed in reverse, the items of
    each file are whole, and one moved onto its neighbour (listed before it) shares its bytes."""
    checkpoint = copy_fixture("mesh2d_4ranks")
    edit_metadata(checkpoint, _listed_in_reverse)
    assert verify_checkpoint(checkpoint, deep=False).status == "ok"

    def move_onto_the_neighbour(metadata):
        # __3_0.distcp holds grid (4, 3), bias (3,) and table (2, 0), listed in that order:
        # reversed, table comes first, then bias, which now starts inside the moved grid item
        metadata.storage_data[_first_key(metadata, "grid", (4, 3))].offset = 1000
        _listed_in_reverse(metadata)

    edit_metadata(checkpoint, move_onto_the_neighbour)
    overlap = only_problem(verify_checkpoint(checkpoint, deep=False), "item-overlap")
    assert overlap.file == "__3_0.distcp" and set(overlap.fqns) == {"grid", "bias"}


@pytest.mark.parametrize("index", [0, 2])  # chunk 2 of model.head.bias is empty
def test_a_chunk_listed_twice_shares_its_item_with_itself(copy_fixture, index):
    """Both copies join the one storage entry of their key: the metadata lists that entry
    once, in order and apart, but two chunks hold it, an empty one too."""
    import copy

    checkpoint = copy_fixture("fsdp2_adamw_3ranks")

    def list_a_chunk_twice(metadata):
        chunks = metadata.state_dict_metadata["model.head.bias"].chunks
        chunks.insert(index + 1, copy.deepcopy(chunks[index]))

    edit_metadata(checkpoint, list_a_chunk_twice)
    report = verify_checkpoint(checkpoint, deep=False)
    assert only_problem(report, "item-overlap").fqns == ("model.head.bias", "model.head.bias")
    assert rules(report) == {"item-overlap"} | ({"chunk-overlap"} if index == 0 else set())


@pytest.mark.parametrize("fqn, offset", [("step", (0,)), ("weights.dense", None),
                                         ("weights.dense", (1, 0))])
def test_a_storage_entry_beside_those_of_an_entry_s_own_keys_is_an_orphan(
        copy_fixture, fqn, offset):
    """Every other entry joins its chunk or object in the metadata's own order; the one more,
    for an object or a tensor, matches none of them."""
    checkpoint = copy_fixture("objects_2ranks")

    def add_an_entry(metadata):
        info = metadata.storage_data[_first_key(metadata, fqn)]
        metadata.storage_data[MetadataIndex(fqn, None if offset is None else torch.Size(offset))] \
            = type(info)(info.relative_path, info.offset, info.length)

    edit_metadata(checkpoint, add_an_entry)
    orphan = only_problem(verify_checkpoint(checkpoint, deep=False), "orphan-storage")
    assert orphan.fqns == (fqn,)


@pytest.mark.parametrize("fqn", ["step", "weights.dense", "weights.mask"])
def test_an_entry_whose_storage_entries_are_all_gone_has_no_storage(copy_fixture, fqn):
    """Every other entry joins its chunk or object one to one, so no entry is left over: the
    object or the tensor's chunks that lost theirs are named all the same."""
    checkpoint = copy_fixture("objects_2ranks")

    def drop_its_entries(metadata):
        for key in [key for key in metadata.storage_data if key.fqn == fqn]:
            del metadata.storage_data[key]

    edit_metadata(checkpoint, drop_its_entries)
    report = verify_checkpoint(checkpoint, deep=False)
    assert rules(report) <= {"no-storage", "unknown-file"}
    assert only_problem(report, "no-storage").fqns == (fqn,)


def test_the_readme_lists_every_rule_verify_reports():
    readme = (REPO_ROOT / "README.md").read_text()
    listing = readme[readme.index("The rules:"):].split("\n\n", 1)[0]
    assert re.findall(r"`([a-z-]+)`", listing) == list(ALL_RULES)


def test_a_stopped_runs_temporary_files_are_leftovers_not_damage(copy_fixture):
    """What a stopped (or a running) dcpctl leaves under its temporary names is not the
    checkpoint's: verify names it and calls the checkpoint whole; checksum, holding the
    checkpoint, removes it."""
    checkpoint = copy_fixture("mesh2d_4ranks")
    (checkpoint / "__0_0.distcp.dcpctl-0123456789ab.tmp").write_bytes(b"half written")
    (checkpoint / "stray.bin").write_bytes(b"not dcpctl's")
    report = verify_checkpoint(checkpoint)
    assert rules(report) == {"unknown-file"} and only_problem(report, "unknown-file").file == \
        "stray.bin"
    assert report.leftover_temporaries == ["__0_0.distcp.dcpctl-0123456789ab.tmp"]
    (checkpoint / "stray.bin").unlink()
    assert verify_checkpoint(checkpoint).status == "ok"
    checksum_checkpoint(checkpoint)  # holding the checkpoint, it removes what is left
    report = verify_checkpoint(checkpoint)
    assert report.status == "ok" and report.to_json()["leftover_temporaries"] == []
    assert not (checkpoint / "__0_0.distcp.dcpctl-0123456789ab.tmp").exists()


@pytest.mark.parametrize("size, chunk_sizes, gap", [
    ((0, 20), [(0, 4)], True),  # a damaged size: the chunk spans 4 of 20 columns
    ((0, 20), [(0, 10), (0, 10)], False),  # two ranks' chunks of an empty tensor
    ((3, 0), [(2, 0), (1, 0)], False),
    ((3, 0), [(2, 0)], True),
])
def test_the_chunks_of_an_empty_tensor_must_span_it(copy_fixture, size, chunk_sizes, gap):
    """No element to count: a chunk of shape (0, 4) in a tensor of (0, 20) held all 0 of its
    elements, and a flipped bit in its size passed every check."""
    checkpoint = copy_fixture("objects_2ranks")

    def edit(metadata):
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

        entry = metadata.state_dict_metadata["weights.empty"]
        old_key = _first_key(metadata, "weights.empty")
        info = metadata.storage_data.pop(old_key)
        entry.size = torch.Size(size)
        entry.chunks, at = [], [0, 0]
        dim = 1 if size[0] == 0 else 0
        for index, sizes in enumerate(chunk_sizes):
            offsets = torch.Size(at)
            entry.chunks.append(ChunkStorageMetadata(offsets, torch.Size(sizes)))
            if index == 0:
                metadata.storage_data[MetadataIndex("weights.empty", offsets, 0)] = info
            at[dim] += sizes[dim]

    edit_metadata(checkpoint, edit)
    found = rules(verify_checkpoint(checkpoint, deep=False))
    assert ("chunk-gap" in found) == gap, found

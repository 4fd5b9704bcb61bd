"""Opening checkpoint directories, and reading their items, on good and bad input."""

from __future__ import annotations

import io
import os

import pytest
import torch
from conftest import FIXTURE_NAMES, fixture_path, item_locations, load_with_torch

from dcpctl.errors import (CheckpointNotFoundError, DataError, IncompleteCheckpointError,
                           MetadataError, UnsafePathError)
from dcpctl.format.checkpoint.items import StoredSpan, iter_item_pieces, read_item
from dcpctl.format.checkpoint.locations import locate_chunk, locate_object
from dcpctl.format.checkpoint.view import SAFETENSORS, find_file_problems, open_checkpoint
from dcpctl.format.codecs.base import PieceStream
from dcpctl.format.metadata.reading import read_metadata


def _chunk_of(full: torch.Tensor, offsets, sizes) -> torch.Tensor:
    return full[tuple(slice(o, o + s) for o, s in zip(offsets, sizes))]


@pytest.mark.parametrize("name", FIXTURE_NAMES)
def test_every_item_decodes_to_what_torch_loads(name):
    checkpoint = open_checkpoint(fixture_path(name))
    reference = load_with_torch(fixture_path(name)) if name != "safetensors_fsdp2_2ranks" else None
    for tensor in checkpoint.tensors:
        for chunk in tensor.chunks:
            location = locate_chunk(checkpoint, tensor, chunk)
            data = read_item(location)
            if checkpoint.files[chunk.storage.relative_path].serialization == SAFETENSORS:
                dtype = getattr(torch, tensor.dtype.name)
                value = torch.frombuffer(bytearray(data), dtype=dtype).reshape(chunk.sizes)
                assert value.numel() * dtype.itemsize == len(data)
                continue
            value = torch.load(io.BytesIO(data), weights_only=True)
            assert torch.equal(value, _chunk_of(reference[tensor.fqn], chunk.offsets, chunk.sizes))
    for entry in checkpoint.objects:
        data = read_item(locate_object(checkpoint, entry))
        value = torch.load(io.BytesIO(data), weights_only=False)
        if reference is not None:
            assert value == reference[entry.fqn]


def test_item_stream_reads_in_small_pieces():
    checkpoint = open_checkpoint(fixture_path("zstd_fsdp2_2ranks"))
    tensor = checkpoint.tensors[0]
    chunk = tensor.chunks[0]
    location = locate_chunk(checkpoint, tensor, chunk)
    whole = read_item(location)
    assert b"".join(iter_item_pieces(location, piece_bytes=7)) == whole
    with io.BufferedReader(PieceStream(iter_item_pieces(location, piece_bytes=5))) as stream:
        assert stream.read(3) + stream.read() == whole
    assert torch.load(io.BytesIO(whole), weights_only=True).shape == chunk.sizes


def test_safetensors_layout_is_detected():
    checkpoint = open_checkpoint(fixture_path("safetensors_fsdp2_2ranks"))
    assert {f.serialization for f in checkpoint.files.values()} == {SAFETENSORS}
    checkpoint = open_checkpoint(fixture_path("zstd_fsdp2_2ranks"))
    assert {f.serialization for f in checkpoint.files.values()} == {"torch_save"}


def test_missing_path_and_file_path(tmp_path):
    with pytest.raises(CheckpointNotFoundError, match="no such file"):
        open_checkpoint(tmp_path / "nothing")
    (tmp_path / "file").write_text("x")
    with pytest.raises(CheckpointNotFoundError, match="not a directory"):
        open_checkpoint(tmp_path / "file")


def test_directory_without_metadata_is_incomplete(copy_fixture, tmp_path):
    checkpoint = copy_fixture("fsdp2_adamw_3ranks")
    (checkpoint / ".metadata").unlink()
    with pytest.raises(IncompleteCheckpointError, match="incomplete"):
        open_checkpoint(checkpoint)


def test_a_directory_that_is_no_checkpoint_is_said_so_not_incomplete(copy_fixture, tmp_path):
    """`verify` of an empty directory, or of the run directory above the checkpoints, said
    `status incomplete`, as of a save that died."""
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointNotFoundError) as raised:
        open_checkpoint(tmp_path / "empty")
    assert raised.value.message == "not a DCP checkpoint: no .metadata"
    for step in (1, 2, 3, 4):
        copy_fixture("fsdp2_adamw_3ranks").rename(tmp_path / f"step-{step}")
    with pytest.raises(CheckpointNotFoundError) as raised:
        open_checkpoint(tmp_path)
    assert raised.value.message == (
        "not a DCP checkpoint: no .metadata; it holds checkpoints (step-1, step-2, step-3, ...): "
        "give one of them, or list them with `dcpctl ls`")


def test_a_hugging_face_index_without_its_files_is_named(tmp_path):
    (tmp_path / "model.safetensors.index.json").write_text("{}")
    with pytest.raises(DataError, match="Hugging Face safetensors checkpoint but no "
                                        ".safetensors file"):
        open_checkpoint(tmp_path)


def test_empty_metadata(copy_fixture):
    checkpoint = copy_fixture("mesh2d_4ranks")
    (checkpoint / ".metadata").write_bytes(b"")
    with pytest.raises(MetadataError, match="empty"):
        open_checkpoint(checkpoint)


def test_missing_data_file(copy_fixture):
    checkpoint = copy_fixture("fsdp2_adamw_3ranks")
    (checkpoint / "__1_0.distcp").unlink()
    with pytest.raises(DataError, match=r"__1_0.distcp: missing-file: missing data file"):
        open_checkpoint(checkpoint)
    assert open_checkpoint(checkpoint, check_files=False).files["__1_0.distcp"].size_bytes is None


def test_the_problems_of_many_wrong_files_are_found_in_one_pass_over_the_items(copy_fixture):
    """With every data file missing (only `.metadata` copied), the items affected were looked
    for once per file: a checkpoint of a thousand ranks took a minute to refuse, where
    reading its metadata takes ten seconds. Each problem still names its own items."""
    checkpoint_dir = copy_fixture("objects_2ranks")
    for data_file in checkpoint_dir.glob("*.distcp"):
        data_file.unlink()
    checkpoint = open_checkpoint(checkpoint_dir, check_files=False)

    class CountedItems(dict):
        passes = 0

        def items(self):
            CountedItems.passes += 1
            return super().items()

    storage_data = checkpoint.metadata.storage_data
    checkpoint.metadata.storage_data = CountedItems(storage_data)
    problems = find_file_problems(checkpoint)
    assert CountedItems.passes == 1
    assert [problem.file for problem in problems] == sorted(checkpoint.files) and len(problems) > 5
    for problem in problems:
        assert problem.rule == "missing-file"
        assert problem.fqns == tuple(dict.fromkeys(
            key.fqn for key, info in storage_data.items() if info.relative_path == problem.file))


def test_truncated_data_file(copy_fixture):
    checkpoint = copy_fixture("fsdp2_adamw_3ranks")
    data_file = checkpoint / "__2_0.distcp"
    os.truncate(data_file, data_file.stat().st_size - 100)
    with pytest.raises(DataError, match=r"__2_0.distcp: .*truncated: the file is") as raised:
        open_checkpoint(checkpoint)
    items = [(info.offset + info.length, key.fqn) for key, info in
             read_metadata(checkpoint).storage_data.items() if info.relative_path == "__2_0.distcp"]
    end, fqn = max(items, key=lambda item: item[0])  # the first of equal ends
    assert f"(item {fqn!r}) at byte {end}" in str(raised.value)


def test_items_read_as_one_span_are_their_own_bytes_and_a_short_file_names_the_item(
        copy_fixture):
    checkpoint_path = copy_fixture("fsdp2_adamw_3ranks")
    checkpoint = open_checkpoint(checkpoint_path)
    by_key = item_locations(checkpoint)
    locations = [by_key[key] for key in sorted(
        (key for key, info in checkpoint.metadata.storage_data.items()
         if info.relative_path == "__2_0.distcp"),
        key=lambda key: checkpoint.metadata.storage_data[key].offset)]
    first, last = locations[0], locations[-1]
    span = StoredSpan(first.path, first.start, last.start + last.length, first.fqn)
    for location in locations:
        assert b"".join(iter_item_pieces(location, span=span)) == read_item(location)
    os.truncate(checkpoint_path / "__2_0.distcp", last.start + 1)
    short_span = StoredSpan(first.path, first.start, last.start + last.length, first.fqn)
    with pytest.raises(DataError, match=rf"__2_0.distcp: item {last.fqn!r} at bytes "
                                        rf"{last.start}..{last.start + last.length}: truncated: "
                                        rf"the file ends at byte {last.start + 1}"):
        b"".join(iter_item_pieces(last, span=short_span))
    (checkpoint_path / "__2_0.distcp").unlink()
    with pytest.raises(DataError, match=rf"__2_0.distcp: item {first.fqn!r}: missing data "
                                        rf"file"):
        StoredSpan(first.path, first.start, last.start + last.length, first.fqn)


def test_corrupt_zstd_item_names_file_and_item(copy_fixture):
    checkpoint_dir = copy_fixture("zstd_fsdp2_2ranks")
    checkpoint = open_checkpoint(checkpoint_dir)
    tensor = checkpoint.tensors[0]
    chunk = tensor.chunks[0]
    path = checkpoint_dir / chunk.storage.relative_path
    data = bytearray(path.read_bytes())
    for position in range(chunk.storage.offset + 8, chunk.storage.offset + chunk.storage.length):
        data[position] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(DataError, match=f"{chunk.storage.relative_path}.*{tensor.fqn}"):
        read_item(locate_chunk(checkpoint, tensor, chunk))


def _rewrite_paths(checkpoint_dir, new_path):
    import pickle

    from conftest import torch_metadata

    metadata = torch_metadata(checkpoint_dir)
    for info in metadata.storage_data.values():
        if info.relative_path == "__0_0.distcp":
            info.relative_path = new_path
    (checkpoint_dir / ".metadata").write_bytes(pickle.dumps(metadata))


@pytest.mark.parametrize("escape", ["/etc/passwd", "../outside.distcp", "sub/../../x.distcp",
                                    "..\\x.distcp"])
def test_paths_that_escape_the_directory_are_refused(copy_fixture, escape):
    checkpoint = copy_fixture("fsdp2_adamw_3ranks")
    _rewrite_paths(checkpoint, escape)
    with pytest.raises(UnsafePathError, match="not a plain path inside"):
        open_checkpoint(checkpoint)


@pytest.mark.parametrize("name", ["__0_0.distcp", ".metadata"])
def test_a_file_linked_out_of_the_directory_is_refused(copy_fixture, tmp_path, name):
    """A data file, or `.metadata` (checksum left such a .metadata out of SHA256SUMS, which
    verify then called damaged; every command read it). Linked inside, it reads."""
    checkpoint = copy_fixture("fsdp2_adamw_3ranks")
    outside = tmp_path / "elsewhere"
    (checkpoint / name).rename(outside)
    (checkpoint / name).symlink_to(outside)
    with pytest.raises(UnsafePathError, match=f"'{name}' resolves to .*outside the checkpoint"):
        open_checkpoint(checkpoint)
    (checkpoint / name).unlink()
    outside.rename(checkpoint / "real")
    (checkpoint / name).symlink_to("real")
    assert open_checkpoint(checkpoint).tensors


def _in_a_hub_cache(tmp_path, blobs_elsewhere: bool = False):
    """A checkpoint as huggingface_hub's cache lays out a download: every file of
    REPO/snapshots/REVISION/ a symlink to REPO/blobs/<its hash>."""
    import shutil

    repository = tmp_path / "hub" / "models--org--run"
    snapshot = repository / "snapshots" / "0123abcd" / "step-100"
    snapshot.mkdir(parents=True)
    blobs = repository / "blobs"
    if blobs_elsewhere:  # blobs itself a link out of the tree: no blobs of the repository's
        (tmp_path / "elsewhere").mkdir()
        blobs.symlink_to(tmp_path / "elsewhere", target_is_directory=True)
    else:
        blobs.mkdir()
    for source in fixture_path("fsdp2_adamw_3ranks").iterdir():
        blob = blobs / f"blob-{source.name.strip('.')}"
        shutil.copyfile(source, blob)
        (snapshot / source.name).symlink_to(os.path.relpath(blob, snapshot))
    return snapshot


def test_a_checkpoint_in_the_hugging_face_hub_cache_reads(tmp_path):
    """Its files link to the repository's blobs, out of the checkpoint's directory: every
    command and dcpctl.storage_reader refused it, where stock torch loads it."""
    import torch.distributed.checkpoint as dcp

    import dcpctl

    snapshot = _in_a_hub_cache(tmp_path)
    assert open_checkpoint(snapshot).tensors
    expected = load_with_torch(fixture_path("fsdp2_adamw_3ranks"))
    state = {fqn: torch.zeros_like(tensor) for fqn, tensor in expected.items()
             if isinstance(tensor, torch.Tensor)}
    dcp.load(state, storage_reader=dcpctl.storage_reader(snapshot), no_dist=True)
    assert len(state) > 10 and all(torch.equal(state[fqn], expected[fqn]) for fqn in state)
    with pytest.raises(UnsafePathError, match="resolves to .*outside the checkpoint"):
        open_checkpoint(_in_a_hub_cache(tmp_path / "other", blobs_elsewhere=True))


def test_a_subdirectory_linked_out_of_the_directory_is_refused(copy_fixture, tmp_path):
    checkpoint = copy_fixture("fsdp2_adamw_3ranks")
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    (checkpoint / "__0_0.distcp").rename(outside / "__0_0.distcp")
    (checkpoint / "shards").symlink_to(outside, target_is_directory=True)
    _rewrite_paths(checkpoint, "shards/__0_0.distcp")
    with pytest.raises(UnsafePathError, match="outside the checkpoint directory"):
        open_checkpoint(checkpoint)


@pytest.mark.parametrize("name", ["shards//__0_0.distcp", "./__0_0.distcp", "shards/",
                                  "shards/./__0_0.distcp"])
def test_a_name_not_written_the_one_plain_way_is_refused(copy_fixture, name):
    checkpoint = copy_fixture("fsdp2_adamw_3ranks")
    _rewrite_paths(checkpoint, name)
    with pytest.raises(UnsafePathError, match="not a plain path inside"):
        open_checkpoint(checkpoint)


def test_symlink_inside_the_directory_is_fine(copy_fixture):
    checkpoint = copy_fixture("fsdp2_adamw_3ranks")
    (checkpoint / "__0_0.distcp").rename(checkpoint / "real.bin")
    (checkpoint / "__0_0.distcp").symlink_to("real.bin")
    assert open_checkpoint(checkpoint).files["__0_0.distcp"].size_bytes > 0


def _joined(checkpoint) -> tuple:
    """Each chunk's and object's storage entry, each tensor's stored bytes, each file's stats."""
    def entry(storage):
        return None if storage is None else (storage.relative_path, storage.offset,
                                             storage.length, storage.transform_descriptors)
    return ({(tensor.fqn, tuple(chunk.offsets)): entry(chunk.storage)
             for tensor in checkpoint.tensors for chunk in tensor.chunks},
            {tensor.fqn: tensor.stored_bytes for tensor in checkpoint.tensors},
            {item.fqn: entry(item.storage) for item in checkpoint.objects},
            {name: (f.item_count, f.end_bytes, f.last_fqn, f.serialization)
             for name, f in checkpoint.files.items()})


@pytest.mark.parametrize("name", ["fsdp2_adamw_3ranks", "mesh2d_4ranks"])
@pytest.mark.parametrize("reorder", ["reversed", "chunks reversed", "entry dropped"])
def test_chunks_join_their_entries_whatever_order_the_metadata_lists_them(copy_fixture, name,
                                                                          reorder):
    """Chunks are joined to their storage entries by order where the two line up (as torch
    writes them) and by key where they do not: storage listed backwards, a tensor's chunks
    listed backwards, or an entry missing give the same join as the key would."""
    import pickle

    from conftest import torch_metadata

    path = copy_fixture(name)
    expected = _joined(open_checkpoint(path, check_files=False))
    metadata = torch_metadata(path)
    if reorder == "reversed":
        metadata.storage_data = dict(reversed(list(metadata.storage_data.items())))
    elif reorder == "chunks reversed":
        for entry in metadata.state_dict_metadata.values():
            if hasattr(entry, "chunks"):
                entry.chunks.reverse()
    else:
        dropped = next(key for key in metadata.storage_data if key.offset is not None)
        del metadata.storage_data[dropped]
        chunks, stored_bytes, objects, _ = expected
        removed = chunks[dropped.fqn, tuple(dropped.offset)]
        chunks[dropped.fqn, tuple(dropped.offset)] = None
        stored_bytes[dropped.fqn] -= removed[2]
    with open(path / ".metadata", "wb") as stream:
        pickle.dump(metadata, stream)
    joined = _joined(open_checkpoint(path, check_files=False))
    assert joined[:3] == expected[:3]
    if reorder != "entry dropped":
        assert {name: stats[0] for name, stats in joined[3].items()} == {
            name: stats[0] for name, stats in expected[3].items()}

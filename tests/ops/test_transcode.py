"""compress / decompress: results stock torch loads, byte-exact round trips, failures that
leave the source untouched."""

from __future__ import annotations

import errno
import os
import pickle
import re

import pytest
from conftest import (MANIFEST, TORCH_LOADABLE_FIXTURES, assert_plain_items_equal_decoded,
                      directory_state, fixture_path, flip_bit, load_with_torch, run_dcpctl,
                      torch_metadata)
from make_fixtures import tensor_sha256
from rank_loading import assert_matches_manifest, describe_after_loading_on_ranks

from dcpctl.errors import DataError, OutputError
from dcpctl.format.checkpoint.publishing import DataFileWriter
from dcpctl.format.checkpoint.view import open_checkpoint
from dcpctl.format.codecs.registry import IDENTITY, zstd_codec
from dcpctl.ops.checksum import checksum_checkpoint
from dcpctl.ops.transcode import (compress_checkpoint, decompress_checkpoint, group_items_into_runs,
                                  plan_transcode, transcode_checkpoint)

RANKS_TO_LOAD_ON = {
    "fsdp2_adamw_3ranks": [3, 2],
    "mesh2d_4ranks": [4, 2],
    "zstd_fsdp2_2ranks": [2, 3],
    "objects_2ranks": [2, 1],
}


@pytest.mark.slow
@pytest.mark.parametrize("name,world_size", [(name, ws) for name, sizes in
                                             RANKS_TO_LOAD_ON.items() for ws in sizes])
def test_compressed_checkpoint_loads_in_stock_torch_on_any_world_size(name, world_size, tmp_path):
    out = tmp_path / "compressed"
    report = transcode_checkpoint(fixture_path(name), zstd_codec(), str(out), threads=2)
    assert report.items_transcoded + report.items_copied == report.items
    assert set(open_checkpoint(out).files) == set(open_checkpoint(fixture_path(name)).files)
    description = describe_after_loading_on_ranks(out, name, world_size)
    assert_matches_manifest(description, name)


@pytest.mark.parametrize("name", TORCH_LOADABLE_FIXTURES)
def test_compress_then_decompress_gives_back_the_original_items(name, tmp_path):
    transcode_checkpoint(fixture_path(name), zstd_codec(), str(tmp_path / "z"))
    transcode_checkpoint(str(tmp_path / "z"), IDENTITY, str(tmp_path / "plain"))
    assert_plain_items_equal_decoded(fixture_path(name), tmp_path / "plain")


def test_decompressing_torchs_own_zstd_matches_its_values(tmp_path):
    name = "zstd_fsdp2_2ranks"
    transcode_checkpoint(fixture_path(name), IDENTITY, str(tmp_path / "plain"))
    checkpoint = open_checkpoint(tmp_path / "plain")
    assert all(info.transform_descriptors is None
               for info in checkpoint.metadata.storage_data.values())
    loaded = load_with_torch(tmp_path / "plain")
    reference = load_with_torch(fixture_path(name))
    for fqn, value in reference.items():
        if hasattr(value, "shape"):
            assert tensor_sha256(loaded[fqn]) == tensor_sha256(value)


def test_thread_count_does_not_change_a_byte(tmp_path):
    source = fixture_path("fsdp2_adamw_3ranks")
    transcode_checkpoint(source, zstd_codec(5), str(tmp_path / "one"), threads=1)
    transcode_checkpoint(source, zstd_codec(5), str(tmp_path / "four"), threads=4)
    assert directory_state(tmp_path / "one") == directory_state(tmp_path / "four")


def test_items_already_in_zstd_are_copied_unless_a_level_is_asked(tmp_path):
    source = fixture_path("zstd_fsdp2_2ranks")
    copied = transcode_checkpoint(source, zstd_codec(), str(tmp_path / "copy"))
    assert copied.items_copied == copied.items and copied.items_transcoded == 0
    assert directory_state(tmp_path / "copy")["__0_0.distcp"] == directory_state(source)[
        "__0_0.distcp"]
    recoded = transcode_checkpoint(source, zstd_codec(19), str(tmp_path / "recode"),
                                   recode_same_codec=True)
    assert recoded.items_transcoded == recoded.items
    assert recoded.stored_bytes_after <= copied.stored_bytes_after
    assert load_with_torch(tmp_path / "recode").keys() == load_with_torch(source).keys()


def _files(checkpoint) -> dict:
    return {path.name: (path.stat().st_ino, path.stat().st_mtime_ns, path.read_bytes())
            for path in checkpoint.iterdir()}


@pytest.mark.parametrize("fixture, codec", [
    ("zstd_fsdp2_2ranks", "zstd"), ("fsdp2_adamw_3ranks", "none")])
def test_an_in_place_run_with_nothing_to_re_encode_leaves_the_checkpoint_as_it_is(
        copy_fixture, fixture, codec):
    """`compress` of a checkpoint in zstd already, or `decompress` of a plain one, certified
    by its SHA256SUMS (checked first), rewrote every file (new inodes, a new age for prune) to
    copy every item."""
    checkpoint = copy_fixture(fixture)
    checksum_checkpoint(checkpoint)
    before = _files(checkpoint)
    run = compress_checkpoint if codec == "zstd" else decompress_checkpoint
    report = run(checkpoint)
    assert report.unchanged and report.items_transcoded == 0 and report.items
    assert report.stored_bytes_after == report.stored_bytes_before
    assert _files(checkpoint) == before
    assert not compress_checkpoint(checkpoint, level=3 if codec == "zstd" else None).unchanged


def test_an_in_place_run_without_sha256sums_still_reads_and_checks_every_item(copy_fixture):
    """Left as it was, a checkpoint without SHA256SUMS had none of its items read: damage
    that compress stops at passed, exit 0."""
    checkpoint = copy_fixture("zstd_fsdp2_2ranks")
    flip_bit(checkpoint / "__0_0.distcp", 100)
    with pytest.raises(DataError, match="__0_0.distcp"):
        compress_checkpoint(checkpoint)


def test_an_in_place_run_that_an_earlier_one_left_half_done_is_finished(copy_fixture):
    """A run killed after `.metadata` named its new files left them under their temporary
    names; the next run, with nothing to re-encode, left them so."""
    checkpoint = copy_fixture("zstd_fsdp2_2ranks")
    checksum_checkpoint(checkpoint)
    metadata = torch_metadata(checkpoint)
    renamed = {}
    for info in metadata.storage_data.values():
        renamed.setdefault(info.relative_path, f"{info.relative_path}.dcpctl-0123456789ab.tmp")
        info.relative_path = renamed[info.relative_path]
    for name, temporary in renamed.items():
        (checkpoint / name).rename(checkpoint / temporary)
    (checkpoint / ".metadata").write_bytes(pickle.dumps(metadata))
    (checkpoint / "SHA256SUMS").unlink()
    checksum_checkpoint(checkpoint)
    report = compress_checkpoint(checkpoint)
    assert not report.unchanged
    assert sorted(path.name for path in checkpoint.iterdir() if ".tmp" in path.name) == []
    assert load_with_torch(checkpoint).keys() == load_with_torch(
        fixture_path("zstd_fsdp2_2ranks")).keys()


def test_in_place_rewrite_keeps_file_names_and_loads(copy_fixture):
    checkpoint = copy_fixture("fsdp2_adamw_3ranks")
    names_before = sorted(p.name for p in checkpoint.iterdir())
    report = transcode_checkpoint(checkpoint, zstd_codec())
    assert report.in_place
    assert sorted(p.name for p in checkpoint.iterdir()) == sorted(names_before + ["SHA256SUMS"])
    reference = load_with_torch(fixture_path("fsdp2_adamw_3ranks"))
    loaded = load_with_torch(checkpoint)
    assert {k: tensor_sha256(v) for k, v in loaded.items() if hasattr(v, "shape")} == {
        k: tensor_sha256(v) for k, v in reference.items() if hasattr(v, "shape")}


def test_dry_run_changes_nothing(copy_fixture):
    checkpoint = copy_fixture("objects_2ranks")
    before = directory_state(checkpoint)
    report = transcode_checkpoint(checkpoint, zstd_codec(), dry_run=True)
    assert report.dry_run and report.stored_bytes_after is None
    assert report.items == len(open_checkpoint(checkpoint).metadata.storage_data)
    assert directory_state(checkpoint) == before


def test_safetensors_layout_is_refused_saying_what_to_run(tmp_path):
    source = fixture_path("safetensors_fsdp2_2ranks")
    result = run_dcpctl("compress", source, "-o", tmp_path / "out")
    assert result.returncode == 1 and "SAFETENSORS" in result.stderr
    assert not (tmp_path / "out").exists()
    advice = re.search(r"`dcpctl (reshard .*?)`", result.stderr).group(1)
    arguments = [{"N": "2", "OUT": str(tmp_path / "out")}.get(word, word)
                 for word in advice.split()]
    assert run_dcpctl(*arguments).returncode == 0
    expected = MANIFEST["safetensors_fsdp2_2ranks"]["tensors"]
    loaded = load_with_torch(tmp_path / "out")  # stock torch reads what reshard wrote
    assert {fqn: tensor_sha256(loaded[fqn]) for fqn in expected} == {
        fqn: entry["sha256"] for fqn, entry in expected.items()}


def _corrupt_first_zstd_item(checkpoint):
    opened = open_checkpoint(checkpoint)
    tensor = opened.tensors[-1]
    storage = tensor.chunks[0].storage
    path = checkpoint / storage.relative_path
    data = bytearray(path.read_bytes())
    for position in range(storage.offset + 20, storage.offset + storage.length - 4):
        data[position] ^= 0x5A
    path.write_bytes(bytes(data))
    return tensor.fqn, storage.relative_path


@pytest.mark.parametrize("in_place", [True, False])
def test_corrupt_item_fails_naming_it_and_leaves_the_source_untouched(copy_fixture, tmp_path,
                                                                      in_place):
    checkpoint = copy_fixture("zstd_fsdp2_2ranks")
    fqn, file_name = _corrupt_first_zstd_item(checkpoint)
    before = directory_state(checkpoint)
    output = None if in_place else str(tmp_path / "out")
    with pytest.raises(DataError, match=f"{file_name}.*{fqn}"):
        transcode_checkpoint(checkpoint, IDENTITY, output, threads=2)
    assert directory_state(checkpoint) == before
    assert not any(p.name.startswith(".out") or p.name == "out" for p in tmp_path.iterdir())


def test_missing_source_file_is_named(copy_fixture, tmp_path):
    checkpoint = copy_fixture("fsdp2_adamw_3ranks")
    (checkpoint / "__2_0.distcp").unlink()
    with pytest.raises(DataError, match=r"__2_0.distcp: missing-file: missing data file"):
        transcode_checkpoint(checkpoint, zstd_codec(), str(tmp_path / "out"), threads=2)


def test_small_neighbouring_items_share_runs_large_ones_stand_alone():
    checkpoint = open_checkpoint(fixture_path("fsdp2_adamw_3ranks"))
    tasks = plan_transcode(checkpoint, zstd_codec(), recode_same_codec=False).tasks
    largest = max(task.location.length for task in tasks)
    runs = group_items_into_runs(tasks, max_bytes=4 * largest)
    assert [task for run in runs for task in run.tasks] == tasks
    assert len({run.lane for run in runs}) == 3 < len(runs) < len(tasks) / 3
    for run in runs:
        assert run.size_bytes == sum(task.location.length for task in run.tasks) <= 4 * largest
        for before, after in zip(run.tasks, run.tasks[1:]):
            assert after.output_file == before.output_file == run.lane
            assert after.location.start == before.location.start + before.location.length
    assert [len(run.tasks) for run in group_items_into_runs(tasks, max_bytes=1)] == [1] * len(tasks)


def test_disk_full_mid_run_cleans_up(copy_fixture, tmp_path, monkeypatch):
    # A real ENOSPC needs a full file system; fail the data writer the way one would.
    checkpoint = copy_fixture("fsdp2_adamw_3ranks")
    before = directory_state(checkpoint)
    real_write = DataFileWriter.write

    def write_until_full(self, piece):
        if self.size_bytes + len(piece) > 5_000:  # the disk fills during this write
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(self.path))
        real_write(self, piece)

    monkeypatch.setattr(DataFileWriter, "write", write_until_full)
    for output in (None, str(tmp_path / "out")):
        with pytest.raises(OSError, match="No space left"):
            transcode_checkpoint(checkpoint, zstd_codec(), output)
        assert directory_state(checkpoint) == before
        assert sorted(p.name for p in tmp_path.iterdir()) == ["fsdp2_adamw_3ranks"]


def test_existing_output_needs_overwrite(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("precious")
    with pytest.raises(OutputError, match="not empty"):
        transcode_checkpoint(fixture_path("mesh2d_4ranks"), zstd_codec(), str(out))
    assert (out / "keep.txt").read_text() == "precious"
    transcode_checkpoint(fixture_path("mesh2d_4ranks"), zstd_codec(), str(out), overwrite=True)
    assert not (out / "keep.txt").exists()
    assert load_with_torch(out).keys() == load_with_torch(fixture_path("mesh2d_4ranks")).keys()
    empty = tmp_path / "empty"
    empty.mkdir()
    transcode_checkpoint(fixture_path("mesh2d_4ranks"), zstd_codec(), str(empty))
    assert (empty / ".metadata").exists()


@pytest.mark.parametrize("name", TORCH_LOADABLE_FIXTURES)
def test_sha256sums_match_the_written_files(name, tmp_path):
    out = tmp_path / "out"
    transcode_checkpoint(fixture_path(name), zstd_codec(), str(out))
    lines = (out / "SHA256SUMS").read_text().splitlines()
    recorded = {line.split("  ", 1)[1]: line.split("  ", 1)[0] for line in lines}
    actual = directory_state(out)
    del actual["SHA256SUMS"]
    assert recorded == actual

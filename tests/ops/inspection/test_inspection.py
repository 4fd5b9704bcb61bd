"""`inspect` agrees with torch's own view of each fixture."""

from __future__ import annotations

import dataclasses
import json

import pytest
from conftest import FIXTURE_NAMES, MANIFEST, fixture_path, torch_metadata

from dcpctl.format.metadata.reading import read_metadata
from dcpctl.format.metadata.writing import serialize_metadata
from dcpctl.ops.inspection.report import inspect_checkpoint


def _report(name, fqn_glob=None):
    # Through JSON, as a script would see it.
    return json.loads(json.dumps(inspect_checkpoint(fixture_path(name), fqn_glob).to_json()))


@pytest.mark.parametrize("name", FIXTURE_NAMES)
def test_inspect_json_matches_torchs_metadata(name):
    report = _report(name)
    metadata = torch_metadata(fixture_path(name))
    assert report["version"] == metadata.version
    tensor_entries = {fqn: entry for fqn, entry in metadata.state_dict_metadata.items()
                      if hasattr(entry, "chunks")}
    assert [t["fqn"] for t in report["tensors"]] == list(tensor_entries)
    assert {o["fqn"] for o in report["objects"]} == set(metadata.state_dict_metadata) - set(
        tensor_entries)
    storage = {(key.fqn, tuple(key.offset) if key.offset is not None else None): info
               for key, info in metadata.storage_data.items()}
    for tensor in report["tensors"]:
        entry = tensor_entries[tensor["fqn"]]
        assert tensor["dtype"] == str(entry.properties.dtype).removeprefix("torch.")
        assert tensor["shape"] == list(entry.size)
        assert tensor["nbytes"] == entry.size.numel() * entry.properties.dtype.itemsize
        assert len(tensor["chunks"]) == len(entry.chunks)
        for chunk, torch_chunk in zip(tensor["chunks"], entry.chunks):
            assert chunk["offsets"] == list(torch_chunk.offsets)
            assert chunk["sizes"] == list(torch_chunk.sizes)
            info = storage[(tensor["fqn"], tuple(torch_chunk.offsets))]
            assert (chunk["file"], chunk["offset"], chunk["length"]) == (
                info.relative_path, info.offset, info.length)
            assert chunk["transforms"] == list(info.transform_descriptors or [])
        assert tensor["stored_bytes"] == sum(c["length"] for c in tensor["chunks"])
    for entry in report["objects"]:
        assert entry["stored_bytes"] == storage[(entry["fqn"], None)].length
    assert report["stored_bytes"] == sum(info.length for info in metadata.storage_data.values())
    files = {f["name"]: f["bytes"] for f in report["files"]}
    assert files == {info.relative_path: (fixture_path(name) / info.relative_path).stat().st_size
                     for info in metadata.storage_data.values()}


@pytest.mark.parametrize("name", FIXTURE_NAMES)
def test_inspect_totals_match_the_manifest(name):
    report = _report(name)
    described = MANIFEST[name]["tensors"]
    assert report["tensor_count"] == len(described)
    assert {t["fqn"]: t["shape"] for t in report["tensors"]} == {
        fqn: d["shape"] for fqn, d in described.items()}
    by_dtype = {}
    for tensor in report["tensors"]:
        by_dtype[tensor["dtype"]] = by_dtype.get(tensor["dtype"], 0) + tensor["nbytes"]
    assert report["nbytes_by_dtype"] == by_dtype
    assert sum(report["nbytes_by_top_level_key"].values()) == report["nbytes"]


def test_compression_is_reported():
    for name, codec in [("zstd_fsdp2_2ranks", "zstd"), ("fsdp2_adamw_3ranks", "none")]:
        item_count = len(torch_metadata(fixture_path(name)).storage_data)
        assert _report(name)["compression"] == {codec: item_count}
    files = _report("zstd_fsdp2_2ranks")["files"]
    assert [f["name"] for f in files] == ["__0_0.distcp", "__0_1.distcp", "__1_0.distcp",
                                          "__1_1.distcp"]


@pytest.mark.parametrize("name", FIXTURE_NAMES)
def test_each_files_codecs_count_its_items_as_torchs_metadata_lists_them(name):
    from dcpctl.format.codecs.names import describe_codec

    expected: dict[str, dict[str, int]] = {}
    for info in torch_metadata(fixture_path(name)).storage_data.values():
        codecs = expected.setdefault(info.relative_path, {})
        codec = describe_codec(info.transform_descriptors)
        codecs[codec] = codecs.get(codec, 0) + 1
    files = _report(name)["files"]
    assert {f["name"]: f["codecs"] for f in files} == expected
    assert {f["name"]: f["items"] for f in files} == {
        file: sum(counts.values()) for file, counts in expected.items()}


def test_filter_keeps_matching_fqns_only():
    report = _report("fsdp2_adamw_3ranks", "model.*.weight")
    assert [t["fqn"] for t in report["tensors"]] == [
        "model.embed.weight", "model.norm.weight", "model.proj.weight", "model.head.weight"]
    assert report["objects"] == []
    assert report["nbytes"] == sum(t["nbytes"] for t in report["tensors"])


def test_empty_shards_are_listed():
    report = _report("fsdp2_adamw_3ranks")
    head = next(t for t in report["tensors"] if t["fqn"] == "model.head.weight")
    assert [c["sizes"] for c in head["chunks"]] == [[1, 5], [1, 5], [0, 5]]


def _compact_dump(report) -> str:
    return json.dumps(report.to_json(), separators=(",", ":"), default=str)


@pytest.mark.parametrize("name", FIXTURE_NAMES)
@pytest.mark.parametrize("fqn_glob", [None, "model.*", "*.weight", "no-such-fqn"])
def test_json_text_is_the_compact_dump_of_to_json(name, fqn_glob):
    report = inspect_checkpoint(fixture_path(name), fqn_glob)
    assert report.to_json_text() == _compact_dump(report)


def _oddly_named_checkpoint(directory):
    """Rename a data file and some fqns to names JSON must escape, drop the storage of a chunk
    and of an object, and mark some items as zstd-compressed."""
    metadata = read_metadata(directory)
    odd_file = 'dätä "50%".distcp'
    (directory / "__0_0.distcp").rename(directory / odd_file)
    renames = {"model.norm.weight": 'model."nörm" 100%\n.weight', "model.head.bias": "\x1b[31m"}
    entries = metadata.state_dict_metadata
    metadata.state_dict_metadata = {renames.get(fqn, fqn): entry for fqn, entry in entries.items()}
    storage_data = {}
    for key, info in metadata.storage_data.items():
        if info.relative_path == "__0_0.distcp":
            info.relative_path = odd_file
        if key.fqn == "model.head.weight":
            info.transform_descriptors = ("stream.zstd/1",)
        storage_data[dataclasses.replace(key, fqn=renames.get(key.fqn, key.fqn))] = info
    dropped = [next(key for key in storage_data if key.fqn == "model.embed.weight"),
               next(key for key in storage_data if key.offset is None)]
    for key in dropped:
        del storage_data[key]
    metadata.storage_data = storage_data
    (directory / ".metadata").write_bytes(serialize_metadata(metadata))
    return directory


def test_json_text_escapes_names_and_writes_missing_storage_as_null(copy_fixture):
    report = inspect_checkpoint(_oddly_named_checkpoint(copy_fixture("fsdp2_adamw_3ranks")))
    assert report.to_json_text() == _compact_dump(report)
    tensors = {tensor["fqn"]: tensor for tensor in json.loads(report.to_json_text())["tensors"]}
    assert {chunk["file"] for chunk in tensors["model.embed.weight"]["chunks"]} >= {None}
    assert tensors["model.head.weight"]["chunks"][0]["transforms"] == ["stream.zstd/1"]
    assert 'model."nörm" 100%\n.weight' in tensors
    assert report.compression["zstd"] == len(tensors["model.head.weight"]["chunks"])


def test_json_text_of_many_tensors_of_several_chunks(copy_fixture):
    directory = copy_fixture("fsdp2_adamw_3ranks")
    metadata = read_metadata(directory)
    entry = metadata.state_dict_metadata["model.embed.weight"]
    storage = {key: info for key, info in metadata.storage_data.items()
               if key.fqn == "model.embed.weight"}
    for index in range(300):
        fqn = f"copies{index % 9}.{index}"  # more top-level keys than are summed column-wise
        metadata.state_dict_metadata[fqn] = dataclasses.replace(entry, chunks=[
            dataclasses.replace(chunk) for chunk in entry.chunks[:index % 4]])
        for key, info in list(storage.items())[:index % 4]:
            metadata.storage_data[dataclasses.replace(key, fqn=fqn)] = dataclasses.replace(info)
    (directory / ".metadata").write_bytes(serialize_metadata(metadata))
    report = inspect_checkpoint(directory)
    assert report.to_json_text() == _compact_dump(report)
    by_key, stored_by_key = {}, {}
    written = json.loads(report.to_json_text())
    for item in written["tensors"] + written["objects"]:
        key = item["fqn"].split(".")[0]
        by_key[key] = by_key.get(key, 0) + item.get("nbytes", 0)
        stored_by_key[key] = stored_by_key.get(key, 0) + item["stored_bytes"]
    assert report.nbytes_by_top_level_key == by_key
    assert by_key["copies0"] == 34 * entry.size[0] * entry.size[1] * entry.properties.dtype.itemsize
    assert report.stored_bytes_by_top_level_key == stored_by_key

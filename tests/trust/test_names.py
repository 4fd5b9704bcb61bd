"""Names a crafted `.metadata` gives its data files cannot turn a command against the
checkpoint's own files, and a rewrite in place touches no file the metadata does not name."""

from __future__ import annotations

import os
import pickle
import shutil

import pytest
from conftest import directory_state, fixture_path, torch_metadata

SOURCE = "fsdp2_adamw_3ranks"


def _renamed_file(checkpoint, old: str, new: str) -> None:
    metadata = torch_metadata(checkpoint)
    for info in metadata.storage_data.values():
        if info.relative_path == old:
            info.relative_path = new
    (checkpoint / ".metadata").write_bytes(pickle.dumps(metadata))
    if new not in (".metadata", "SHA256SUMS") and "\0" not in new and "\n" not in new:
        (checkpoint / new).parent.mkdir(exist_ok=True)
        os.rename(checkpoint / old, checkpoint / new)


@pytest.mark.parametrize("name, rule", [
    ("SHA256SUMS", "one of the checkpoint's own files"),
    (".metadata", "one of the checkpoint's own files"),
    (".metadata.tmp", "one of the checkpoint's own files"),
    ("__0_0\0.distcp", "not a plain path"),
    ("__0_0\n.distcp", "not a plain path"),
    # line breaks and controls other than \n, which str.splitlines would split SHA256SUMS on,
    # and a byte that is not UTF-8 (a surrogate once decoded)
    ("__0_0\r.distcp", "not a plain path"),
    ("__0_0\u2028.distcp", "not a plain path"),
    ("__0_0\x1c.distcp", "not a plain path"),
    ("__0_0\udc85.distcp", "not a plain path"),
    ("shards//__0_0.distcp", "not a plain path"),  # one file, two names: SHA256SUMS needs one
])
@pytest.mark.parametrize("command", [["checksum"], ["compress"], ["decompress"], ["inspect"],
                                     ["reshard", "--ranks", "2", "-o", "{out}"]])
def test_a_data_file_named_like_the_checkpoints_own_files_is_refused(run_cli, tmp_path, name,
                                                                     rule, command):
    checkpoint = tmp_path / "ckpt"
    shutil.copytree(fixture_path(SOURCE), checkpoint)
    _renamed_file(checkpoint, "__0_0.distcp", name)
    before = directory_state(checkpoint)
    args = [part.format(out=tmp_path / "out") for part in command]
    result = run_cli(args[0], checkpoint, *args[1:])
    assert result.exit_code == 1 and result.output.startswith("Error: ")
    assert rule in result.output and len(result.output.splitlines()) == 1, result.output
    assert directory_state(checkpoint) == before
    assert sorted(path.name for path in tmp_path.iterdir()) == ["ckpt"]


@pytest.mark.parametrize("command", [["compress"], ["decompress"],
                                     ["compress", "--codec", "floatsplit"]])
def test_a_rewrite_in_place_keeps_files_the_metadata_does_not_name(run_cli, tmp_path, command):
    checkpoint = tmp_path / "ckpt"
    shutil.copytree(fixture_path(SOURCE), checkpoint)
    strangers = {"__9_0.distcp": b"another save's data", "notes.txt": b"mine",
                 "x.dcpctl-0123456789ab.tmp.bak": b"not ours either"}
    for name, data in strangers.items():
        (checkpoint / name).write_bytes(data)
    result = run_cli(command[0], checkpoint, *command[1:])
    assert result.exit_code == 0, result.output
    for name, data in strangers.items():
        assert (checkpoint / name).read_bytes() == data


def test_a_fifo_where_a_data_file_should_be_is_refused_not_waited_on(run_cli, tmp_path):
    checkpoint = tmp_path / "ckpt"
    shutil.copytree(fixture_path(SOURCE), checkpoint)
    (checkpoint / "__1_0.distcp").unlink()
    os.mkfifo(checkpoint / "__1_0.distcp")
    for command in (["verify"], ["checksum"], ["compress"], ["inspect"],
                    ["convert", "--to", "torch", "-o", tmp_path / "x.pt"]):
        result = run_cli(command[0], checkpoint, *command[1:])
        assert result.exit_code == 1, (command, result.output)
        assert "not a regular file" in result.output, (command, result.output)
    (checkpoint / ".metadata").rename(tmp_path / "metadata")
    os.mkfifo(checkpoint / ".metadata")
    result = run_cli("inspect", checkpoint)
    assert result.exit_code == 1 and "not a regular file" in result.output

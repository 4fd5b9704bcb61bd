"""No output may hold, be or lie inside its input, whatever --overwrite says: replacing it
would delete the input (and its siblings), writing inside it would change it."""

from __future__ import annotations

import os
import shutil
import socket
import stat

import pytest
from conftest import directory_state, fixture_path, tree_listing

SOURCE = "fsdp2_adamw_3ranks"


def _run_directory(tmp_path):
    run = tmp_path / "run"
    for step in ("step-1", "step-2"):
        shutil.copytree(fixture_path(SOURCE), run / step)
    return run


@pytest.mark.parametrize("command", [
    ["compress", "{ckpt}", "-o", "{run}"],
    ["decompress", "{ckpt}", "-o", "{tmp}"],
    ["compress", "{ckpt}", "-o", "{ckpt}/inner"],
    ["reshard", "{ckpt}", "--ranks", "2", "-o", "{run}"],
    ["reshard", "{ckpt}", "--ranks", "2", "-o", "{ckpt}"],
    ["convert", "{ckpt}", "--to", "safetensors", "-o", "{run}"],
    ["convert", "{ckpt}", "--to", "safetensors", "-o", "{ckpt}/hf"],
    ["convert", "{ckpt}", "--to", "torch", "-o", "{ckpt}"],
    ["convert", "{run}/model.safetensors", "--to", "dcp", "-o", "{run}"],
])
def test_an_output_holding_or_inside_its_input_is_refused(run_cli, tmp_path, command):
    run = _run_directory(tmp_path)
    import torch
    from safetensors.torch import save_file
    save_file({"w": torch.ones(2)}, run / "model.safetensors")
    before = tree_listing(tmp_path)
    states = {step: directory_state(run / step) for step in ("step-1", "step-2")}
    args = [part.format(ckpt=run / "step-1", run=run, tmp=tmp_path) for part in command]
    result = run_cli(*args, "--overwrite")
    assert result.exit_code == 1, result.output
    assert result.output.startswith("Error: ") and "the input" in result.output
    assert len(result.output.splitlines()) == 1
    assert {step: directory_state(run / step) for step in states} == states
    assert tree_listing(tmp_path) == before


@pytest.mark.parametrize("make", [os.mkfifo, lambda path: socket.socket(
    socket.AF_UNIX).bind(str(path))], ids=["fifo", "socket"])
def test_a_file_output_that_is_not_a_regular_file_is_never_replaced(run_cli, tmp_path, make):
    """`-o /dev/null --overwrite` run as root would replace the device node with a file."""
    target = tmp_path / "special"
    make(target)
    kind = stat.S_IFMT(target.lstat().st_mode)
    for overwrite in ([], ["--overwrite"]):
        result = run_cli("convert", fixture_path(SOURCE), "--to", "torch", "-o", target,
                         *overwrite)
        assert result.exit_code == 1 and "is not a regular file" in result.output
        assert stat.S_IFMT(target.lstat().st_mode) == kind
    assert sorted(path.name for path in tmp_path.iterdir()) == ["special"]


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs Linux's /proc")
@pytest.mark.parametrize("command", [
    ["reshard", "{ckpt}", "--ranks", "2", "-o", "/proc/dcpctl-output"],
    ["convert", "{ckpt}", "--to", "torch", "-o", "/proc/dcpctl-output.pt"],
])
def test_an_output_where_nothing_can_be_made_is_named_as_given(run_cli, command):
    """Where its directory cannot be made (/proc refuses even root), the error named the hidden
    staging directory (`/proc/.dcpctl-output.dcpctl-<token>.tmp`), a name the user never gave."""
    args = [part.format(ckpt=fixture_path(SOURCE)) for part in command]
    result = run_cli(*args)
    assert result.exit_code == 1
    assert result.output.startswith(f"Error: {args[-1]}: "), result.output
    assert ".dcpctl-" not in result.output


def test_a_side_file_swapped_for_a_symlink_after_its_check_is_never_copied(tmp_path,
                                                                           monkeypatch):
    """meta.pt was checked when the output was set up and copied at publishing through a path
    that followed symlinks: swapped meanwhile for a link to a file outside the checkpoint, that
    file's bytes became the output's meta.pt, certified by its SHA256SUMS, exit 0."""
    import torch

    from dcpctl.errors import UnsafePathError
    from dcpctl.ops import transcode

    checkpoint = tmp_path / "ckpt"
    shutil.copytree(fixture_path("fsdp2_adamw_3ranks"), checkpoint)
    torch.save({"step": 1}, checkpoint / "meta.pt")
    secret = tmp_path / "secret.txt"
    secret.write_text("outside the checkpoint")
    real_execute = transcode.execute_transcode

    def swapped_meanwhile(*args, **kwargs):
        (checkpoint / "meta.pt").unlink()
        (checkpoint / "meta.pt").symlink_to(secret)
        return real_execute(*args, **kwargs)

    monkeypatch.setattr(transcode, "execute_transcode", swapped_meanwhile)
    with pytest.raises(UnsafePathError, match="'meta.pt' resolves to .*secret.txt, outside "
                                              "the checkpoint directory"):
        transcode.compress_checkpoint(checkpoint, output_path=str(tmp_path / "out"))
    assert not (tmp_path / "out").exists()


def _with_meta_pt(tmp_path):
    import torch

    checkpoint = tmp_path / "ckpt"
    shutil.copytree(fixture_path(SOURCE), checkpoint)
    torch.save({"global_step": 1}, checkpoint / "meta.pt")
    return checkpoint


def _damage_meta_pt(checkpoint) -> None:
    """Replace meta.pt with a copy of it whose pickle has a bit flipped (its CRC-32 fails)."""
    data = bytearray((checkpoint / "meta.pt").read_bytes())
    data[data.find(b"global_step")] ^= 0x10
    (checkpoint / "meta.pt").unlink()
    (checkpoint / "meta.pt").write_bytes(bytes(data))


def test_a_side_file_damaged_after_its_check_is_never_copied(tmp_path, monkeypatch):
    """meta.pt was checked when the output was set up and copied at publishing unchecked:
    damaged meanwhile, the damaged copy was published and certified by SHA256SUMS, exit 0
    (`verify` then found its CRC-32 wrong)."""
    from dcpctl.format.checkpoint.problems import ProblemsError
    from dcpctl.ops import transcode

    checkpoint = _with_meta_pt(tmp_path)
    real_execute = transcode.execute_transcode

    def damaged_meanwhile(*args, **kwargs):
        _damage_meta_pt(checkpoint)
        return real_execute(*args, **kwargs)

    monkeypatch.setattr(transcode, "execute_transcode", damaged_meanwhile)
    with pytest.raises(ProblemsError, match="meta.pt: .*crc-mismatch: record 'meta/data.pkl'"):
        transcode.compress_checkpoint(checkpoint, output_path=str(tmp_path / "out"))
    assert not (tmp_path / "out").exists()
    before = directory_state(checkpoint)
    with pytest.raises(ProblemsError, match="meta.pt: .*crc-mismatch"):
        transcode.compress_checkpoint(checkpoint)  # in place: refused before anything changes
    assert directory_state(checkpoint) == before


def test_a_side_file_changed_while_it_is_copied_is_refused(tmp_path, monkeypatch):
    """The bytes copied or certified must be the bytes checked: a side file written to while
    dcpctl reads it (its change time moves) is refused, nothing published."""
    from dcpctl.errors import DataError
    from dcpctl.format.checkpoint import publishing
    from dcpctl.ops import transcode

    checkpoint = _with_meta_pt(tmp_path)
    real_copy = publishing.DataFileWriter.write

    def written_to_meanwhile(self, piece):
        with open(checkpoint / "meta.pt", "r+b") as stream:
            first = stream.read(1)
            stream.seek(0)
            stream.write(first)  # the same byte: only its change time tells
        return real_copy(self, piece)

    monkeypatch.setattr(publishing.DataFileWriter, "write", written_to_meanwhile)
    with pytest.raises(DataError, match="meta.pt changed while dcpctl read it"):
        transcode.compress_checkpoint(checkpoint, output_path=str(tmp_path / "out"))
    assert not (tmp_path / "out").exists()


def test_checksum_certifies_only_the_side_file_it_checked(tmp_path, monkeypatch):
    """checksum hashed meta.pt in its scan and checked it in another read: replaced between
    the two by a sound archive of other contents, the new file was checked and the old one's
    digest certified."""
    import torch

    from dcpctl.errors import DataError
    from dcpctl.ops import checksum

    checkpoint = _with_meta_pt(tmp_path)
    real_scan = checksum.run_scan

    def replaced_after_the_scan(*args, **kwargs):
        problems = real_scan(*args, **kwargs)
        torch.save({"global_step": 2}, checkpoint / "meta.pt")
        return problems

    monkeypatch.setattr(checksum, "run_scan", replaced_after_the_scan)
    with pytest.raises(DataError, match="meta.pt changed while dcpctl read it"):
        checksum.checksum_checkpoint(checkpoint)
    assert not (checkpoint / "SHA256SUMS").exists()


def test_in_place_side_files_are_hashed_before_the_switch(tmp_path, monkeypatch):
    """An in-place compress hashed the side files after `.metadata` named the new files: meta.pt
    swapped for a link out then failed the run with the checkpoint rewritten whole and its
    SHA256SUMS gone. Now they are hashed (and checked) first, and SHA256SUMS lists what was."""
    import hashlib

    from dcpctl.format.checkpoint import publishing
    from dcpctl.ops import transcode
    from dcpctl.ops.checksum import checksum_checkpoint

    checkpoint = _with_meta_pt(tmp_path)
    checksum_checkpoint(checkpoint)
    digest = hashlib.sha256((checkpoint / "meta.pt").read_bytes()).hexdigest()
    (tmp_path / "secret.txt").write_text("outside")
    real_failpoint = publishing.failpoint

    def swapped_after_the_switch(name):
        if name == publishing.Failpoint.AFTER_FIRST_METADATA_SWITCH:
            (checkpoint / "meta.pt").rename(tmp_path / "meta.pt")
            (checkpoint / "meta.pt").symlink_to(tmp_path / "secret.txt")
        return real_failpoint(name)

    monkeypatch.setattr(publishing, "failpoint", swapped_after_the_switch)
    transcode.compress_checkpoint(checkpoint)
    sums = dict(reversed(line.split()) for line in
                (checkpoint / "SHA256SUMS").read_text().splitlines())
    assert sums["meta.pt"] == digest


def test_a_side_file_link_is_opened_where_it_was_checked_to_lead(tmp_path, monkeypatch):
    """A link inside the checkpoint was resolved to be checked and then again to be opened:
    swapped between the two for a link out, the file outside was read."""
    from dcpctl.format.checkpoint import side_files, view

    checkpoint = tmp_path / "ckpt"
    checkpoint.mkdir()
    (checkpoint / "real_meta.pt").write_bytes(b"inside")
    (checkpoint / "meta.pt").symlink_to("real_meta.pt")
    (tmp_path / "secret.txt").write_bytes(b"outside")
    checked = view.real_path_inside

    def checked_then_swapped(directory, name):
        real = checked(directory, name)
        (checkpoint / "meta.pt").unlink()
        (checkpoint / "meta.pt").symlink_to(tmp_path / "secret.txt")
        return real

    monkeypatch.setattr(view, "real_path_inside", checked_then_swapped)
    with side_files.open_side_file(checkpoint, "meta.pt") as reader:
        assert reader.read(0, 100) == b"inside"

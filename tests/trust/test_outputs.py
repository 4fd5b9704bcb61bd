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


def _damaged_as_the_run_goes(monkeypatch, checkpoint) -> None:
    """Have the next transcode damage checkpoint's meta.pt once the run is under way."""
    from dcpctl.ops import transcode

    real_execute = transcode.execute_transcode

    def damaged_meanwhile(*args, **kwargs):
        _damage_meta_pt(checkpoint)
        return real_execute(*args, **kwargs)

    monkeypatch.setattr(transcode, "execute_transcode", damaged_meanwhile)


def test_a_side_file_damaged_after_its_check_is_never_copied(tmp_path, monkeypatch):
    """meta.pt was checked when the output was set up and copied at publishing unchecked:
    damaged meanwhile, the damaged copy was published and certified by SHA256SUMS, exit 0
    (`verify` then found its CRC-32 wrong)."""
    from dcpctl.format.checkpoint.problems import ProblemsError
    from dcpctl.ops import transcode

    checkpoint = _with_meta_pt(tmp_path)
    _damaged_as_the_run_goes(monkeypatch, checkpoint)
    with pytest.raises(ProblemsError, match="meta.pt: .*crc-mismatch: record 'meta/data.pkl'"):
        transcode.compress_checkpoint(checkpoint, output_path=str(tmp_path / "out"))
    assert not (tmp_path / "out").exists()


def test_a_side_file_written_to_as_it_is_copied_is_checked_as_copied(tmp_path, monkeypatch):
    """The bytes copied must be the bytes checked, whatever writes the file meanwhile: a bit
    flipped in the part of meta.pt not yet read when its first piece was copied is in the
    copy, so the copy is refused, nothing published (a check of its own read passed the file
    as it was before, or as it was after)."""
    import torch

    from dcpctl.format.checkpoint import publishing
    from dcpctl.format.checkpoint.problems import ProblemsError
    from dcpctl.ops import transcode

    checkpoint = tmp_path / "ckpt"
    shutil.copytree(fixture_path(SOURCE), checkpoint)
    torch.save({"global_step": 1, "buffer": torch.zeros(6 << 20, dtype=torch.uint8)},
               checkpoint / "meta.pt")  # two pieces of 4 MiB
    real_write = publishing.DataFileWriter.write
    pieces = []

    def flipped_after_the_first_piece(self, piece):
        if self.path.name == "meta.pt":
            pieces.append(len(piece))
            if len(pieces) == 1:
                with open(checkpoint / "meta.pt", "r+b") as stream:
                    stream.seek(5 << 20)
                    stream.write(b"\x01")
        return real_write(self, piece)

    monkeypatch.setattr(publishing.DataFileWriter, "write", flipped_after_the_first_piece)
    with pytest.raises(ProblemsError, match="meta.pt: .*crc-mismatch: record 'meta/data/"):
        transcode.compress_checkpoint(checkpoint, output_path=str(tmp_path / "out"))
    assert len(pieces) == 2 and not (tmp_path / "out").exists()


def test_a_side_file_changed_before_its_second_read_is_refused(tmp_path, monkeypatch):
    """An archive whose records the streamed check cannot hold is checked from a second read:
    one that differs from the bytes copied fails the run, exit status 75 (run again)."""
    import torch

    from dcpctl.errors import ChangedWhileReadError
    from dcpctl.format.checkpoint import side_files
    from dcpctl.ops import transcode

    checkpoint = tmp_path / "ckpt"
    shutil.copytree(fixture_path(SOURCE), checkpoint)
    torch.save({name: torch.ones(1 << 19) for name in "abcd"} | {"step": 1},
               checkpoint / "meta.pt")  # 8 MiB: records past the stream check's windows
    spooled = side_files.spooled_read_range

    def changed_first(pieces):
        data = bytearray((checkpoint / "meta.pt").read_bytes())
        data[len(data) // 2] ^= 1
        (checkpoint / "meta.pt").write_bytes(bytes(data))
        return spooled(pieces)

    monkeypatch.setattr(side_files, "spooled_read_range", changed_first)
    with pytest.raises(ChangedWhileReadError, match="meta.pt changed while dcpctl read it") as \
            refused:
        transcode.compress_checkpoint(checkpoint, output_path=str(tmp_path / "out"))
    assert refused.value.exit_code == 75 and not (tmp_path / "out").exists()


def test_in_place_a_side_file_damaged_as_the_run_goes_is_refused_before_the_switch(
        tmp_path, monkeypatch):
    """In place, side files are checked on the bytes hashed for SHA256SUMS, before
    `.metadata` names the new data files: damaged as the run went, the checkpoint is left as
    it was (a hash unchecked would certify the damage)."""
    from dcpctl.format.checkpoint.problems import ProblemsError
    from dcpctl.ops import transcode

    checkpoint = _with_meta_pt(tmp_path)
    before = directory_state(checkpoint)
    _damaged_as_the_run_goes(monkeypatch, checkpoint)
    with pytest.raises(ProblemsError, match="meta.pt: .*crc-mismatch"):
        transcode.compress_checkpoint(checkpoint)
    after = directory_state(checkpoint)
    assert after.pop("meta.pt") != before.pop("meta.pt") and after == before


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

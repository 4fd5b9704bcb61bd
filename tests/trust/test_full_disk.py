"""A write that fails (a full disk, a file size limit) stops the command with one line naming
the file it was writing; nothing is published and nothing of the run is left behind."""

from __future__ import annotations

import os
import re
import resource
import shutil
import subprocess
import sys

import pytest
from conftest import directory_state, fixture_path, tree_listing


def entries(path):
    """Every path under path with its size (directory times change as entries come and go)."""
    return {name: size for name, (size, _) in tree_listing(path).items()}


SOURCE = "fsdp2_adamw_3ranks"


def _run_with_file_size_limit(limit_bytes: int, *args) -> subprocess.CompletedProcess:
    """dcpctl in a process whose writes past limit_bytes in one file fail with EFBIG (Python
    ignores SIGXFSZ), as writes on a full disk fail with ENOSPC."""
    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit_bytes, limit_bytes))

    return subprocess.run([sys.executable, "-m", "dcpctl", *map(str, args)],
                          capture_output=True, text=True, preexec_fn=limit)


@pytest.mark.parametrize("command, limit_bytes", [
    (["compress", "{ckpt}", "-o", "{out}"], 4_000),
    (["compress", "{ckpt}"], 4_000),
    (["decompress", "{ckpt}", "-o", "{out}"], 4_000),  # in place, a plain one is left as it is
    (["reshard", "{ckpt}", "--ranks", "2", "-o", "{out}"], 4_000),
    (["convert", "{ckpt}", "--to", "safetensors", "-o", "{out}", "--include", "*"], 2_000),
    (["convert", "{ckpt}", "--to", "torch", "-o", "{out}.pt"], 4_000),
    (["checksum", "{ckpt}"], 100),
])
def test_a_failed_write_names_its_file_and_leaves_nothing(tmp_path, command, limit_bytes):
    checkpoint = tmp_path / "ckpt"
    shutil.copytree(fixture_path(SOURCE), checkpoint)
    before = entries(tmp_path)
    state = directory_state(checkpoint)
    args = [part.format(ckpt=checkpoint, out=tmp_path / "out") for part in command]
    result = _run_with_file_size_limit(limit_bytes, *args)
    assert result.returncode == 1, result.stderr
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"Error: {tmp_path}/"), result.stderr
    assert lines[0].endswith(": File too large")
    if "-o" in command:  # the output as the user named it, not the staging directory it had
        assert lines[0].startswith(f"Error: {tmp_path / 'out'}") and ".dcpctl-" not in lines[0]
    assert directory_state(checkpoint) == state
    assert entries(tmp_path) == before


@pytest.mark.parametrize("command", [
    ["compress", "{ckpt}", "-o", "{out}"], ["compress", "{ckpt}"],
    ["reshard", "{ckpt}", "--ranks", "2", "-o", "{out}"],
    ["convert", "{ckpt}", "--to", "safetensors", "-o", "{out}", "--include", "*"],
], ids=["compress", "in-place", "reshard", "convert"])
def test_a_failed_write_in_a_worker_names_its_file_as_one_process_does(tmp_path, command):
    """A worker's full disk read `worker 1 of 2: internal error: OSError: [Errno 28] No space
    left on device: ...`, where one process says `<file>: No space left on device`."""
    checkpoint = tmp_path / "ckpt"
    shutil.copytree(fixture_path(SOURCE), checkpoint)
    before = entries(tmp_path)
    state = directory_state(checkpoint)
    args = [part.format(ckpt=checkpoint, out=tmp_path / "out") for part in command]
    result = _run_with_file_size_limit(2_000, *args, "--workers", 2)
    assert result.returncode == 1, result.stderr
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    worker = "(worker [12] of 2: )?"  # convert lays its files out before the workers start
    assert re.fullmatch(f"Error: {worker}{re.escape(str(tmp_path))}/.*: File too large",
                        lines[0]), lines[0]
    if "-o" in command:  # the output as the user named it, not the staging directory it had
        assert f"{tmp_path / 'out'}/" in lines[0] and ".dcpctl-" not in lines[0], lines[0]
    assert directory_state(checkpoint) == state
    assert entries(tmp_path) == before


@pytest.fixture
def small_file_system(tmp_path):
    """A 256 KiB tmpfs, where writes run out of space for real (needs root to mount)."""
    mount_point = tmp_path / "small"
    mount_point.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs",
                              str(mount_point)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip("cannot mount a tmpfs here (not root?)")
    yield mount_point
    subprocess.run(["umount", str(mount_point)], check=True)


def test_a_full_disk_names_the_file_being_written(small_file_system, tmp_path):
    checkpoint = small_file_system / "ckpt"
    shutil.copytree(fixture_path("mesh2d_4ranks"), checkpoint)
    space = os.statvfs(small_file_system)
    (small_file_system / "filler").write_bytes(b"\1" * (space.f_bavail * space.f_frsize - 8192))
    before = entries(small_file_system)
    result = subprocess.run([sys.executable, "-m", "dcpctl", "decompress", checkpoint, "-o",
                             small_file_system / "out"], capture_output=True, text=True)
    if result.returncode == 0:
        pytest.skip("the output fitted")
    assert result.returncode == 1
    assert result.stderr.startswith(f"Error: {small_file_system}/")
    assert "No space left on device" in result.stderr and len(result.stderr.splitlines()) == 1
    assert entries(small_file_system) == before


@pytest.mark.parametrize("command", [["compress"], ["reshard", "--ranks", "2"],
                                     ["convert", "--to", "safetensors"]])
def test_a_mount_point_as_the_output_is_refused_before_anything_is_written(
        small_file_system, tmp_path, command):
    """An empty mount point is an empty directory, which an output may take; but the output is
    written beside it, on the file system above (which may be the one that cannot hold it),
    and renaming it onto the mount point failed at the end: `Device or resource busy`."""
    before = entries(tmp_path)
    result = subprocess.run([sys.executable, "-m", "dcpctl", command[0], fixture_path(SOURCE),
                             *command[1:], "-o", small_file_system], capture_output=True,
                            text=True)
    assert result.returncode == 1
    assert result.stderr == (f"Error: {small_file_system}: is a mount point, which no output "
                             "can be renamed onto (dcpctl writes an output beside its "
                             "destination, on that file system, then renames it into place); "
                             "give a path inside it\n")
    assert entries(tmp_path) == before

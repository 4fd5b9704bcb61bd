"""Shared test helpers: the shipped fixtures, copies of them, and torch's own view of them."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import pickle
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
FIXTURES_DIR = REPO_ROOT / "fixtures"
sys.path.insert(0, str(FIXTURES_DIR))

MANIFEST = json.loads((FIXTURES_DIR / "manifest.json").read_text())
FIXTURE_NAMES = sorted(MANIFEST)
# torch's FileSystemReader cannot load SAFETENSORS-serialized checkpoints; tests that compare
# with stock `dcp.load` skip that one.
TORCH_LOADABLE_FIXTURES = [name for name in FIXTURE_NAMES
                           if MANIFEST[name]["writer"].get("serialization") != "safetensors"]


def run_dcpctl(*args, failpoint: str | None = None, trace: Path | None = None,
               failpoint_scope: str = "all", **kwargs) -> subprocess.CompletedProcess:
    """Run `python -m dcpctl` with these arguments in a process of its own, killed at
    `failpoint` (name or name@n) if given (with failpoint_scope "workers" or "coordinator",
    only the processes --workers starts, or only the command's own), its failpoints traced
    into `trace` if given."""
    env = {**os.environ, "DCPCTL_FAILPOINT": failpoint or "",
           "DCPCTL_FAILPOINT_TRACE": str(trace or ""), "DCPCTL_FAILPOINT_SCOPE": failpoint_scope}
    return subprocess.run([sys.executable, "-m", "dcpctl", *map(str, args)], env=env,
                          capture_output=True, text=True, **kwargs)


def dcpctl_stopped_at(failpoint: str, *args) -> subprocess.Popen:
    """`python -m dcpctl *args` in a process of its own, once it stopped itself (SIGSTOP) at
    failpoint (name or name@n); SIGCONT resumes it. Killed if it does not stop in a minute."""
    process = subprocess.Popen([sys.executable, "-m", "dcpctl", *map(str, args)],
                               env={**os.environ, "DCPCTL_FAILPOINT": f"{failpoint}:SIGSTOP"},
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    try:
        while open(f"/proc/{process.pid}/stat").read().split(") ")[1][0] != "T":
            assert process.poll() is None and time.monotonic() < deadline, process.poll()
            time.sleep(0.05)
    except BaseException:
        process.kill()
        raise
    return process


def failpoint_passes(args: list, trace: Path) -> dict[str, int]:
    """How often `dcpctl *args` passes each failpoint, from one traced run that must succeed."""
    result = run_dcpctl(*args, trace=trace)
    assert result.returncode == 0, result.stderr
    names = trace.read_text().split()
    return {name: names.count(name) for name in dict.fromkeys(names)}


def failpoint_moments(passes: dict[str, int]) -> list[str]:
    """Each failpoint at its first, a middle and its last pass: `name@n`."""
    return [f"{name}@{hit}" for name, count in passes.items()
            for hit in sorted({1, (count + 1) // 2, count})]


@pytest.fixture
def run_cli():
    """Run a dcpctl command line in this process (click's CliRunner); returns its Result."""
    from click.testing import CliRunner

    from dcpctl.cli.main import cli

    def run(*args):
        return CliRunner().invoke(cli, [str(arg) for arg in args])

    return run


def fixture_path(name: str) -> Path:
    """The shipped fixture checkpoint called name (read-only: copy it before changing it)."""
    return FIXTURES_DIR / name


def torch_metadata(checkpoint: Path):
    """`.metadata` unpickled by torch's own classes (trusted: our fixtures only)."""
    import torch.distributed.checkpoint  # noqa: F401  registers torch's classes

    with open(checkpoint / ".metadata", "rb") as stream:
        return pickle.load(stream)


def load_with_torch(checkpoint: Path) -> dict:
    """The whole checkpoint as stock torch DCP loads it in one process, keyed by fqn."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict
    from torch.distributed.checkpoint.format_utils import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    state: dict = {}
    _load_state_dict(state, storage_reader=FileSystemReader(checkpoint),
                     planner=_EmptyStateDictLoadPlanner(), no_dist=True)
    flat, _ = flatten_state_dict(state)
    return flat


def entry_files(checkpoint: Path, leave_out=lambda fqn: False) -> dict:
    """(fqn, (chunk offsets, chunk sizes), or None for an object) -> the file holding it, as
    torch's own metadata classes read it; entries whose fqn leave_out(fqn) are not listed."""
    metadata = torch_metadata(checkpoint)
    sizes = {(fqn, tuple(chunk.offsets)): tuple(chunk.sizes)
             for fqn, entry in metadata.state_dict_metadata.items()
             for chunk in getattr(entry, "chunks", ())}

    def where(key) -> tuple | None:
        return None if key.offset is None else (tuple(key.offset),
                                                sizes[key.fqn, tuple(key.offset)])

    return {(key.fqn, where(key)): info.relative_path
            for key, info in metadata.storage_data.items() if not leave_out(key.fqn)}


def is_per_rank_object(fqn: str) -> bool:
    """torchtitan's dataloader state, one object per data-parallel rank."""
    return fqn.startswith("dataloader.dp_rank_")


def assert_torch_loads_equal(original: Path, *rewritten: Path) -> None:
    """Stock torch reads every rewritten checkpoint with the original's entries and tensors."""
    import torch

    expected = load_with_torch(original)
    for path in rewritten:
        loaded = load_with_torch(path)
        assert loaded.keys() == expected.keys(), path
        for fqn, value in expected.items():
            if isinstance(value, torch.Tensor):
                assert torch.equal(loaded[fqn], value), (path, fqn)


def directory_state(path: Path) -> dict[str, str]:
    """Name -> SHA-256 of every file in a directory, to show it did or did not change."""
    return {entry.name: hashlib.sha256(entry.read_bytes()).hexdigest()
            for entry in sorted(path.iterdir()) if entry.is_file()}


def assert_plain_items_equal_decoded(original_dir: Path, restored_dir: Path) -> None:
    """Every item of restored_dir is stored plain and equals the decoded item of original_dir."""
    from dcpctl.format.checkpoint.items import read_item
    from dcpctl.format.checkpoint.view import open_checkpoint

    original = open_checkpoint(original_dir)
    restored = open_checkpoint(restored_dir)
    for key, location in item_locations(original).items():
        mine = restored.metadata.storage_data[key]
        assert mine.transform_descriptors is None
        restored_bytes = (restored_dir / mine.relative_path).read_bytes()
        assert restored_bytes[mine.offset:mine.offset + mine.length] == read_item(location)


def item_locations(checkpoint) -> dict:
    """MetadataIndex -> ItemLocation of every chunk and object of an opened checkpoint."""
    from dcpctl.format.checkpoint.locations import locate_chunk, locate_object
    from dcpctl.format.metadata.records import MetadataIndex

    locations = {MetadataIndex(tensor.fqn, tuple(chunk.offsets)):
                 locate_chunk(checkpoint, tensor, chunk)
                 for tensor in checkpoint.tensors for chunk in tensor.chunks}
    locations.update((MetadataIndex(entry.fqn), locate_object(checkpoint, entry))
                     for entry in checkpoint.objects)
    return locations


@pytest.fixture
def copy_fixture(tmp_path):
    """Copy a shipped fixture into tmp_path, to damage or rewrite it."""

    def make_copy(name: str) -> Path:
        target = tmp_path / name
        shutil.copytree(fixture_path(name), target)
        return target

    return make_copy


def flip_bit(path: Path, offset: int, mask: int = 0x04) -> None:
    """Flip the bits of mask in the byte at offset of the file at path, in place."""
    with open(path, "r+b") as stream:
        stream.seek(offset)
        byte = stream.read(1)[0]
        stream.seek(offset)
        stream.write(bytes([byte ^ mask]))


def damage_one_item(checkpoint: Path, file_name: str) -> None:
    """Flip a bit in the tensor bytes of the largest item of a data file, where its CRC-32
    covers it; SHA256SUMS goes, so that the damage is found as the item is read."""
    from dcpctl.format.checkpoint.view import open_checkpoint
    from dcpctl.format.torch_save.layout import find_payload_start

    (checkpoint / "SHA256SUMS").unlink(missing_ok=True)  # else caught before any worker starts
    locations = [location for location in item_locations(open_checkpoint(checkpoint)).values()
                 if Path(location.path).name == file_name]
    largest = max(locations, key=lambda location: location.length)
    with open(checkpoint / file_name, "rb") as stream:
        stream.seek(largest.start)
        payload_start = find_payload_start(stream.read(largest.length))
    flip_bit(checkpoint / file_name, largest.start + payload_start)  # a CRC-32 covers it


def back_date(path: Path, age_seconds: float) -> None:
    """Set the mtime of path and of everything under it to age_seconds ago."""
    when = time.time() - age_seconds
    for root, directory_names, file_names in os.walk(path):
        for name in directory_names + file_names:
            os.utime(os.path.join(root, name), (when, when), follow_symlinks=False)
    os.utime(path, (when, when))


def add_checkpoint(run_dir: Path, name: str, complete: bool = True, age_seconds: float = 3600,
                   fixture: str = "mesh2d_4ranks") -> Path:
    """Copy a shipped fixture to run_dir/name (without `.metadata` unless complete), aged
    age_seconds; mesh2d_4ranks is the smallest fixture."""
    path = run_dir / name
    shutil.copytree(fixture_path(fixture), path)
    if not complete:
        (path / ".metadata").unlink()
    back_date(path, age_seconds)
    return path


ACCELERATE_PARTS = ("optimizer_0", "pytorch_model_fsdp_0")


def add_accelerate_checkpoint(run_dir, name, parts_complete=(True, True), rng_states=True,
                              custom_objects=0, age_seconds=30 * 86400):
    """A checkpoint as accelerate's save_state writes it with FSDP's SHARDED_STATE_DICT: the
    model and optimizer as DCP directories, then the scheduler and each rank's RNG states,
    then the objects registered for checkpointing (custom_objects of them)."""
    checkpoint = run_dir / name
    for part, complete in zip(ACCELERATE_PARTS, parts_complete):
        add_checkpoint(checkpoint, part, complete=complete)
    (checkpoint / "scheduler.bin").write_bytes(b"scheduler state")
    if rng_states:
        for rank in range(2):
            (checkpoint / f"random_states_{rank}.pkl").write_bytes(b"rng state")
    for index in range(custom_objects):
        (checkpoint / f"custom_checkpoint_{index}.pkl").write_bytes(b"registered object")
    back_date(checkpoint, age_seconds)
    return checkpoint


def tree_listing(path: Path) -> dict[str, tuple[int, int]]:
    """Every entry under path (symlinks not followed) with its size and mtime, to compare."""
    status = os.lstat(path)
    listing = {".": (status.st_size, status.st_mtime_ns)}
    for root, directory_names, file_names in os.walk(path):
        for name in directory_names + file_names:
            entry = os.path.join(root, name)
            status = os.lstat(entry)
            listing[os.path.relpath(entry, path)] = (status.st_size, status.st_mtime_ns)
    return listing


def fail_deletion_part_way(monkeypatch, failing_name):
    """Make prune's deletion fail with EACCES part-way through the checkpoint named
    failing_name, after removing one of its files, as a file the user may not remove would.
    Injected because the tests run as root, where chmod cannot produce EACCES."""
    from dcpctl.ops.runs import prune

    real_empty_directory = prune.empty_directory

    def empty_directory(descriptor):
        path = Path(os.readlink(f"/proc/self/fd/{descriptor}"))
        if path.name == failing_name:
            (path / "__0_0.distcp").unlink()
            raise PermissionError(errno.EACCES, "Permission denied", str(path / "__1_0.distcp"))
        return real_empty_directory(descriptor)

    monkeypatch.setattr(prune, "empty_directory", empty_directory)


@pytest.fixture
def another_prune():
    """Hold the lock a running `dcpctl prune` holds on a run directory, in this process."""
    from dcpctl.storage.locks import locked_directory

    return lambda run_dir: locked_directory(run_dir, exclusive=True, what="held by the test")


DEEP_TREE_LEVELS = 1500


@pytest.fixture
def deep_tree():
    """make(directory): directories nested DEEP_TREE_LEVELS deep inside it, more than Python's
    recursion limit; the soft open-file limit is raised for the test, and the tree removed
    after it (pytest's own clean-up recurses)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = DEEP_TREE_LEVELS + 500
    resource.setrlimit(resource.RLIMIT_NOFILE, (
        max(soft, wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)), hard))
    made = []

    def make(directory: Path) -> None:
        descriptor = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
        for _ in range(DEEP_TREE_LEVELS):  # too deep to name by path: go down by descriptor
            os.mkdir("d", dir_fd=descriptor)
            inner = os.open("d", os.O_RDONLY | os.O_DIRECTORY, dir_fd=descriptor)
            os.close(descriptor)
            descriptor = inner
        os.close(descriptor)
        made.append(directory / "d")

    yield make
    for top in made:
        subprocess.run(["rm", "-rf", str(top)], check=True)
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


@pytest.fixture(scope="session")
def moto_s3():
    """moto's S3 server on 127.0.0.1, for the whole session."""
    import logging

    from s3_servers import moto_server
    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    with moto_server() as server:
        yield server


@pytest.fixture(scope="session")
def rclone_s3(tmp_path_factory):
    """`rclone serve s3` on 127.0.0.1 over a temporary directory, for the whole session."""
    from s3_servers import rclone_server
    with rclone_server(tmp_path_factory.mktemp("rclone-root")) as server:
        yield server


@pytest.fixture(params=["moto", "rclone"])
def s3_server(request, monkeypatch):
    """Each S3 server in turn, with this process's environment pointing at it (and nowhere
    else)."""
    server = request.getfixturevalue(f"{request.param}_s3")
    for name, value in server.environment().items():
        monkeypatch.setenv(name, value)
    return server


def upload_directory(server, directory: Path, bucket: str, prefix: str) -> str:
    """Put every file of a local directory under s3://bucket/prefix; returns that URL."""
    client = server.client()
    for path in sorted(directory.rglob("*")):
        if path.is_file():
            client.put_object(Bucket=bucket, Key=f"{prefix}/{path.relative_to(directory)}",
                              Body=path.read_bytes())
    return f"s3://{bucket}/{prefix}"


def download_prefix(server, bucket: str, prefix: str, directory: Path) -> Path:
    """Get every object under s3://bucket/prefix into a local directory."""
    client = server.client()
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket,
                                                                 Prefix=prefix + "/"):
        for entry in page.get("Contents", []):
            target = directory / entry["Key"][len(prefix) + 1:]
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(client.get_object(Bucket=bucket, Key=entry["Key"])["Body"].read())
    return directory


def load_with_dcpctl_reader(url: str) -> dict:
    """The whole checkpoint as `dcp.load` loads it through dcpctl.storage_reader, by fqn."""
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict
    from torch.distributed.checkpoint.format_utils import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    import dcpctl

    state: dict = {}
    _load_state_dict(state, storage_reader=dcpctl.storage_reader(url),
                     planner=_EmptyStateDictLoadPlanner(), no_dist=True)
    flat, _ = flatten_state_dict(state)
    return flat

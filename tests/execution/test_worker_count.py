"""--workers when not given: a process per core, at most one per 256 MiB of the checkpoint's
files and as many as half the available memory holds plans for; one in an object store and
under torchrun."""

from __future__ import annotations

from pathlib import Path

import pytest

from dcpctl.execution import torchrun, worker_count
from dcpctl.execution.worker_count import (AUTOMATIC_WORKER_BYTES, PLAN_BYTES_PER_METADATA_BYTE,
                                           PROCESS_BASE_BYTES, automatic_workers)
from dcpctl.storage.paths import storage_path

GIB = 1 << 30


def _sparse_checkpoint(directory: Path, data_bytes: int, metadata_bytes: int = 1000) -> Path:
    """A directory of rank files of data_bytes in all and a `.metadata`: sparse, nothing
    here reads them."""
    directory.mkdir()
    for rank in range(4):
        with open(directory / f"__{rank}_0.distcp", "wb") as stream:
            stream.truncate(data_bytes // 4)
    with open(directory / ".metadata", "wb") as stream:
        stream.truncate(metadata_bytes)
    return directory


@pytest.fixture
def eight_cores_and_memory(monkeypatch):
    """8 cores and 256 GiB available, unless a test sets less."""
    monkeypatch.setattr(worker_count, "default_thread_count", lambda: 8)
    memory = {"bytes": 256 * GIB}
    monkeypatch.setattr(worker_count, "available_memory_bytes", lambda: memory["bytes"])
    return memory


def test_a_process_per_core_for_a_large_local_checkpoint(tmp_path, eight_cores_and_memory):
    source = _sparse_checkpoint(tmp_path / "ckpt", 100 * GIB)
    assert automatic_workers(storage_path(source)) == 8


def test_no_more_workers_than_the_data_repays(tmp_path, eight_cores_and_memory):
    source = _sparse_checkpoint(tmp_path / "ckpt", GIB + GIB // 2)
    assert automatic_workers(storage_path(source)) == 3 * GIB // 2 // AUTOMATIC_WORKER_BYTES == 6
    small = _sparse_checkpoint(tmp_path / "small", 100 << 20)
    assert automatic_workers(storage_path(small)) == 1


def test_no_more_workers_than_memory_holds_plans_for(tmp_path, eight_cores_and_memory):
    """A `.metadata` of 1 GiB (millions of chunks): each worker's plan takes about 16 GiB."""
    source = _sparse_checkpoint(tmp_path / "ckpt", 100 * GIB, metadata_bytes=GIB)
    eight_cores_and_memory["bytes"] = 100 * GIB
    per_worker = PROCESS_BASE_BYTES + PLAN_BYTES_PER_METADATA_BYTE * GIB
    assert automatic_workers(storage_path(source)) == 50 * GIB // per_worker == 3
    eight_cores_and_memory["bytes"] = 8 * GIB
    assert automatic_workers(storage_path(source)) == 1


def test_one_process_in_an_object_store_under_torchrun_and_for_nothing(
        tmp_path, eight_cores_and_memory, monkeypatch):
    source = _sparse_checkpoint(tmp_path / "ckpt", 100 * GIB)
    assert automatic_workers(storage_path("s3://bucket/run/step-1")) == 1
    assert automatic_workers(storage_path(source), storage_path("s3://bucket/out")) == 1
    assert automatic_workers(storage_path(tmp_path / "missing")) == 1
    monkeypatch.setattr(torchrun, "current_team", lambda: object())
    assert automatic_workers(storage_path(source)) == 1

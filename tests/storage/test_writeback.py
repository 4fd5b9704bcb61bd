"""Write-out started while a file is written, so that its closing fsync has little left."""

from __future__ import annotations

import os
import sys

import pytest

from dcpctl.storage import writeback
from dcpctl.storage.local import OutputFile
from dcpctl.storage.placed_files import LocalPlacedFile
from dcpctl.storage.writeback import WRITEBACK_BYTES


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="sync_file_range is Linux's")
def test_libc_starts_the_write_out_of_a_real_file(tmp_path):
    start_writeout = writeback._start_writeout()
    assert start_writeout is not None
    with open(tmp_path / "file", "wb") as stream:
        stream.write(b"x" * (1 << 20))
        stream.flush()
        assert start_writeout(stream.fileno(), 0, 0, writeback._SYNC_FILE_RANGE_WRITE) == 0


@pytest.fixture
def requests(monkeypatch):
    """The write-outs asked for, by descriptor, instead of asking the kernel."""
    asked: list[int] = []

    def record(descriptor, offset, size_bytes, flags):
        assert (offset, size_bytes, flags) == (0, 0, writeback._SYNC_FILE_RANGE_WRITE)
        asked.append(descriptor)
        return 0
    monkeypatch.setattr(writeback, "_start_writeout", lambda: record)
    return asked


def test_an_output_file_asks_for_write_out_every_few_megabytes(tmp_path, requests):
    piece = os.urandom(WRITEBACK_BYTES // 3 + 1)
    output = OutputFile(tmp_path / "out")
    for _ in range(3):
        output.write(piece)
    assert requests == [output._stream.fileno()]  # 3 pieces: just over WRITEBACK_BYTES
    for _ in range(2):
        output.write(memoryview(piece))
    assert len(requests) == 1  # the count starts again after each request
    output.write(piece)
    assert len(requests) == 2
    output.finish()
    assert (tmp_path / "out").read_bytes() == piece * 6


def test_a_placed_file_counts_what_it_writes_wherever_it_goes(tmp_path, requests):
    piece = os.urandom(WRITEBACK_BYTES // 2)
    placed = LocalPlacedFile(tmp_path / "out", create=True)
    placed.write_at(len(piece), piece)
    assert requests == []
    placed.write_at(0, piece)
    assert requests == [placed._descriptor]
    placed.finish()
    assert (tmp_path / "out").read_bytes() == piece * 2


def test_without_sync_file_range_files_are_written_all_the_same(tmp_path, monkeypatch):
    monkeypatch.setattr(writeback, "_start_writeout", lambda: None)
    piece = os.urandom(WRITEBACK_BYTES + 1)
    output = OutputFile(tmp_path / "out")
    output.write(piece)
    output.finish()
    assert (tmp_path / "out").read_bytes() == piece

"""verify compares a consolidated torch HuggingFaceStorageWriter save with the ranks' files it
was made from: each rank's chunk against its part of the consolidated tensor."""

from __future__ import annotations

import numpy
import pytest

from dcpctl.ops.verify import consolidation
from dcpctl.storage.paths import open_ranged, storage_path


@pytest.mark.parametrize("piece_bytes", [1 << 20, 28], ids=["one piece", "a row a piece"])
@pytest.mark.parametrize("offsets, sizes", [((0, 0), (5, 7)), ((2, 0), (3, 7)),
                                            ((1, 2), (3, 4)), ((4, 6), (1, 1))])
def test_a_chunk_is_compared_with_its_part_of_the_whole_tensor(tmp_path, monkeypatch,
                                                               piece_bytes, offsets, sizes):
    monkeypatch.setattr(consolidation, "_PIECE_BYTES", piece_bytes)
    whole = numpy.arange(35, dtype=numpy.float32).reshape(5, 7)
    part = whole[offsets[0]:offsets[0] + sizes[0], offsets[1]:offsets[1] + sizes[1]].copy()
    (tmp_path / "whole").write_bytes(b"head" + whole.tobytes())
    (tmp_path / "part").write_bytes(b"xy" + part.tobytes())

    def first_difference():
        with open_ranged(storage_path(tmp_path / "whole")) as whole_file, \
                open_ranged(storage_path(tmp_path / "part")) as part_file:
            return consolidation._chunk_differs(whole_file, 4, part_file, 2, (5, 7), offsets,
                                                sizes, 4)

    assert first_difference() == (None, sizes[0] * (28 + sizes[1] * 4))
    part[-1, -1] = -1  # the chunk's last element
    (tmp_path / "part").write_bytes(b"xy" + part.tobytes())
    assert first_difference()[0] == [offsets[0] + sizes[0] - 1, offsets[1] + sizes[1] - 1]

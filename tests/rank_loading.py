"""Load a checkpoint with stock torch DCP on N gloo ranks into a fixture's own state layout."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

from conftest import MANIFEST
from make_fixtures import STATE_BUILDERS, describe_state, run_gloo_job


def _load_and_describe(rank: int, world_size: int, checkpoint: str, state_kind: str,
                       reader_factory, out_file: str) -> None:
    import torch.distributed.checkpoint as dcp

    state = STATE_BUILDERS[state_kind](world_size)
    reader = reader_factory(checkpoint) if reader_factory else dcp.FileSystemReader(checkpoint)
    dcp.load(state, storage_reader=reader)
    description = describe_state(state)
    if rank == 0:
        Path(out_file).write_text(json.dumps(description))


def describe_after_loading_on_ranks(checkpoint: Path, fixture_name: str, world_size: int,
                                    reader_factory=None) -> dict:
    """Tensors (dtype, shape, sha256 of the full value) and objects as world_size ranks load
    them into the state the fixture was saved from; reader_factory(path) picks the reader."""
    state_kind = MANIFEST[fixture_name]["state"]
    with tempfile.TemporaryDirectory() as work:
        out_file = Path(work) / "description.json"
        run_gloo_job(world_size, _load_and_describe, str(checkpoint), state_kind,
                     reader_factory, str(out_file))
        return json.loads(out_file.read_text())


def assert_matches_manifest(description: dict, fixture_name: str) -> None:
    """The loaded values equal what the fixture was saved with."""
    expected = MANIFEST[fixture_name]
    assert description["tensors"] == expected["tensors"]
    assert json.loads(json.dumps(description["objects"])) == expected["objects"]

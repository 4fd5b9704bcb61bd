"""dcpctl reshard on the command line: per-rank objects reported, kept, dropped or refused."""

from __future__ import annotations

import io
import json

import pytest
import torch
import torch.distributed.checkpoint as dcp
from conftest import torch_metadata

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


@pytest.fixture
def two_dataloaders(tmp_path):
    """A checkpoint holding the dataloader states of two data-parallel ranks, as torchtitan
    saves them, beside a weight."""
    state = {"w": torch.arange(12.0).reshape(6, 2),
             "dataloader": {f"dp_rank_{rank}": io.BytesIO(bytes([rank] * 8)) for rank in (0, 1)}}
    dcp.save(state, checkpoint_id=tmp_path / "ckpt", no_dist=True)
    return tmp_path / "ckpt"


def test_new_ranks_without_their_own_objects_are_named(run_cli, two_dataloaders, tmp_path):
    result = run_cli("reshard", two_dataloaders, "--ranks", "3", "-o", tmp_path / "three")
    assert result.exit_code == 0, result.output
    assert result.output.splitlines()[-1] == (
        "per-rank objects (dataloader.dp_rank_0, ...) of ranks 0, 1: kept; new ranks 2 have "
        "none of their own (a trainer that loads its own, as torchtitan's dataloader does, "
        "must skip them on resume)")
    storage = {key.fqn: info.relative_path
               for key, info in torch_metadata(tmp_path / "three").storage_data.items()}
    assert (storage["dataloader.dp_rank_0"], storage["dataloader.dp_rank_1"]) == (
        "__0_0.distcp", "__1_0.distcp")


def test_matching_ranks_say_nothing_and_refuse_takes_effect_only_on_a_mismatch(
        run_cli, two_dataloaders, tmp_path):
    result = run_cli("reshard", two_dataloaders, "--ranks", "2", "-o", tmp_path / "two",
                     "--per-rank-objects", "refuse", "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["per_rank_objects"] == {
        "fqns": ["dataloader.dp_rank_0", "dataloader.dp_rank_1"], "ranks": [0, 1],
        "choice": "refuse", "dropped": [], "ranks_without": []}
    refused = run_cli("reshard", two_dataloaders, "--ranks", "1", "-o", tmp_path / "one",
                      "--per-rank-objects", "refuse")
    assert refused.exit_code == 1 and not (tmp_path / "one").exists()
    assert refused.stderr == (
        f"Error: {two_dataloaders}: holds per-rank objects of ranks 0, 1 (dataloader.dp_rank_0, "
        "dataloader.dp_rank_1), which a 1-rank job cannot take as they are; --per-rank-objects "
        "keep writes them anyway, drop leaves them out\n")


def test_drop_leaves_them_out_of_data_and_metadata(run_cli, two_dataloaders, tmp_path):
    result = run_cli("reshard", two_dataloaders, "--ranks", "4", "-o", tmp_path / "four",
                     "--per-rank-objects", "drop")
    assert result.exit_code == 0, result.output
    assert "of ranks 0, 1: dropped; new ranks 0-3 have none" in result.output
    metadata = torch_metadata(tmp_path / "four")
    assert list(metadata.state_dict_metadata) == ["w"]
    loaded = {"w": torch.zeros(6, 2)}
    dcp.load(loaded, checkpoint_id=tmp_path / "four", no_dist=True)
    assert torch.equal(loaded["w"], torch.arange(12.0).reshape(6, 2))

"""Every command that moves data refuses a checkpoint whose metadata `verify --quick` would call
damaged, before it writes anything: nothing is planned from metadata that cannot be right."""

from __future__ import annotations

import json
import pickle
import shutil

import pytest
import torch
from conftest import directory_state, fixture_path, torch_metadata
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

SOURCE = "fsdp2_adamw_3ranks"  # model.embed.weight is 10 x 6 float32, in chunks of 4, 4, 2 rows


def _chunks(metadata):
    return metadata.state_dict_metadata["model.embed.weight"].chunks


def _leave_a_gap(metadata):
    _chunks(metadata)[1].sizes = torch.Size([3, 6])  # rows 7 and 8 are nobody's


def _overlap(metadata):
    _chunks(metadata)[1].offsets = torch.Size([3, 0])


def _claim_a_huge_tensor(metadata):
    entry = metadata.state_dict_metadata["model.embed.weight"]
    entry.size = torch.Size([2**63, 6])
    entry.chunks.append(ChunkStorageMetadata(torch.Size([10, 0]), torch.Size([2**63 - 10, 6])))


def _claim_more_than_a_compressed_item_can_decode_to(metadata):
    info = next(info for key, info in metadata.storage_data.items()
                if key.fqn == "model.embed.weight")
    info.transform_descriptors = ["stream.zstd/1"]
    metadata.state_dict_metadata["model.embed.weight"].size = torch.Size([2**40, 6])
    _chunks(metadata)[0].sizes = torch.Size([2**40 - 6, 6])


DAMAGE = {
    "a gap between chunks": (_leave_a_gap, "chunk-gap"),
    "overlapping chunks": (_overlap, "chunk-overlap"),
    "a tensor of 2**63 rows": (_claim_a_huge_tensor, "metadata"),
    "a compressed item claiming terabytes": (_claim_more_than_a_compressed_item_can_decode_to,
                                             "stored-length"),
}
COMMANDS = [["compress"], ["decompress"], ["checksum"], ["reshard", "--ranks", "2", "-o", "{out}"],
            ["convert", "--to", "safetensors", "-o", "{out}"],
            ["convert", "--to", "torch", "-o", "{out}.pt"]]


@pytest.mark.parametrize("command", COMMANDS, ids=lambda command: " ".join(command[:3]))
@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_damaged_metadata_is_refused_before_anything_is_written(run_cli, tmp_path, command,
                                                                damage):
    edit, rule = DAMAGE[damage]
    checkpoint = tmp_path / "ckpt"
    shutil.copytree(fixture_path(SOURCE), checkpoint)
    metadata = torch_metadata(checkpoint)
    edit(metadata)
    (checkpoint / ".metadata").write_bytes(pickle.dumps(metadata))
    before = directory_state(checkpoint)
    verify = run_cli("verify", checkpoint, "--quick", "--json")
    rules = {problem["rule"] for problem in json.loads(verify.output)["problems"]}
    assert verify.exit_code == 1 and rule in rules
    args = [part.format(out=tmp_path / "out") for part in command]
    result = run_cli(args[0], checkpoint, *args[1:])
    assert result.exit_code == 1, result.output
    assert result.output.startswith("Error: ") and len(result.output.splitlines()) == 1
    # the rule verify names: a metadata problem is told at `.metadata`, the others by rule
    assert any((".metadata: " if found == "metadata" else f": {found}: ") in result.output
               for found in rules), result.output
    assert directory_state(checkpoint) == before
    assert sorted(path.name for path in tmp_path.iterdir()) == ["ckpt"]

"""`dcpctl convert` as a user runs it: reports, --json, usage errors, one-line errors."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import fixture_path
from safetensors.torch import load_file

from dcpctl.cli.convert import parse_byte_size


def test_safetensors_report_says_what_was_left_out(run_cli, tmp_path):
    result = run_cli("convert", fixture_path("fsdp2_adamw_3ranks"), "--to", "safetensors", "-o",
                     tmp_path / "hf", "--dtype", "bfloat16")
    assert result.exit_code == 0, result.output
    assert "wrote 7 tensors" in result.output and "as safetensors" in result.output
    assert "cast to bfloat16" in result.output
    assert "21 tensors not selected" in result.output
    assert "12 non-tensor entries (safetensors holds tensors only)" in result.output
    assert "model.safetensors" in result.output
    loaded = load_file(tmp_path / "hf" / "model.safetensors")
    assert "embed.weight" in loaded and loaded["embed.weight"].dtype == torch.bfloat16


def test_json_report_and_the_way_back(run_cli, tmp_path):
    result = run_cli("convert", fixture_path("mesh2d_4ranks"), "--to", "safetensors", "-o",
                     tmp_path / "hf", "--json", "--max-shard-size", "100B", "--rename",
                     "^grid$=matrix")
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    assert report["target_format"] == "safetensors" and report["tensors"] == 3
    assert report["largest_tensor_bytes"] == 7 * 6 * 4
    assert [f["name"] for f in report["files"]][-1] == "model.safetensors.index.json"
    result = run_cli("convert", tmp_path / "hf", "--to", "dcp", "-o", tmp_path / "dcp",
                     "--ranks", "2", "--json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    assert report["ranks"] == 2 and report["source_format"] == "safetensors"
    assert [f["name"] for f in report["files"]] == ["__0_0.distcp", "__1_0.distcp"]


def test_torch_target(run_cli, tmp_path):
    result = run_cli("convert", fixture_path("objects_2ranks"), "--to", "torch", "-o",
                     tmp_path / "x.pt")
    assert result.exit_code == 0, result.output
    assert "5 tensors" in result.output and "5 objects" in result.output
    state = torch.load(tmp_path / "x.pt", weights_only=True)
    assert state["config"]["nested"]["depth"] == 2 and state["weights"]["mask"].dtype == torch.bool


@pytest.mark.parametrize("args,message", [
    (["--to", "dcp", "--dtype", "float16"], "--dtype does not apply to --to dcp"),
    (["--to", "torch", "--strip-prefix", ""], "--strip-prefix does not apply to --to torch"),
    (["--to", "safetensors", "--ranks", "2"], "--ranks does not apply to --to safetensors"),
    (["--to", "safetensors", "--max-shard-size", "5XB"], "not a size"),
    (["--to", "safetensors", "--rename", "no-equals"], "REGEX=REPLACEMENT"),
    (["--to", "onnx"], "Invalid value for '--to'"),
])
def test_usage_errors_exit_2(run_cli, tmp_path, args, message):
    result = run_cli("convert", fixture_path("mesh2d_4ranks"), "-o", tmp_path / "out", *args)
    assert result.exit_code == 2 and message in result.output, result.output


@pytest.mark.parametrize("args,fragment", [
    (["--to", "safetensors", "--rename", "^.*$=x"], "both renamed to 'x'"),
    (["--to", "safetensors", "--include", "nothing.*"], "nothing to convert"),
    (["--to", "dcp"], "not a torch.save zip archive"),
])
def test_failures_are_one_line_errors(run_cli, tmp_path, args, fragment):
    result = run_cli("convert", fixture_path("mesh2d_4ranks") / ".metadata" if "dcp" in args
                     else fixture_path("mesh2d_4ranks"), "-o", tmp_path / "out", *args)
    assert result.exit_code == 1, result.output
    assert result.output.startswith("Error: ") and len(result.output.splitlines()) == 1
    assert fragment in result.output
    assert not (tmp_path / "out").exists()


def test_a_dcp_checkpoint_given_to_convert_to_dcp_is_said_to_be_one(run_cli, tmp_path):
    """It was told only that the directory held no model.safetensors.index.json."""
    source = fixture_path("mesh2d_4ranks")
    result = run_cli("convert", source, "--to", "dcp", "-o", tmp_path / "out")
    assert (result.exit_code, result.output) == (1, (
        f"Error: {source}: holds neither model.safetensors.index.json nor model.safetensors; it "
        "holds .metadata: a DCP checkpoint already (to lay it out for other ranks, `dcpctl "
        "reshard`)\n"))
    assert not (tmp_path / "out").exists()


def test_an_existing_output_needs_overwrite(run_cli, tmp_path):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "file").write_text("x")
    args = [fixture_path("mesh2d_4ranks"), "--to", "safetensors", "-o", tmp_path / "out"]
    result = run_cli("convert", *args)
    assert result.exit_code == 1 and "not empty (pass --overwrite" in result.output
    assert run_cli("convert", *args, "--overwrite").exit_code == 0
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["model.safetensors"]


@pytest.mark.parametrize("text,size", [("5GB", 5 * 10**9), ("2GiB", 2 * 2**30),
                                       ("500MB", 500 * 10**6), ("1.5gb", 15 * 10**8),
                                       ("4096", 4096), ("10 KiB", 10240)])
def test_sizes(text, size):
    assert parse_byte_size(text) == size

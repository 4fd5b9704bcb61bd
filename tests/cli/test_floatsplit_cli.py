"""`dcpctl compress --codec floatsplit` and friends as a user runs them."""

from __future__ import annotations

import json

from conftest import fixture_path


def test_compress_with_floatsplit_then_back_to_zstd(run_cli, tmp_path):
    out = tmp_path / "fs"
    result = run_cli("compress", fixture_path("mesh2d_4ranks"), "-o", out, "--codec",
                     "floatsplit", "--json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    assert report["codec"] == "floatsplit" and report["items_transcoded"] == report["items"]
    inspected = run_cli("inspect", out)
    assert "floatsplit" in inspected.output
    again = json.loads(run_cli("compress", out, "--codec", "floatsplit", "--json").output)
    assert again["items_copied"] == again["items"]
    back = json.loads(run_cli("compress", out, "--codec", "zstd", "--json").output)
    assert back["items_transcoded"] == back["items"]
    assert json.loads(run_cli("inspect", out, "--json").output)["compression"] == {
        "zstd": back["items"]}


def test_unknown_codec_is_a_usage_error(run_cli, tmp_path):
    result = run_cli("compress", fixture_path("mesh2d_4ranks"), "-o", tmp_path / "x",
                     "--codec", "lzma")
    assert result.exit_code == 2
    assert "lzma" in result.output

"""Usage errors: exit 2 with click's message, before anything is read or written."""

from __future__ import annotations

import pytest
from conftest import directory_state


@pytest.mark.parametrize("args, missing", [
    (["reshard", "{ckpt}", "--ranks", "2"], "'-o' / '--output'"),
    (["convert", "{ckpt}", "--to", "safetensors"], "'-o' / '--output'"),
    (["convert", "{ckpt}", "-o", "{out}"], "'--to'"),
    (["prune", "{run}"], "'--keep-last'"),
])
def test_a_required_option_left_out_is_a_usage_error(run_cli, copy_fixture, tmp_path, args,
                                                     missing):
    """click 8.3 and later take an option's default of None as given: `reshard CKPT --ranks 2`
    without -o ran, and failed with `internal error: TypeError`."""
    checkpoint = copy_fixture("fsdp2_adamw_3ranks")
    before = directory_state(checkpoint.parent)
    result = run_cli(*(arg.format(ckpt=checkpoint, out=tmp_path / "out", run=checkpoint.parent)
                       for arg in args))
    assert result.exit_code == 2, result.output
    assert f"Missing option {missing}" in result.output
    assert directory_state(checkpoint.parent) == before


@pytest.mark.parametrize("args", [
    ["prune", "{path}", "--keep-last", "1"],
    ["compress", "{path}"],
    ["decompress", "{path}", "-o", "{out}"],
    ["ls", "{path}"],
    ["reshard", "{ckpt}", "--ranks", "2", "-o", "{path}"],
    ["convert", "{ckpt}", "--to", "torch", "-o", "{path}"],
])
@pytest.mark.parametrize("path", ["", "file://", "local://"])
def test_an_empty_path_is_refused_never_taken_for_the_working_directory(
        copy_fixture, tmp_path, args, path):
    """`dcpctl prune "$RUN_DIR" --keep-last 1` with RUN_DIR unset pruned the directory cron
    started it in (and `file://` named it too): an empty path named the working directory."""
    import shutil

    from conftest import fixture_path, run_dcpctl

    checkpoint = copy_fixture("fsdp2_adamw_3ranks")
    for step in (1, 2, 3):
        shutil.copytree(fixture_path("fsdp2_adamw_3ranks"), tmp_path / f"step-{step}")
    before = directory_state(tmp_path)
    result = run_dcpctl(*(arg.format(path=path, ckpt=checkpoint, out=tmp_path / "out")
                          for arg in args), cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    assert result.stderr == (f"Error: {path or repr('')}: names nothing: an empty path is not "
                             "taken for the working directory (give `.` for that)\n")
    assert directory_state(tmp_path) == before


@pytest.mark.parametrize("given, meant", [
    ("s3:/bucket/run", "s3://bucket/run"), ("S3:bucket/run", "s3://bucket/run"),
    ("gs:/bucket", "gs://bucket"), ("az:/container/x", "az://container/x")])
def test_a_url_short_of_a_slash_is_refused_with_the_url_meant(copy_fixture, tmp_path, given,
                                                              meant):
    """`-o s3:/bucket/run` wrote a local directory `s3:` in the working directory, and
    `ls s3:/bucket/run` said only `no such directory`."""
    from conftest import run_dcpctl

    checkpoint = copy_fixture("fsdp2_adamw_3ranks")
    before = directory_state(tmp_path)
    for args in (["compress", str(checkpoint), "-o", given], ["ls", given]):
        result = run_dcpctl(*args, cwd=tmp_path)
        assert result.returncode == 2, result.stderr
        assert result.stderr == (f"Error: {given}: is no URL (its scheme wants two slashes) and "
                                 f"no local path: give {meant}\n")
    assert directory_state(tmp_path) == before


def test_a_local_directory_named_like_a_scheme_is_still_read(copy_fixture, tmp_path):
    from conftest import run_dcpctl

    checkpoint = copy_fixture("fsdp2_adamw_3ranks")
    (tmp_path / "s3:").mkdir()
    checkpoint.rename(tmp_path / "s3:" / "step-1")
    result = run_dcpctl("inspect", "s3:/step-1", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    for output in ("data:set", "zip:x/y", "file:out", "c:/ck"):  # local names, not lost slashes
        result = run_dcpctl("compress", "s3:/step-1", "-o", output, cwd=tmp_path)
        assert result.returncode == 0, result.stderr
        assert (tmp_path / output / ".metadata").is_file()


@pytest.mark.parametrize("option", [["--storage-option", "anon=true"], ["--debug"]])
def test_an_option_of_dcpctl_itself_given_after_the_command_says_where_it_goes(
        run_cli, tmp_path, option):
    """`dcpctl ls s3://b/run --storage-option anon=true` said only `No such option`."""
    result = run_cli("ls", tmp_path, *option)
    assert result.exit_code == 2
    assert result.output.endswith(f"Error: {option[0]} goes before the command, as in "
                                  f"`dcpctl {option[0]} ... ls ...`\n")


@pytest.mark.parametrize("args", [
    ["inspect", "{missing}", "--json"],
    ["verify", "{missing}", "--json"],
    ["ls", "{missing}", "--json"],
    ["compress", "{missing}", "-o", "{out}", "--json"],
    ["convert", "{missing}", "--to", "safetensors", "-o", "{out}", "--json"],
])
def test_a_failure_under_json_prints_one_json_document_naming_it(tmp_path, args):
    """`dcpctl inspect CKPT --json | jq ...` got nothing on stdout when the command failed:
    the script saw empty input, not the failure."""
    import json

    from conftest import run_dcpctl

    result = run_dcpctl(*(arg.format(missing=tmp_path / "gone", out=tmp_path / "out")
                          for arg in args))
    assert result.returncode == 1
    assert result.stderr.startswith(f"Error: {tmp_path / 'gone'}: no such ")
    message = result.stderr.removeprefix("Error: ").removesuffix("\n")
    assert json.loads(result.stdout) == {"error": message, "exit_code": 1}

"""`dcpctl inspect` as a user runs it: output, exit codes, one-line errors."""

from __future__ import annotations

import json
import pickle
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
from conftest import FIXTURE_NAMES, fixture_path, torch_metadata

from dcpctl.cli.inspection import render_tensors
from dcpctl.cli.render import format_bytes, format_table
from dcpctl.ops.inspection.report import inspect_checkpoint
from dcpctl.wording import counted


@pytest.mark.parametrize("name", FIXTURE_NAMES)
def test_table_names_every_tensor(run_cli, name):
    result = run_cli("inspect", fixture_path(name))
    assert result.exit_code == 0, result.output
    report = json.loads(run_cli("inspect", fixture_path(name), "--json").output)
    for tensor in report["tensors"]:
        assert tensor["fqn"] in result.output
    assert f"tensors      {len(report['tensors'])}" in result.output


def test_by_file_lists_each_file(run_cli):
    result = run_cli("inspect", fixture_path("zstd_fsdp2_2ranks"), "--by-file")
    assert result.exit_code == 0
    for name in ("__0_0.distcp", "__0_1.distcp", "__1_0.distcp", "__1_1.distcp"):
        assert name in result.output
    assert "zstd" in result.output


def test_by_file_with_a_filter_counts_the_matching_items(run_cli):
    """The file rows counted every item of each file, whatever --filter took."""
    source = fixture_path("zstd_fsdp2_2ranks")
    every = json.loads(run_cli("inspect", source, "--json").stdout)
    matching = json.loads(run_cli("inspect", source, "--json", "--filter", "model.*").stdout)
    counted = {}
    for tensor in matching["tensors"]:
        for chunk in tensor["chunks"]:
            counted[chunk["file"]] = counted.get(chunk["file"], 0) + 1
    assert {f["name"]: f["items"] for f in matching["files"]} == counted
    assert {f["name"]: f["codecs"] for f in matching["files"]} == {
        name: {"zstd": count} for name, count in counted.items()}
    assert sum(counted.values()) < sum(f["items"] for f in every["files"])
    sizes = {f["name"]: f["bytes"] for f in every["files"]}
    assert all(f["bytes"] == sizes[f["name"]] for f in matching["files"])
    lines = run_cli("inspect", source, "--by-file", "--filter", "model.*").stdout.splitlines()
    rows = lines[lines.index(next(line for line in lines if line.startswith("FILE"))) + 1:]
    assert {row.split()[0]: int(row.split()[-3]) for row in rows} == counted
    none = json.loads(run_cli("inspect", source, "--json", "--filter", "nothing").stdout)
    assert none["files"] == []


def test_filter_in_json(run_cli):
    result = run_cli("inspect", fixture_path("mesh2d_4ranks"), "--json", "--filter", "g*")
    assert [t["fqn"] for t in json.loads(result.output)["tensors"]] == ["grid"]


def _assert_one_line_error(result, *fragments):
    assert result.exit_code == 1
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: "), result.output
    assert "Traceback" not in result.output
    for fragment in fragments:
        assert fragment in lines[0]


def test_bad_inputs_are_one_line_errors(run_cli, tmp_path, copy_fixture):
    _assert_one_line_error(run_cli("inspect", tmp_path / "absent"), "absent", "no such file")
    (tmp_path / "empty").mkdir()
    _assert_one_line_error(run_cli("inspect", tmp_path / "empty"), "empty", ".metadata")
    hostile = copy_fixture("mesh2d_4ranks")
    (hostile / ".metadata").write_bytes(pickle.dumps(print))
    _assert_one_line_error(run_cli("inspect", hostile), ".metadata", "builtins.print")


def test_a_checkpoint_with_a_data_file_cut_short_or_missing_is_shown_with_its_problems(
        run_cli, copy_fixture):
    """What the metadata says is what a user whose load failed wants to see: inspect shows it
    and lists the data files missing or cut short below it, exit 1 (it refused the whole
    checkpoint with an error naming the first)."""
    checkpoint = copy_fixture("objects_2ranks")
    whole = json.loads(run_cli("inspect", checkpoint, "--json").output)
    assert whole["problems"] == []
    (checkpoint / "__1_2.distcp").write_bytes(b"")
    (checkpoint / "__0_0.distcp").unlink()
    result = run_cli("inspect", checkpoint)
    assert result.exit_code == 1, result.output
    assert "damaged      2 problems of its data files, listed below" in result.output
    assert "missing-file  __0_0.distcp" in result.output
    assert "truncated  __1_2.distcp  bytes 0.." in result.output
    for tensor in whole["tensors"]:
        assert tensor["fqn"] in result.output
    json_result = run_cli("inspect", checkpoint, "--json")
    assert json_result.exit_code == 1
    report = json.loads(json_result.output)
    assert [(problem["rule"], problem["file"]) for problem in report["problems"]] == [
        ("missing-file", "__0_0.distcp"), ("truncated", "__1_2.distcp")]
    sizes = ("problems", "files", "file_bytes")  # those of the files as they are now
    assert {key: value for key, value in report.items() if key not in sizes} == {
        key: value for key, value in whole.items() if key not in sizes}


def test_debug_shows_the_traceback(run_cli, tmp_path):
    result = run_cli("--debug", "inspect", str(tmp_path / "absent"))
    assert result.exit_code != 0
    assert result.exception is not None and "no such file" in str(result.exception)


def test_usage_error_exits_2(run_cli):
    result = run_cli("inspect")
    assert result.exit_code == 2
    assert run_cli("no-such-command").exit_code == 2


def test_python_dash_m_and_console_script(run_cli):
    # the console script pip installed beside this interpreter, whether or not it is on PATH
    console_script = str(Path(sysconfig.get_path("scripts")) / "dcpctl")
    for command in ([sys.executable, "-m", "dcpctl"], [console_script]):
        result = subprocess.run([*command, "inspect", str(fixture_path("mesh2d_4ranks")), "--json"],
                                capture_output=True, text=True)
        assert result.returncode == 0, result.stderr
        assert json.loads(result.stdout)["tensor_count"] == 3
        table = subprocess.run([*command, "inspect", str(fixture_path("mesh2d_4ranks"))],
                               capture_output=True, text=True)
        assert table.returncode == 0 and not table.stderr
        assert table.stdout.endswith("\n") and "tensors      3\n" in table.stdout
        assert table.stdout == run_cli("inspect", fixture_path("mesh2d_4ranks")).output
        error = subprocess.run([*command, "inspect", "/nonexistent/ckpt"], capture_output=True,
                               text=True)
        assert error.returncode == 1
        assert error.stderr.startswith("Error: /nonexistent/ckpt") and not error.stdout


def test_inspect_imports_none_of_the_heavy_modules():
    code = ("import sys; from dcpctl.cli.main import cli; "
            f"cli(['inspect', {str(fixture_path('zstd_fsdp2_2ranks'))!r}], standalone_mode=False); "
            "print([name for name in ('torch', 'numpy', 'zstandard', 'tqdm') "
            "if name in sys.modules], file=sys.stderr)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            check=True)
    assert result.stderr.strip() == "[]"


def _table_cell_by_cell(headers, rows, right_aligned):
    cells = [[str(cell) for cell in row] for row in [headers, *rows]]
    widths = [max(len(row[column]) for row in cells) for column in range(len(headers))]
    return ["  ".join(cell.rjust(width) if column in right_aligned else cell.ljust(width)
                      for column, (cell, width) in enumerate(zip(row, widths))).rstrip()
            for row in cells]


@pytest.mark.parametrize("name", FIXTURE_NAMES)
def test_tensor_table_matches_padding_cell_by_cell(name):
    report = inspect_checkpoint(fixture_path(name))
    rows = [(t.fqn, t.dtype.name, "x".join(map(str, t.shape)) or "scalar", len(t.chunks),
             format_bytes(t.nbytes), format_bytes(t.stored_bytes)) for t in report.tensors]
    rows += [(o.fqn, "object", "-", 1, "-", format_bytes(o.storage.length if o.storage else 0))
             for o in report.objects]
    headers = ("FQN", "DTYPE", "SHAPE", "CHUNKS", "LOGICAL", "STORED")
    assert render_tensors(report) == _table_cell_by_cell(headers, rows, (3, 4, 5))


@pytest.mark.parametrize("rows", [[], [("a", 1, ""), ("long name", 22, "x y")]])
def test_format_table_pads_like_cell_by_cell(rows):
    headers = ("NAME", "N", "NOTE")
    assert format_table(headers, rows, right_aligned=(1,)) == _table_cell_by_cell(
        headers, rows, (1,))


def test_format_table_escapes_the_cells_that_hold_control_characters_and_pads_them_so():
    rows = [("plain", 1), ("bell\x07", 22), ("esc\x1b[31m", 3)]
    escaped = [("plain", 1), ("bell\\x07", 22), ("esc\\x1b[31m", 3)]
    assert format_table(("NAME", "N"), rows, right_aligned=(1,)) == _table_cell_by_cell(
        ("NAME", "N"), escaped, (1,))


def _with_grid_renamed(checkpoint, fqn: str):
    """The checkpoint, its tensor `grid` renamed fqn in its `.metadata`."""
    metadata = torch_metadata(checkpoint)
    metadata.state_dict_metadata[fqn] = metadata.state_dict_metadata.pop("grid")
    for key in [key for key in metadata.storage_data if key.fqn == "grid"]:
        info = metadata.storage_data.pop(key)
        metadata.storage_data[type(key)(fqn, key.offset, key.index)] = info
    (checkpoint / ".metadata").write_bytes(pickle.dumps(metadata))
    return checkpoint


def test_names_from_a_checkpoint_cannot_drive_the_terminal(run_cli, copy_fixture):
    """A hostile checkpoint names a tensor and a data file with escape sequences; what dcpctl
    prints for people shows them escaped, and JSON keeps the name exact."""
    hostile = "grid\x1b[2J\x1b[31m\r\x07"
    checkpoint = _with_grid_renamed(copy_fixture("mesh2d_4ranks"), hostile)
    for args in (["inspect", checkpoint], ["inspect", checkpoint, "--by-file"],
                 ["verify", checkpoint], ["inspect", checkpoint / "\x1b[31mmissing"]):
        result = run_cli(*args)
        assert not any(character in result.output for character in "\x1b\r\x07"), args
    assert "grid\\x1b[2J\\x1b[31m\\x0d\\x07" in run_cli("inspect", checkpoint).output
    document = json.loads(run_cli("inspect", checkpoint, "--json").output)
    assert hostile in {tensor["fqn"] for tensor in document["tensors"]}


def test_a_newline_in_a_name_cannot_forge_a_line_of_a_report(run_cli, copy_fixture):
    """Reports keep their own newlines: a name's, in verify's list of fqns affected, began a
    line of its own (`status      ok` after the real `damaged`)."""
    checkpoint = _with_grid_renamed(copy_fixture("mesh2d_4ranks"), "grid\n\nstatus      ok")
    for data_file in checkpoint.glob("*.distcp"):
        data_file.write_bytes(data_file.read_bytes()[:100])
    result = run_cli("verify", checkpoint)
    assert result.exit_code == 1
    assert [line for line in result.output.splitlines() if line.startswith("status")] == [
        line for line in result.output.splitlines() if line.startswith("status      damaged")]
    assert "grid\\x0a\\x0astatus      ok" in result.output


def test_a_lone_surrogate_a_line_separator_or_a_bidi_control_in_a_name_is_escaped(
        copy_fixture):
    """A pickled name can hold a lone surrogate, which UTF-8 cannot write: inspect and verify
    failed with an internal UnicodeEncodeError. U+2028 passed as it was (Python's splitlines()
    breaks there), and so did U+202E, which makes a terminal show what follows backwards."""
    from conftest import run_dcpctl

    checkpoint = _with_grid_renamed(copy_fixture("mesh2d_4ranks"),
                                    "grid\ud800\u2028FORGED \u202egnp.exe")
    for args in (["inspect", checkpoint], ["inspect", checkpoint, "--by-file"],
                 ["verify", checkpoint]):
        result = run_dcpctl(*args)
        assert result.returncode == 0, result.stderr
        assert not any(character in result.stdout for character in "\u2028\u202e")
    assert "grid\\ud800\\u2028FORGED \\u202egnp.exe" in run_dcpctl("inspect", checkpoint).stdout
    result = run_dcpctl("inspect", checkpoint / "missing\u2028\udcff")  # \udcff: byte 0xff
    assert result.returncode == 1 and "missing\\u2028\\xff" in result.stderr


def test_a_newline_in_a_name_or_path_cannot_forge_a_line_of_any_report(
        run_cli, copy_fixture, tmp_path):
    """Every report for people escapes a line break in what it names: the summary's `by key`
    line of inspect, the checkpoint's path in verify, compress, checksum and convert, a symlink's
    name in ls; each printed it as it was, and the text after it passed for a line of dcpctl's
    own."""
    forged = "\nFORGED ok"
    checkpoint = tmp_path / f"run{forged}" / "step-1"
    checkpoint.parent.mkdir()
    copy_fixture("mesh2d_4ranks").rename(checkpoint)
    _with_grid_renamed(checkpoint, f"grid{forged}")
    (checkpoint.parent / f"latest{forged}").symlink_to("step-1")
    runs = [("inspect", checkpoint), ("verify", checkpoint), ("ls", checkpoint.parent),
            ("compress", checkpoint, "-o", tmp_path / f"zstd{forged}"),
            ("checksum", checkpoint),
            ("convert", checkpoint, "--to", "torch", "-o", tmp_path / f"model{forged}.pt")]
    for args in runs:
        result = run_cli(*args)
        assert result.exit_code == 0, (args, result.output)
        assert "\\x0aFORGED ok" in result.output, (args, result.output)
        assert not [line for line in result.output.splitlines() if "FORGED" in line
                    and "\\x0aFORGED" not in line], (args, result.output)


@pytest.mark.parametrize("args", [["inspect", "--json"], ["inspect"], ["verify", "--json"]],
                         ids=["inspect --json", "inspect", "verify --json"])
def test_output_into_a_pipe_whose_reader_left_ends_quietly(args):
    """`dcpctl inspect CKPT --json | head -c 10` printed `Error: Broken pipe`, as if dcpctl had
    failed: a reader that stops early is no error of the command's (`cat` says nothing)."""
    import os

    read_end, write_end = os.pipe()
    os.close(read_end)  # the reader is gone before dcpctl writes
    try:
        result = subprocess.run([sys.executable, "-m", "dcpctl", args[0],
                                 fixture_path("fsdp2_adamw_3ranks"), *args[1:]],
                                stdout=write_end, stderr=subprocess.PIPE, text=True)
    finally:
        os.close(write_end)
    assert result.stderr == "" and result.returncode != 0


def test_counts_read_as_english():
    """`wrote SHA256SUMS: 1 files`, `over 1 ranks (1 files)`."""
    assert [counted(count, "file") for count in (0, 1, 2)] == ["0 files", "1 file", "2 files"]
    assert counted(1, "entry", "entries") == "1 entry"
    assert counted(3, "entry", "entries") == "3 entries"


def test_a_report_of_one_file_or_item_reads_as_english(run_cli, tmp_path):
    """`checks structure, checksums (1 files in SHA256SUMS)`, `wrote 1 tensors`."""
    import torch
    from safetensors.torch import save_file

    save_file({"w": torch.ones(2)}, tmp_path / "model.safetensors")
    result = run_cli("convert", tmp_path / "model.safetensors", "--to", "dcp",
                     "-o", tmp_path / "dcp")
    assert result.exit_code == 0, result.output
    assert "wrote 1 tensor " in result.output
    assert run_cli("checksum", tmp_path / "dcp").exit_code == 0
    result = run_cli("verify", tmp_path / "dcp")
    assert "checksums (2 files in SHA256SUMS), deep (1 item)" in result.output, result.output
    result = run_cli("compress", tmp_path / "dcp", "--dry-run")
    assert "would rewrite 1 item in place" in result.output, result.output


@pytest.mark.parametrize("debug", [False, True])
def test_what_libraries_log_is_shown_only_with_debug(debug):
    """gcsfs logs each request it gives up on: with no handler configured, Python printed
    each record, traceback and all, on stderr above dcpctl's one line (51 lines for one
    failed request, over a thousand for a verify against a store that stopped answering)."""
    code = (
        "import logging, sys\n"
        "import dcpctl.cli.inspection as inspection\n"
        "from dcpctl.cli.main import main\n"
        "real = inspection.inspect_checkpoint\n"
        "def noisy(*args, **kwargs):\n"
        "    logging.getLogger('gcsfs').error('_request out of retries on exception')\n"
        "    return real(*args, **kwargs)\n"
        "inspection.inspect_checkpoint = noisy\n"
        "sys.argv[0] = 'dcpctl'\n"
        "main()\n")
    result = subprocess.run([sys.executable, "-c", code, *(["--debug"] if debug else []),
                             "inspect", str(fixture_path("mesh2d_4ranks"))],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert ("out of retries" in result.stderr) is debug


@pytest.mark.parametrize("debug", [False, True])
def test_a_worker_of_a_debug_command_shows_what_libraries_log(debug):
    """--workers processes start afresh: they dropped the libraries' records whatever the
    command was given."""
    import os

    code = ("import logging\n"
            "from dcpctl.library_logs import quiet_library_logs\n"
            "quiet_library_logs()  # what a worker does first\n"
            "logging.getLogger('gcsfs').error('_request out of retries on exception')\n")
    from dcpctl import library_logs

    environment = {name: value for name, value in os.environ.items()
                   if name != library_logs._SHOWN}
    if debug:  # as show_library_logs(in_workers=True) leaves it for the workers
        environment[library_logs._SHOWN] = "1"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            env=environment)
    assert ("out of retries" in result.stderr) is debug

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

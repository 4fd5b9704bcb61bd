"""Every command that writes, killed at every failpoint it passes (its first, a middle and its
last pass of each), leaves what it read untouched and nothing at its output that looks whole;
run again, it finishes and its output is right.

Each command is first run once with DCPCTL_FAILPOINT_TRACE to learn where it passes and how
often; each kill is then checked to have happened (the process died of SIGKILL).
"""

from __future__ import annotations

import shutil
import signal
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import pytest
import torch
from conftest import (MANIFEST, directory_state, failpoint_moments, failpoint_passes, fixture_path,
                      load_with_torch, run_dcpctl, tree_listing)
from make_fixtures import tensor_sha256
from safetensors.torch import load_file

from dcpctl.failpoints import Failpoint
from dcpctl.format.checkpoint.checksums import read_sha256sums
from dcpctl.storage.file_digests import sha256_of_file
from dcpctl.ops.checksum import checksum_checkpoint
from dcpctl.ops.transcode import compress_checkpoint
from dcpctl.storage.local import is_temporary_name

pytestmark = pytest.mark.slow
SOURCE = "fsdp2_adamw_3ranks"


def expected_tensors(name: str = SOURCE) -> dict[str, str]:
    return {fqn: entry["sha256"] for fqn, entry in MANIFEST[name]["tensors"].items()}


def loaded_tensors(checkpoint: Path) -> dict[str, str]:
    return {fqn: tensor_sha256(value) for fqn, value in load_with_torch(checkpoint).items()
            if isinstance(value, torch.Tensor)}


def assert_checksums_hold(directory: Path) -> None:
    for name, digest in (read_sha256sums(directory) or {}).items():
        assert sha256_of_file(directory / name) == digest, name


@dataclass
class Scenario:
    """A command, what it needs before it runs, and what must hold after a kill and after the
    run that follows it."""

    name: str
    args: Callable[[Path], list]
    prepare: Callable[[Path], None]
    after_kill: Callable[[Path, dict], None]
    after_rerun: Callable[[Path], None]


def copy_source(work: Path) -> None:
    shutil.copytree(fixture_path(SOURCE), work / "ckpt")


def source_untouched_and_no_output(output_name: str) -> Callable[[Path, dict], None]:
    def check(work: Path, before: dict) -> None:
        assert directory_state(work / "ckpt") == before["ckpt"]
        assert not (work / output_name).exists()
        # what a killed run leaves is hidden: nothing under a name a user would take as whole
        assert all(name.startswith(".") for name in tree_listing(work)
                   if "/" not in name and name not in (".", "ckpt", "model.safetensors"))
    return check


def copy_source_with_sums(work: Path) -> None:
    copy_source(work)
    checksum_checkpoint(work / "ckpt")


def copy_source_compressed(work: Path) -> None:
    """The source in zstd, with its SHA256SUMS: what an in-place decompress rewrites (a plain
    one with SHA256SUMS it leaves as it is)."""
    copy_source(work)
    compress_checkpoint(work / "ckpt")


def in_place_checkpoint_loads(work: Path, before: dict) -> None:
    """Loads and its SHA256SUMS holds, and verify calls it sound (once `.metadata` named the
    new files, the old ones beside them were unknown files: damage); until `.metadata`
    switched, the source is as it was (SHA256SUMS included), but for hidden temporaries a
    killed run leaves."""
    from dcpctl.ops.verify.verifier import verify_checkpoint

    assert loaded_tensors(work / "ckpt") == expected_tensors()
    assert_checksums_hold(work / "ckpt")
    report = verify_checkpoint(work / "ckpt", deep=False)
    assert report.status == "ok", report.problems
    state = {name: digest for name, digest in directory_state(work / "ckpt").items()
             if not is_temporary_name(name)}
    if state[".metadata"] == before["ckpt"][".metadata"]:
        assert state == before["ckpt"]


def checkpoint_loads(directory: str) -> Callable[[Path], None]:
    def check(work: Path) -> None:
        assert loaded_tensors(work / directory) == expected_tensors()
        assert_checksums_hold(work / directory)
    return check


def in_place_rewrite_is_clean(work: Path) -> None:
    checkpoint_loads("ckpt")(work)
    assert not [path.name for path in (work / "ckpt").iterdir() if ".dcpctl-" in path.name]


def safetensors_hold_the_model(work: Path) -> None:
    tensors = {}
    for path in (work / "hf").glob("*.safetensors"):
        tensors.update(load_file(path))
    model = {fqn: digest for fqn, digest in expected_tensors().items()
             if fqn.startswith("model.")}
    assert {f"model.{name}": tensor_sha256(value) for name, value in tensors.items()} == model


def torch_file_holds_the_state(work: Path) -> None:
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict

    flat, _ = flatten_state_dict(torch.load(work / "model.pt", weights_only=True))
    assert {fqn: tensor_sha256(value) for fqn, value in flat.items()
            if isinstance(value, torch.Tensor)} == expected_tensors()


def copy_source_and_model(work: Path) -> None:
    copy_source(work)
    tensors = {fqn: value.contiguous() for fqn, value in load_with_torch(work / "ckpt").items()
               if isinstance(value, torch.Tensor)}
    from safetensors.torch import save_file
    save_file(tensors, work / "model.safetensors")


def checksum_left_alone_or_whole(work: Path, before: dict) -> None:
    state = {name: digest for name, digest in directory_state(work / "ckpt").items()
             if name != "SHA256SUMS" and not is_temporary_name(name)}
    assert state == before["ckpt"]
    assert_checksums_hold(work / "ckpt")


def checksummed_and_clean(work: Path) -> None:
    assert_checksums_hold(work / "ckpt")
    assert not [name for name in directory_state(work / "ckpt") if is_temporary_name(name)]


def copy_run(work: Path) -> None:
    for step in (100, 200):
        shutil.copytree(fixture_path(SOURCE), work / "run" / f"step-{step}")
    copy_source(work)


def run_keeps_whole_checkpoints(work: Path, before: dict) -> None:
    """Each checkpoint still there loads whole, or has lost its `.metadata` (incomplete)."""
    for checkpoint in (work / "run").iterdir():
        if (checkpoint / ".metadata").exists():
            assert loaded_tensors(checkpoint) == expected_tensors()


def run_keeps_the_last(work: Path) -> None:
    """The last checkpoint loads; one a killed run had begun to delete is incomplete (kept
    until --incomplete-older-than says), or gone."""
    assert loaded_tensors(work / "run" / "step-200") == expected_tensors()
    assert [path.name for path in (work / "run").iterdir()
            if (path / ".metadata").exists()] == ["step-200"]


SCENARIOS = [
    Scenario("compress in place", lambda work: ["compress", work / "ckpt"],
             copy_source_with_sums, in_place_checkpoint_loads, in_place_rewrite_is_clean),
    Scenario("decompress in place", lambda work: ["decompress", work / "ckpt"],
             copy_source_compressed, in_place_checkpoint_loads, in_place_rewrite_is_clean),
    Scenario("compress -o", lambda work: ["compress", work / "ckpt", "-o", work / "out"],
             copy_source, source_untouched_and_no_output("out"), checkpoint_loads("out")),
    Scenario("reshard", lambda work: ["reshard", work / "ckpt", "--ranks", "2", "-o",
                                      work / "out"],
             copy_source, source_untouched_and_no_output("out"), checkpoint_loads("out")),
    Scenario("convert to safetensors", lambda work: [
        "convert", work / "ckpt", "--to", "safetensors", "-o", work / "hf",
        "--max-shard-size", "200"],
             copy_source, source_untouched_and_no_output("hf"), safetensors_hold_the_model),
    Scenario("convert to torch", lambda work: ["convert", work / "ckpt", "--to", "torch", "-o",
                                               work / "model.pt"],
             copy_source, source_untouched_and_no_output("model.pt"),
             torch_file_holds_the_state),
    Scenario("convert to dcp", lambda work: [
        "convert", work / "model.safetensors", "--to", "dcp", "-o", work / "out", "--ranks", "2"],
             copy_source_and_model, source_untouched_and_no_output("out"),
             checkpoint_loads("out")),
    Scenario("checksum", lambda work: ["checksum", work / "ckpt"], copy_source,
             checksum_left_alone_or_whole, checksummed_and_clean),
    Scenario("prune", lambda work: ["prune", work / "run", "--keep-last", "1"],
             copy_run, run_keeps_whole_checkpoints, run_keeps_the_last),
]


def passes_of(work: Path, scenario: Scenario) -> dict[str, int]:
    """How often the command passes each failpoint, from one traced run."""
    return failpoint_passes(scenario.args(work), work.parent / f"{work.name}.trace")


@pytest.mark.parametrize("scenario", SCENARIOS, ids=lambda scenario: scenario.name)
def test_killed_at_every_failpoint_nothing_is_lost(scenario, tmp_path):
    probe = tmp_path / "probe"
    probe.mkdir()
    scenario.prepare(probe)
    for moment in failpoint_moments(passes_of(probe, scenario)):
        work = tmp_path / moment.replace("@", "-")
        work.mkdir()
        scenario.prepare(work)
        before = {"ckpt": directory_state(work / "ckpt")}
        killed = run_dcpctl(*scenario.args(work), failpoint=moment)
        assert killed.returncode == -signal.SIGKILL, (moment, killed.stderr)
        scenario.after_kill(work, before)
        rerun = run_dcpctl(*scenario.args(work))
        assert rerun.returncode == 0, (moment, rerun.stderr)
        scenario.after_rerun(work)


def no_leftovers(work: Path) -> None:
    """Nothing dcpctl writes on the way is left: no temporary file or staged directory."""
    assert not [name for name in tree_listing(work) if ".dcpctl-" in name]


_STOPPED = "Error: stopped by SIGTERM\n"
_STOPPED_ONCE_REWRITTEN = ("Error: stopped by SIGTERM, after finishing what a stop waits for: "
                           "the checkpoint is rewritten whole\n")


@pytest.mark.parametrize("scenario", SCENARIOS, ids=lambda scenario: scenario.name)
def test_stopped_by_sigterm_it_cleans_up_after_itself(scenario, tmp_path):
    """SIGTERM (kill, timeout, a scheduler's preemption) at each failpoint's middle pass: the
    run ends with 143 and, unlike after SIGKILL, leaves nothing behind but a whole result or
    none. Once an in-place rewrite has switched `.metadata` to its new files, the stop waits
    for the rewrite's end (stopping.finishing_first) and says so: the checkpoint is then
    rewritten whole."""
    probe = tmp_path / "probe"
    probe.mkdir()
    scenario.prepare(probe)
    passes = passes_of(probe, scenario)
    said_rewritten = set()
    for name, count in passes.items():
        moment = f"{name}@{(count + 1) // 2}"
        work = tmp_path / moment.replace("@", "-")
        work.mkdir()
        scenario.prepare(work)
        before = {"ckpt": directory_state(work / "ckpt")}
        stopped = run_dcpctl(*scenario.args(work), failpoint=f"{moment}:SIGTERM")
        assert stopped.returncode == 128 + signal.SIGTERM, (moment, stopped.stderr)
        assert stopped.stderr in (_STOPPED, _STOPPED_ONCE_REWRITTEN), (moment, stopped.stderr)
        if stopped.stderr == _STOPPED_ONCE_REWRITTEN:
            said_rewritten.add(name)
            scenario.after_rerun(work)  # as it says
        no_leftovers(work)
        scenario.after_kill(work, before)
    assert (Failpoint.AFTER_FINAL_NAME.value in said_rewritten) == (
        Failpoint.AFTER_FINAL_NAME.value in passes)


def test_every_failpoint_is_passed_by_some_command(tmp_path):
    passed = set()
    for index, scenario in enumerate(SCENARIOS):
        work = tmp_path / str(index)
        work.mkdir()
        scenario.prepare(work)
        passed.update(passes_of(work, scenario))
    assert passed == {point.value for point in Failpoint}


def test_an_unknown_failpoint_is_refused(tmp_path):
    """A misspelt failpoint would never kill, and its test would pass without testing."""
    copy_source(tmp_path)
    before = directory_state(tmp_path / "ckpt")
    result = run_dcpctl("compress", tmp_path / "ckpt", failpoint="after-data-writes")
    assert result.returncode != 0 and "DCPCTL_FAILPOINT='after-data-writes'" in result.stderr
    assert directory_state(tmp_path / "ckpt") == before

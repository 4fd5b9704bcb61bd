"""`--workers N` and torchrun: every command that moves data gives the same bytes whatever the
number of workers or ranks, and a worker that fails or is killed fails the command, naming it,
with nothing published and the source untouched."""

from __future__ import annotations

import json
import os
import pickle
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import (MANIFEST, REPO_ROOT, damage_one_item, directory_state, fixture_path,
                      load_with_torch, run_dcpctl)
from make_fixtures import tensor_sha256

from dcpctl.errors import InvalidOptionError
from dcpctl.format.checkpoint.view import open_checkpoint
from dcpctl.stopping import Terminated

SOURCE = "fsdp2_adamw_3ranks"


def ok(*args, **kwargs) -> str:
    result = run_dcpctl(*args, **kwargs)
    assert result.returncode == 0, (args, result.stderr)
    return result.stdout


def tree(path: Path) -> dict[str, bytes]:
    if path.is_file():
        return {"": path.read_bytes()}
    return {str(file.relative_to(path)): file.read_bytes()
            for file in sorted(path.rglob("*")) if file.is_file()}


def loaded_tensors(checkpoint: Path) -> dict[str, str]:
    return {fqn: tensor_sha256(value) for fqn, value in load_with_torch(checkpoint).items()
            if isinstance(value, torch.Tensor)}


def expected_tensors() -> dict[str, str]:
    return {fqn: entry["sha256"] for fqn, entry in MANIFEST[SOURCE]["tensors"].items()}


WRITING_COMMANDS = {
    "compress": ["compress", "{source}", "-o", "{output}"],
    "floatsplit": ["compress", "{source}", "-o", "{output}", "--codec", "floatsplit"],
    "reshard": ["reshard", "{source}", "--ranks", "5", "-o", "{output}"],
    # several shards, and tensors shared out inside each
    "safetensors": ["convert", "{source}", "--to", "safetensors", "-o", "{output}", "--include",
                    "*", "--max-shard-size", "3KB"],
    "torch": ["convert", "{source}", "--to", "torch", "-o", "{output}"],
}
DCP_OUTPUTS = {"compress", "reshard"}


@pytest.mark.parametrize("command", sorted(WRITING_COMMANDS))
def test_outputs_are_the_same_bytes_whatever_the_number_of_workers(command, tmp_path):
    outputs = {}
    for workers in (1, 2, 3):
        output = tmp_path / f"out-{workers}"
        args = [part.format(source=fixture_path(SOURCE), output=output)
                for part in WRITING_COMMANDS[command]]
        ok(*args, "--workers", workers)
        outputs[workers] = tree(output)
    assert outputs[1] == outputs[2] == outputs[3]
    if command in DCP_OUTPUTS:
        assert loaded_tensors(tmp_path / "out-3") == expected_tensors()


def test_convert_to_dcp_writes_the_same_rank_files_whatever_the_number_of_workers(tmp_path):
    ok("convert", fixture_path(SOURCE), "--to", "safetensors", "-o", tmp_path / "hf",
       "--include", "*", "--strip-prefix", "", "--max-shard-size", "3KB")
    outputs = {}
    for workers in (1, 2, 3):
        output = tmp_path / f"dcp-{workers}"
        ok("convert", tmp_path / "hf", "--to", "dcp", "--ranks", 4, "-o", output,
           "--workers", workers)
        metadata = open_checkpoint(output).metadata
        # .metadata names its own directory and a random save id: compare what it records
        outputs[workers] = ({name: data for name, data in tree(output).items()
                             if name.endswith(".distcp")},
                            metadata.storage_data, metadata.state_dict_metadata)
    assert outputs[1] == outputs[2] == outputs[3]
    assert len(outputs[3][0]) == 4
    assert loaded_tensors(tmp_path / "dcp-3") == expected_tensors()


def test_converting_into_a_bucket_takes_one_process(tmp_path):
    result = run_dcpctl("convert", fixture_path(SOURCE), "--to", "torch", "-o",
                        "memory://bucket/model.pt", "--workers", 2)
    assert result.returncode == 2  # the options given cannot work together
    assert "an object store cannot take" in result.stderr and "--workers 1" in result.stderr


def test_in_place_compress_and_decompress_with_workers(tmp_path):
    single, several = tmp_path / "single", tmp_path / "several"
    shutil.copytree(fixture_path(SOURCE), single)
    shutil.copytree(fixture_path(SOURCE), several)
    ok("compress", single)
    ok("compress", several, "--workers", 2)
    # in place, new files carry a random token in their names until renamed: compare contents
    assert directory_state(single) == directory_state(several)
    ok("decompress", several, "--workers", 3)
    assert loaded_tensors(several) == expected_tensors()
    assert json.loads(ok("verify", several, "--json"))["status"] == "ok"


@pytest.mark.parametrize("command", sorted(WRITING_COMMANDS))
def test_sha256sums_are_checked_on_the_threads_of_every_worker(copy_fixture, tmp_path, command,
                                                               run_cli, monkeypatch):
    """The workers wait while the coordinator hashes a checksummed input before the job: it
    hashes on all of their threads, not on its own share of them."""
    from dcpctl.format.checkpoint import checksums

    source = copy_fixture(SOURCE)
    ok("checksum", source)
    hashed_on = []

    def recording(directory, names, threads, *args):
        hashed_on.append(threads)
        return real_hashing(directory, names, threads, *args)
    real_hashing = checksums.sha256_of_files
    monkeypatch.setattr(checksums, "sha256_of_files", recording)
    arguments = [part.format(source=source, output=tmp_path / "out")
                 for part in WRITING_COMMANDS[command]]
    result = run_cli(*arguments, "--workers", "2", "--threads", "1")
    assert result.exit_code == 0, result.output
    assert hashed_on == [2]


@pytest.mark.parametrize("command", [*sorted(WRITING_COMMANDS), "dcp"])
def test_workers_plan_each_job_ahead_while_the_coordinator_checks(tmp_path, command, run_cli,
                                                                  monkeypatch):
    """Each command sends its job's planning to the workers as soon as it holds the checkpoint,
    and the job it runs then has that very planning (a worker plans it once, ahead)."""
    from dcpctl.execution import jobs
    from dcpctl.execution.processes import LocalWorkers

    sent_ahead, run = [], []
    real_plan_ahead, real_run = LocalWorkers.plan_ahead, LocalWorkers.run

    def recording_plan_ahead(self, planning):
        sent_ahead.append(jobs.packed(planning))
        return real_plan_ahead(self, planning)

    def recording_run(self, job, plan, advance):
        run.append(jobs.packed(job.planning))
        return real_run(self, job, plan, advance)
    monkeypatch.setattr(LocalWorkers, "plan_ahead", recording_plan_ahead)
    monkeypatch.setattr(LocalWorkers, "run", recording_run)
    if command == "dcp":
        ok("convert", fixture_path(SOURCE), "--to", "safetensors", "-o", tmp_path / "hf",
           "--include", "*")
        arguments = ["convert", tmp_path / "hf", "--to", "dcp", "--ranks", 4, "-o",
                     tmp_path / "out"]
    else:
        arguments = [part.format(source=fixture_path(SOURCE), output=tmp_path / "out")
                     for part in WRITING_COMMANDS[command]]
    result = run_cli(*arguments, "--workers", "2")
    assert result.exit_code == 0, result.output
    assert len(run) == 1 and run == sent_ahead


def test_verify_and_checksum_with_workers_agree_with_one_process(copy_fixture):
    checkpoint = copy_fixture(SOURCE)
    (checkpoint / "SHA256SUMS").unlink(missing_ok=True)
    ok("checksum", checkpoint, "--workers", 2)
    sums = (checkpoint / "SHA256SUMS").read_bytes()
    (checkpoint / "SHA256SUMS").unlink()
    ok("checksum", checkpoint)
    assert (checkpoint / "SHA256SUMS").read_bytes() == sums
    reports = [json.loads(ok("verify", checkpoint, "--json", "--workers", workers))
               for workers in (1, 2, 3)]
    assert reports[0] == reports[1] == reports[2] and reports[0]["status"] == "ok"


# the worker whose share holds the damaged item: the last rank file's writer for compress; for
# convert, the writer of the first tensor (its chunk in __2_0.distcp is damaged)
@pytest.mark.parametrize("command,worker", [
    (["compress"], 2), (["convert", "--to", "safetensors"], 1), (["convert", "--to", "torch"], 1)],
    ids=["compress", "safetensors", "torch"])
def test_damage_found_by_a_worker_fails_the_command_naming_it(copy_fixture, tmp_path, command,
                                                              worker):
    checkpoint = copy_fixture(SOURCE)
    damage_one_item(checkpoint, "__2_0.distcp")
    before = directory_state(checkpoint)
    result = run_dcpctl(command[0], checkpoint, *command[1:], "-o", tmp_path / "out",
                        "--workers", 2)
    assert result.returncode == 1
    assert result.stderr.startswith(f"Error: worker {worker} of 2: ")
    assert "__2_0.distcp" in result.stderr
    assert result.stderr.count("\n") == 1
    assert not (tmp_path / "out").exists()
    assert [path.name for path in tmp_path.iterdir()] == [SOURCE]  # no staging left either
    assert directory_state(checkpoint) == before
    report = json.loads(run_dcpctl("verify", checkpoint, "--json", "--workers", 2).stdout)
    assert report["status"] == "damaged" and report["problems"][0]["file"] == "__2_0.distcp"


@pytest.mark.parametrize("command", [["compress"], ["compress", "-o", "out"],
                                     ["reshard", "--ranks", "5", "-o", "out"],
                                     ["convert", "--to", "torch", "-o", "out"]],
                         ids=["in-place", "new-output", "reshard", "convert"])
def test_a_killed_worker_fails_the_command_and_publishes_nothing(copy_fixture, tmp_path,
                                                                 command):
    checkpoint = copy_fixture(SOURCE)
    before = directory_state(checkpoint)
    arguments = [tmp_path / part if part == "out" else part for part in command[1:]]
    result = run_dcpctl(command[0], checkpoint, *arguments, "--workers", 2,
                        failpoint="after-data-write@1",  # the worker dies at its 1st write
                        failpoint_scope="workers")
    assert result.returncode == 1, result.stderr
    assert ("worker 2 of 2 ended without finishing its share (killed by SIGKILL)"
            in result.stderr)
    assert directory_state(checkpoint) == before
    assert sorted(path.name for path in tmp_path.iterdir()) == [SOURCE]
    assert loaded_tensors(checkpoint) == expected_tensors()


@pytest.mark.parametrize("command", [["compress", "-o", "out"],
                                     ["reshard", "--ranks", "5", "-o", "out"],
                                     ["convert", "--to", "torch", "-o", "out"]],
                         ids=["compress", "reshard", "convert"])
def test_a_killed_coordinator_leaves_the_source_and_no_output(copy_fixture, tmp_path, command):
    """The command's own process writes a share too: killed at its first write, its worker
    dies with it, the source is as it was, and a second run finishes."""
    checkpoint = copy_fixture(SOURCE)
    before = directory_state(checkpoint)
    arguments = [tmp_path / part if part == "out" else part for part in command[1:]]
    killed = run_dcpctl(command[0], checkpoint, *arguments, "--workers", 2,
                        failpoint="after-data-write@1", failpoint_scope="coordinator")
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    assert directory_state(checkpoint) == before
    assert not (tmp_path / "out").exists()
    rerun = run_dcpctl(command[0], checkpoint, *arguments, "--workers", 2)
    assert rerun.returncode == 0, rerun.stderr
    if command[0] != "convert":
        assert loaded_tensors(tmp_path / "out") == expected_tensors()
    assert directory_state(checkpoint) == before


def test_without_workers_a_large_checkpoint_is_shared_among_a_process_per_core(
        run_cli, tmp_path, monkeypatch):
    from dcpctl.execution import worker_count
    monkeypatch.setattr(worker_count, "AUTOMATIC_WORKER_BYTES", 1)  # the fixture is large
    monkeypatch.setattr(worker_count, "default_thread_count", lambda: 2)
    result = run_cli("compress", fixture_path(SOURCE), "-o", tmp_path / "default", "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["workers"] == 2
    ok("compress", fixture_path(SOURCE), "-o", tmp_path / "one", "--workers", 1)
    assert tree(tmp_path / "default") == tree(tmp_path / "one")


@pytest.mark.parametrize("option", ["--workers", "--threads"])
def test_worker_and_thread_counts_past_any_machine_are_refused(run_cli, option):
    """`--workers 100000` started a process for each."""
    result = run_cli("verify", fixture_path(SOURCE), option, 100000)
    assert result.exit_code == 2 and "1<=x<=1024" in result.output


def test_memory_urls_are_refused_with_workers(run_cli):
    result = run_cli("verify", "memory://nothing/here", "--workers", 2)
    assert result.exit_code == 1


def torchrun(*args, ranks: int = 2, environment: dict | None = None
             ) -> subprocess.CompletedProcess:
    environment = {**os.environ, "PYTHONPATH": str(REPO_ROOT), **(environment or {})}
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           f"--nproc-per-node={ranks}", "-m", "dcpctl", *map(str, args)],
                          capture_output=True, text=True, env=environment, timeout=300)


@pytest.mark.slow
def test_torchrun_ranks_write_the_same_bytes_as_one_process(tmp_path):
    for name, command in WRITING_COMMANDS.items():
        alone, ranked = tmp_path / f"{name}-alone", tmp_path / f"{name}-ranked"
        fill = {"source": fixture_path(SOURCE)}
        ok(*[part.format(output=alone, **fill) for part in command])
        result = torchrun(*[part.format(output=ranked, **fill) for part in command])
        assert result.returncode == 0, result.stderr
        assert tree(alone) == tree(ranked), name
        assert result.stdout.count(str(ranked)) == 1  # the report, printed once, by rank 0
    checkpoint = tmp_path / "sums"
    shutil.copytree(fixture_path(SOURCE), checkpoint)
    (checkpoint / "SHA256SUMS").unlink(missing_ok=True)
    assert torchrun("checksum", checkpoint, ranks=3).returncode == 0
    ranked_sums = (checkpoint / "SHA256SUMS").read_bytes()
    (checkpoint / "SHA256SUMS").unlink()
    ok("checksum", checkpoint)
    assert (checkpoint / "SHA256SUMS").read_bytes() == ranked_sums
    result = torchrun("verify", checkpoint, "--json")
    assert result.returncode == 0 and json.loads(result.stdout)["status"] == "ok"


@pytest.mark.slow
def test_torchrun_ranks_end_without_the_interpreter_s_teardown(tmp_path):
    """With the gloo group still alive, a rank's interpreter shutdown at times ended in
    SIGABRT (`terminate called without an active exception`), which torchrun reported as the
    job failing, though checksum had done its work. An exit handler each rank registers at
    start-up tells whether the teardown ran."""
    hooks = tmp_path / "hooks"
    hooks.mkdir()
    (hooks / "sitecustomize.py").write_text(
        "import atexit, os, pathlib\n"
        "if 'RANK' in os.environ and 'LOCAL_RANK' in os.environ:\n"
        "    marker = pathlib.Path(os.environ['TEARDOWN_MARKERS']) / os.environ['RANK']\n"
        "    atexit.register(marker.touch)\n")
    markers = tmp_path / "markers"
    markers.mkdir()
    checkpoint = tmp_path / "sums"
    shutil.copytree(fixture_path(SOURCE), checkpoint)
    (checkpoint / "SHA256SUMS").unlink(missing_ok=True)
    environment = {"PYTHONPATH": os.pathsep.join([str(hooks), str(REPO_ROOT)]),
                   "TEARDOWN_MARKERS": str(markers)}
    result = torchrun("checksum", checkpoint, environment=environment)
    assert result.returncode == 0, result.stderr
    assert (checkpoint / "SHA256SUMS").exists()
    result = torchrun("checksum", tmp_path / "missing", environment=environment)
    assert result.returncode == 1, result.stderr
    assert sorted(path.name for path in markers.iterdir()) == []
    sanity = subprocess.run([sys.executable, "-c", "pass"], env={
        **os.environ, **environment, "RANK": "7", "LOCAL_RANK": "0"}, timeout=60)
    assert sanity.returncode == 0 and (markers / "7").exists()  # the hook does run


@pytest.mark.slow
def test_a_job_over_two_nodes_writes_the_same_bytes_as_one_process(tmp_path):
    """Two torchrun agents, as on two machines sharing a file system: they meet through c10d
    rendezvous (as SLURM users start them, per `dcpctl --help`), each with two ranks."""
    import socket
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        port = listener.getsockname()[1]
    source, alone, ranked = fixture_path(SOURCE), tmp_path / "alone", tmp_path / "ranked"
    ok("reshard", source, "--ranks", "5", "-o", alone)
    environment = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    nodes = [subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", f"--node-rank={node}",
         "--nproc-per-node=2", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}",
         "--rdzv-id=dcpctl-test", "-m", "dcpctl", "reshard", str(source), "--ranks", "5", "-o",
         str(ranked)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=environment)
        for node in (0, 1)]
    outcomes = [(node.wait(timeout=300), node.stdout.read(), node.stderr.read())
                for node in nodes]
    assert [code for code, _, _ in outcomes] == [0, 0], outcomes
    assert "".join(out for _, out, _ in outcomes).count(str(ranked)) == 1  # from rank 0 only
    assert tree(alone) == tree(ranked)


@pytest.mark.slow
@pytest.mark.parametrize("damaged,rank", [("__2_0.distcp", 1), ("__0_0.distcp", 0)])
def test_a_failing_rank_fails_the_torchrun_job_naming_it(copy_fixture, tmp_path, damaged, rank):
    checkpoint = copy_fixture(SOURCE)
    damage_one_item(checkpoint, damaged)
    result = torchrun("compress", checkpoint, "-o", tmp_path / "out", ranks=2)
    assert result.returncode != 0
    assert f"Error: rank {rank} of 2: " in result.stderr and damaged in result.stderr
    assert sorted(path.name for path in tmp_path.iterdir()) == [SOURCE]


@pytest.mark.slow
def test_a_rank_killed_under_torchrun_is_said_where_to_find(copy_fixture, tmp_path):
    """torchrun's agent stops every rank with SIGTERM once one is killed, before rank 0 hears
    of it: rank 0 said `stopped by SIGTERM` alone, and the README promised the rank named."""
    environment = {"DCPCTL_FAILPOINT": "after-data-write", "DCPCTL_FAILPOINT_SCOPE": "workers"}
    result = torchrun("compress", fixture_path(SOURCE), "-o", tmp_path / "out", ranks=2,
                      environment=environment)
    assert result.returncode != 0
    said = [line for line in result.stderr.splitlines() if line.startswith("Error: ")]
    assert said == ["Error: stopped by SIGTERM (torchrun stops every rank once one fails or is "
                    "killed: where one did, the root cause in its summary below names it)"], \
        result.stderr
    assert "rank      : 1 (local_rank: 1)\n  exitcode  : -9" in result.stderr
    assert not (tmp_path / "out").exists()


def _launch_ranks(commands: list[tuple[list[str], Path]], run_id: str,
                  environment: dict | None = None) -> list[subprocess.Popen]:
    """Ranks of a 2-rank torchrun job started by hand (no agent: rank 0 holds the job's
    store), each its command in its directory."""
    import socket
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        port = listener.getsockname()[1]
    ranks = []
    for rank, (command, directory) in enumerate(commands):
        rank_environment = {**os.environ, "PYTHONPATH": str(REPO_ROOT),
                            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                            "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2",
                            "LOCAL_WORLD_SIZE": "2", "TORCHELASTIC_RUN_ID": run_id,
                            **(environment or {})}
        ranks.append(subprocess.Popen([sys.executable, "-m", "dcpctl", *command], cwd=directory,
                                      env=rank_environment, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    return ranks


def _start_ranks(commands: list[tuple[list[str], Path]], run_id: str) -> list:
    """_launch_ranks, waited for: each rank's exit status and stderr."""
    return [(process.wait(timeout=300), process.stderr.read())
            for process in _launch_ranks(commands, run_id)]


@pytest.mark.slow
def test_ranks_started_with_different_commands_do_nothing_and_say_so(tmp_path):
    """torchrun starts the same command on every rank, but a launcher script per node may
    not: a rank whose command line is not rank 0's would do its share of rank 0's command."""
    results = _start_ranks([(["compress", str(fixture_path(SOURCE)), "-o", str(output)], tmp_path)
                            for output in (tmp_path / "out", tmp_path / "other")],
                           "different-commands")
    assert [code for code, _ in results] == [2, 2], results
    assert "rank 1 of 2 was started as `dcpctl compress" in results[0][1]
    assert str(tmp_path / "other") in results[0][1]
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
def test_ranks_that_see_another_checkpoint_at_the_same_path_publish_nothing(tmp_path):
    """A rank whose path names another checkpoint (its node's own copy, another working
    directory) did its share of that one, and the job published a checkpoint mixed of both,
    exit 0 (rank 0 checks only that the command lines match)."""
    from torch.distributed.checkpoint.metadata import StorageMeta

    from conftest import torch_metadata

    first, second = tmp_path / "node0", tmp_path / "node1"
    for node in (first, second):
        shutil.copytree(fixture_path(SOURCE), node / "ck")
    other = torch_metadata(second / "ck")  # another save of the same layout
    other.storage_meta = StorageMeta(save_id="another save")
    (second / "ck" / ".metadata").write_bytes(pickle.dumps(other))
    before = directory_state(tmp_path)
    results = _start_ranks([(["compress", "ck", "-o", str(tmp_path / "out")], first),
                            (["compress", "ck", "-o", str(tmp_path / "out")], second)],
                           "another-checkpoint")
    assert results[0][0] == 1, results
    assert ("Error: rank 1 of 2: read ck/.metadata as another file than rank 0 reads there: "
            "every rank must see the same files") in results[0][1], results
    assert directory_state(tmp_path) == before


@pytest.mark.slow
@pytest.mark.parametrize("source", ["model.safetensors", "model.pt"])
def test_ranks_that_see_another_model_at_the_same_path_publish_nothing(tmp_path, source):
    """`convert --to dcp` from safetensors or torch.save: each rank plans from the model at its
    path, and a rank that read its node's own copy of another revision (the same tensors,
    other values) wrote its share from that one: a checkpoint mixed of both, exit 0 (only
    `.metadata` files were compared)."""
    import safetensors.torch
    import torch

    first, second = tmp_path / "node0", tmp_path / "node1"
    for node, value in ((first, 1.0), (second, 2.0)):
        node.mkdir()
        state = {"embed": torch.full((64, 8), value), "head": torch.arange(16.0)}
        if source.endswith(".safetensors"):
            safetensors.torch.save_file(state, node / source)
        else:
            torch.save(state, node / source)
    before = directory_state(tmp_path)
    command = ["convert", source, "--to", "dcp", "--ranks", "2", "-o", str(tmp_path / "out")]
    results = _start_ranks([(command, first), (command, second)], f"another-{source}")
    assert results[0][0] == 1, results
    assert (f"Error: rank 1 of 2: read {source} as another file than rank 0 reads there"
            in results[0][1]), results
    assert directory_state(tmp_path) == before


def test_a_rank_whose_agent_is_killed_while_it_joins_does_not_wait_on(tmp_path):
    """A torchrun agent killed (SIGKILL) while its ranks still joined the job left them
    waiting on the agent's store for the process group's 24 hours."""
    import socket
    store = socket.socket()  # the agent's store, as far as the rank can tell: it never answers
    store.bind(("127.0.0.1", 0))
    store.listen(8)
    store.settimeout(120)
    environment = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "MASTER_ADDR": "127.0.0.1",
                   "MASTER_PORT": str(store.getsockname()[1]), "RANK": "1", "LOCAL_RANK": "1",
                   "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "TORCHELASTIC_RUN_ID": "killed"}
    agent = subprocess.Popen([sys.executable, "-c", (
        "import subprocess, sys; rank = subprocess.Popen(sys.argv[1:]); "
        "print(rank.pid, flush=True); rank.wait()"),
        sys.executable, "-m", "dcpctl", "verify", str(fixture_path(SOURCE))],
        env=environment, stdout=subprocess.PIPE, text=True)
    rank_status = Path(f"/proc/{int(agent.stdout.readline())}/status")
    with store, store.accept()[0]:  # the rank is joining
        agent.kill()
        agent.wait()
        deadline = time.monotonic() + 30
        while rank_status.exists() and "State:\tZ" not in rank_status.read_text():
            if time.monotonic() > deadline:
                os.kill(int(rank_status.parent.name), signal.SIGKILL)
                pytest.fail("the rank still waited 30 s after its agent was killed")
            time.sleep(0.2)


@pytest.mark.parametrize("stop, words, code", [
    (lambda: Terminated(signal.SIGTERM), "Error: stopped by SIGTERM", 143),
    (KeyboardInterrupt, "Error: interrupted", 130)])
def test_a_rank_other_than_0_stopped_says_so_in_a_line(monkeypatch, capsys, stop, words, code):
    """A scheduler's preemption sends SIGTERM to every rank: ranks other than 0 ended with a
    traceback and exit status 1, where rank 0 and a plain run say it in a line, 128 + signal."""
    from dcpctl.cli import main as cli_main

    class Team:
        rank = 1

        def check_same_command(self, arguments):
            pass

        def serve(self):
            raise stop()

    monkeypatch.setattr(cli_main, "join_torchrun", Team)
    assert cli_main._run_as_torchrun_rank() == code
    assert capsys.readouterr().err.strip() == words


@pytest.mark.parametrize("rank", [0, 1])
def test_a_rank_that_loses_the_job_says_so_in_a_line(monkeypatch, capsys, rank):
    """The torchrun agent, which holds the job's store, killed: the ranks ended with
    tracebacks of torch's DistNetworkError (and rank 0 with 'internal error')."""
    from dcpctl.cli import main as cli_main
    from dcpctl.execution import torchrun

    class BrokenStore:
        def __getattr__(self, name):
            def fail(*args):
                raise RuntimeError("Broken pipe\nException raised from sendBytes")
            return fail

    team = torchrun.Team(rank, 2, torchrun._JobStore(BrokenStore()))
    monkeypatch.setattr(cli_main, "join_torchrun", lambda: team)
    assert cli_main._run_as_torchrun_rank() == 1
    assert capsys.readouterr().err == ("Error: lost contact with the torchrun job (its agent or "
                                       "rank 0 ended?): Broken pipe\n")


@pytest.mark.slow
def test_a_rank_that_stops_answering_fails_the_torchrun_job_naming_it(tmp_path):
    """A rank killed on a node whose torchrun agent does not hold the job's store, or one
    stopped: rank 0 waited for its result forever."""
    environment = {**os.environ, "PYTHONPATH": str(REPO_ROOT),
                   "DCPCTL_FAILPOINT": "after-data-write:SIGSTOP",
                   "DCPCTL_FAILPOINT_SCOPE": "workers", "DCPCTL_TORCHRUN_RANK_TIMEOUT": "3"}
    started = time.monotonic()
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                             "--nproc-per-node=2", "-m", "dcpctl", "compress",
                             fixture_path(SOURCE), "-o", tmp_path / "out"],
                            capture_output=True, text=True, env=environment, timeout=180)
    assert result.returncode != 0
    assert "Error: rank 1 of 2: has not answered for 3 s" in result.stderr, result.stderr
    assert time.monotonic() - started < 120
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
def test_a_stop_while_rank_0_tells_the_others_the_end_is_no_traceback(tmp_path):
    """Rank 0 waits for the other ranks to hear the end (a rank gone first leaves them no
    store where rank 0 holds it): a SIGTERM meanwhile came out of that wait as a traceback."""
    command = ["compress", str(fixture_path(SOURCE)), "-o", str(tmp_path / "out")]
    rank_0, rank_1 = _launch_ranks([(command, tmp_path), (command, tmp_path)], "end-wait", {
        "DCPCTL_FAILPOINT": "after-data-write:SIGSTOP", "DCPCTL_FAILPOINT_SCOPE": "workers",
        "DCPCTL_TORCHRUN_RANK_TIMEOUT": "1"})
    try:
        said = rank_0.stderr.readline()  # rank 1, stopped, never hears the end
        assert "Error: rank 1 of 2: has not answered for 1 s" in said, said
        time.sleep(0.5)  # into the wait, which lasts 2 s
        rank_0.send_signal(signal.SIGTERM)
        assert rank_0.wait(timeout=60) == 1
        assert rank_0.stderr.read() == ""
    finally:
        for rank in (rank_0, rank_1):
            rank.kill()
            rank.wait(timeout=60)


def test_a_rank_silence_setting_that_is_no_duration_is_refused(monkeypatch):
    from dcpctl.execution import torchrun

    for setting in ("0", "-1", "soon", "nan"):
        monkeypatch.setenv("DCPCTL_TORCHRUN_RANK_TIMEOUT", setting)
        with pytest.raises(InvalidOptionError, match="DCPCTL_TORCHRUN_RANK_TIMEOUT"):
            torchrun.rank_silence_seconds()
    monkeypatch.setenv("DCPCTL_TORCHRUN_RANK_TIMEOUT", "2.5")
    assert torchrun.rank_silence_seconds() == 2.5

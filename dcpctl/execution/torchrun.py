"""Shares of a job run by the ranks of a torchrun job (`torchrun ... -m dcpctl COMMAND`).

Every rank starts dcpctl with the same command line (rank 0 checks that they did). Rank 0
runs the command as a single process would: it checks, plans, prepares the output and
publishes; each job it runs is handed to every rank, rank r running share r, and rank 0
publishes once every rank's result is in.
The other ranks only serve: they wait for a job or for the end, and exit with rank 0's exit
status. Everything travels through torch.distributed's key-value store (gloo process group,
CPU only), polled, so a rank waiting still answers SIGTERM, the way torchrun stops a job whose
other rank failed. Progress is shown by rank 0 alone, counting every rank's work.

Every rank beats a heart in the store (a counter it adds to each second). Rank 0, waiting for
a rank, fails the job naming it once its heart has not beaten for rank_silence_seconds(): a
rank killed on a node whose agent does not hold the store ends nothing rank 0 can see, and a
stopped one ends nothing at all.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import shlex
import threading
import time
from typing import Any, Callable, Iterator

from dcpctl.errors import DcpctlError, InvalidOptionError
from dcpctl.execution.jobs import (BatchedProgress, Planning, PlansMadeAhead, ShareJob,
                                   WorkerError, describe_failure, packed, run_share_of)
from dcpctl.execution.parent_death import die_with_parent
from dcpctl.failpoints import arm_in_worker
from dcpctl.storage.planned_from import fingerprints, planned_from
from dcpctl.storage.stores import abort_open_uploads

_POLL_SECONDS = 0.05
_END_HEARD = "dcpctl/end-heard"
_END_HEARD_SECONDS = 2.0
"""How long rank 0 waits for the other ranks to hear the end: a waiting rank polls for it
every _POLL_SECONDS; a rank killed never does."""
_PROGRESS_SECONDS = 0.5
_HEARTBEAT_SECONDS = 1.0
RANK_SILENCE_VARIABLE = "DCPCTL_TORCHRUN_RANK_TIMEOUT"
DEFAULT_RANK_SILENCE_SECONDS = 120.0
_team: Team | None = None


def launched_by_torchrun() -> bool:
    """Whether this process is a rank of a torchrun job of more than one rank."""
    return int(os.environ.get("WORLD_SIZE", "1")) > 1 and "TORCHELASTIC_RUN_ID" in os.environ


def local_world_size() -> int:
    """The ranks torchrun started on this node."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", "1"))


def rank_silence_seconds() -> float:
    """How long a rank may go without a heartbeat before rank 0 fails the job naming it:
    DCPCTL_TORCHRUN_RANK_TIMEOUT seconds, DEFAULT_RANK_SILENCE_SECONDS unset. A heartbeat
    waits only for the GIL, which nothing dcpctl does holds for long."""
    setting = os.environ.get(RANK_SILENCE_VARIABLE, "")
    try:
        seconds = float(setting) if setting else DEFAULT_RANK_SILENCE_SECONDS
    except ValueError:
        seconds = -1.0
    if not seconds > 0:
        raise InvalidOptionError(f"{RANK_SILENCE_VARIABLE}={setting!r}: not a number of seconds "
                                 "above 0")
    return seconds


def current_team() -> Team | None:
    """The torchrun job this process joined (join_torchrun), or None."""
    return _team


def join_torchrun() -> Team:
    """Join the torchrun job this process is a rank of (a gloo process group)."""
    global _team
    import datetime

    import torch.distributed as distributed

    # Joining waits in C++ for the store the agent holds, up to the timeout, with no signal
    # handler run meanwhile: an agent killed now would leave the rank waiting that long.
    # Once joined, losing the store is an error the rank reports (LostContactError).
    die_with_parent()
    distributed.init_process_group("gloo", timeout=datetime.timedelta(hours=24))
    die_with_parent(0)
    _team = Team(distributed.get_rank(), distributed.get_world_size(),
                 _JobStore(distributed.distributed_c10d._get_default_store()))
    _team.start_heartbeat()
    return _team


class LostContactError(DcpctlError):
    """The torchrun job's key-value store stopped answering: its agent, or the rank that holds
    it, ended."""


class _JobStore:
    """The job's key-value store, its failures worded as LostContactError."""

    def __init__(self, store) -> None:
        self._store = store

    def set(self, key: str, value: bytes) -> None:
        with _lost_contact_worded():
            self._store.set(key, value)

    def add(self, key: str, amount: int) -> int:
        with _lost_contact_worded():
            return self._store.add(key, amount)

    def check(self, keys: list[str]) -> bool:
        with _lost_contact_worded():
            return self._store.check(keys)

    def get(self, key: str) -> bytes:
        with _lost_contact_worded():
            return self._store.get(key)


@contextlib.contextmanager
def _lost_contact_worded() -> Iterator[None]:
    try:
        yield
    except RuntimeError as error:  # torch's DistError and its kinds
        raise LostContactError(f"lost contact with the torchrun job (its agent or rank 0 "
                               f"ended?): {str(error).strip().splitlines()[0]}") from None


class RankSilentError(WorkerError):
    """A rank's heart stopped beating while rank 0 waited for it."""


class Team:
    """The ranks of a torchrun job, talking through its store (see the module docstring)."""

    def __init__(self, rank: int, size: int, store) -> None:
        self.rank = rank
        self.size = size
        self.store = store
        self._jobs = 0
        self._silence_allowed = rank_silence_seconds()

    def start_heartbeat(self) -> None:
        """Beat this rank's heart in the store each second, for as long as the process lives
        (see the module docstring)."""
        threading.Thread(target=self._beat, name="dcpctl-rank-heartbeat", daemon=True).start()

    def _beat(self) -> None:
        key = f"dcpctl/heartbeat/{self.rank}"
        try:
            while True:
                self.store.add(key, 1)
                time.sleep(_HEARTBEAT_SECONDS)
        except LostContactError:
            return  # the job is over: whoever waits says it

    def check_same_command(self, arguments: list[str]) -> None:
        """Every rank says its command line; on rank 0, an InvalidOptionError names a rank
        started with another one (each rank would otherwise do its share of rank 0's command
        without a word)."""
        self.store.set(f"dcpctl/arguments/{self.rank}", pickle.dumps(arguments))
        if self.rank != 0:
            return
        for rank in range(1, self.size):
            theirs = pickle.loads(self._wait(f"dcpctl/arguments/{rank}", rank))
            if theirs != arguments:
                raise InvalidOptionError(
                    f"rank {rank} of {self.size} was started as `dcpctl {shlex.join(theirs)}`, "
                    f"rank 0 as `dcpctl {shlex.join(arguments)}`: every rank of a torchrun job "
                    "runs the same command; nothing was done")

    def plan_ahead(self, planning: Planning) -> None:
        """On rank 0: have every other rank plan `planning` now, ahead of the job that has
        it."""
        number = self._jobs = self._jobs + 1
        self.store.set(f"dcpctl/next/{number}", pickle.dumps(("plan", packed(planning))))

    def run(self, job: ShareJob, plan: Any, advance: Callable[[int], None]) -> list[Any]:
        """On rank 0: hand job to every rank, run share 0 here, gather every rank's result.
        Every rank's outcome is awaited before a failure is raised, so that no rank still
        writes into an output its caller then removes."""
        number = self._jobs = self._jobs + 1
        self.store.set(f"dcpctl/next/{number}",
                       pickle.dumps(("job", (packed(job), packed(job.planning)))))
        progress_key = f"dcpctl/progress/{number}"
        stop = threading.Event()
        watcher = threading.Thread(target=self._forward_progress, name="dcpctl-rank-progress",
                                   args=(progress_key, advance, stop), daemon=True)
        watcher.start()
        failure: Exception | None = None
        try:
            try:
                outcomes = [("done", run_share_of(job, 0, self.size, advance, plan))]
            except Exception as error:  # noqa: BLE001 - raised once the other ranks are done
                failure, outcomes = error, [("failed", None)]
            outcomes += [self._outcome_of(number, rank) for rank in range(1, self.size)]
        finally:
            stop.set()
            watcher.join()
        if failure is not None:
            raise WorkerError(f"rank 0 of {self.size}: {describe_failure(failure)}"
                              ) from failure
        for rank, (kind, value) in enumerate(outcomes):
            if kind == "silent":
                raise RankSilentError(value)
            if kind == "failed":
                raise WorkerError(f"rank {rank} of {self.size}: {value}")
        shares = [value for _, value in outcomes[1:]]
        mine = fingerprints({path: whole for _, files, _ in shares
                             for path, whole in files.items()})
        for rank, (_, _, theirs) in enumerate(shares, start=1):
            self._refuse_another_checkpoint(rank, theirs, mine)
        return [outcomes[0][1], *(outcome.adopted() for outcome, _, _ in shares)]

    def _refuse_another_checkpoint(self, rank: int, theirs: dict[str, str | None],
                                   mine: dict[str, str | None]) -> None:
        """Refuse a rank's share where a file it planned from (theirs: the fingerprints of
        planned_from.py) is not the file rank 0 reads at that path (mine): it planned from
        another checkpoint or model (a node's own copy, another working directory), and its
        share would be made of that one's bytes."""
        for path, fingerprint in sorted(theirs.items()):
            if fingerprint is None or mine[path] != fingerprint:
                raise WorkerError(
                    f"rank {rank} of {self.size}: read {path} as another file than rank 0 "
                    "reads there: every rank must see the same files (one shared file system, "
                    "or a bucket, at the same paths); nothing was published")

    def _outcome_of(self, number: int, rank: int) -> tuple[str, Any]:
        """Rank's outcome of job number: ("done", (its ShareOutcome, the files it planned from
        and their fingerprints)), ("failed", what it said), or ("silent", why rank 0 stopped
        waiting for it)."""
        try:
            return pickle.loads(self._wait(f"dcpctl/result/{number}/{rank}", rank))
        except RankSilentError as error:
            return "silent", error.message

    def end(self, exit_code: int) -> None:
        """On rank 0: tell every rank that the command is over, with its exit status (where
        the job is still there to be told), and wait, up to _END_HEARD_SECONDS, until each has
        heard it: where ranks are started without torchrun's agent, rank 0 holds the store,
        and a rank 0 gone first leaves the others with no store to hear the end from."""
        try:
            self.store.set(f"dcpctl/next/{self._jobs + 1}", pickle.dumps(("end", exit_code)))
            deadline = time.monotonic() + _END_HEARD_SECONDS
            while (self.store.add(_END_HEARD, 0) < self.size - 1
                   and time.monotonic() < deadline):
                time.sleep(_POLL_SECONDS)
        except LostContactError:
            pass

    def serve(self) -> int:
        """On ranks but 0: plan what rank 0 sends ahead, run the share of every job it hands
        out; rank 0's exit status."""
        arm_in_worker()
        plans = PlansMadeAhead()
        while True:
            number = self._jobs = self._jobs + 1
            kind, value = pickle.loads(self._wait(f"dcpctl/next/{number}"))
            if kind == "end":
                with contextlib.suppress(LostContactError):
                    self.store.add(_END_HEARD, 1)
                return value
            if kind == "plan":
                plans.make(value)
                continue
            key = f"dcpctl/progress/{number}"
            progress = BatchedProgress(lambda units: self.store.add(key, units),
                                       _PROGRESS_SECONDS)
            try:
                share = plans.run_share(*value, self.rank, self.size, progress.advance)
                files = planned_from()
                outcome = ("done", (share, files, fingerprints(files)))
            except Exception as error:  # noqa: BLE001 - rank 0 reports it
                abort_open_uploads()  # rank 0's clean-up reaches only its own
                outcome = ("failed", describe_failure(error))
            except BaseException:  # stopped
                abort_open_uploads()
                raise
            progress.flush()
            self.store.set(f"dcpctl/result/{number}/{self.rank}", pickle.dumps(outcome))

    def _wait(self, key: str, rank: int | None = None) -> bytes:
        """The value of key once it is set; given the rank that sets it, RankSilentError
        where that rank's heart stops beating first."""
        heartbeat, beats = f"dcpctl/heartbeat/{rank}", -1
        heard = asked = time.monotonic()
        while not self.store.check([key]):
            time.sleep(_POLL_SECONDS)  # a Python-level wait, so that signals are handled
            if rank is None or time.monotonic() - asked < _HEARTBEAT_SECONDS:
                continue
            asked, now = time.monotonic(), self.store.add(heartbeat, 0)
            if now != beats:
                beats, heard = now, asked
            elif asked - heard > self._silence_allowed:
                raise RankSilentError(
                    f"rank {rank} of {self.size}: has not answered for "
                    f"{self._silence_allowed:g} s (killed, stopped, or its machine lost; "
                    f"{RANK_SILENCE_VARIABLE} sets how long a rank may be silent)")
        return self.store.get(key)

    def _forward_progress(self, key: str, advance: Callable[[int], None],
                          stop: threading.Event) -> None:
        reported = 0
        while not stop.wait(_PROGRESS_SECONDS):
            try:
                done = self.store.add(key, 0)
            except LostContactError:
                return  # waiting for the ranks' results says it
            if done > reported:
                advance(done - reported)
                reported = done

"""The bounded ordered pipeline: order, memory bound, errors, cancellation."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
import time

import pytest

from dcpctl.pipeline import Pipeline, coalesce, group_into_runs, produce_run


def _collect(pipeline, tasks):
    out = []
    pipeline.run(tasks, lambda task, pieces: out.append((task, b"".join(pieces))))
    return out


@pytest.mark.parametrize("threads", [1, 2, 4, 8])
def test_output_comes_in_task_order_whatever_the_threads(threads):
    def produce(task):
        time.sleep((task * 7 % 5) / 1000)  # finish out of order
        for part in range(task % 4):
            yield bytes([task]) * (part + 1)

    tasks = list(range(40))
    result = _collect(Pipeline(produce, threads=threads), tasks)
    assert [task for task, _ in result] == tasks
    assert [data for _, data in result] == [
        b"".join(bytes([t]) * (p + 1) for p in range(t % 4)) for t in tasks]


def test_bytes_waiting_stay_bounded():
    lock = threading.Lock()
    produced = {"bytes": 0, "consumed": 0, "peak": 0}
    piece = b"x" * 1000

    def produce(task):
        for _ in range(50):
            with lock:
                produced["bytes"] += len(piece)
                waiting = produced["bytes"] - produced["consumed"]
                produced["peak"] = max(produced["peak"], waiting)
            yield piece

    def consume(task, pieces):
        for data in pieces:
            time.sleep(0.0002)
            with lock:
                produced["consumed"] += len(data)

    Pipeline(produce, threads=4, bytes_in_flight=8000).run(list(range(20)), consume)
    assert produced["consumed"] == 20 * 50 * 1000
    # the shared 8000-byte budget, one piece past it for the task being consumed, a piece in
    # each worker's hand and one in the consumer's
    assert produced["peak"] <= 8000 + 1000 + 4 * 1000 + 1000


def test_many_small_finished_tasks_share_the_budget():
    lock = threading.Lock()
    counts = {"produced": 0, "consumed": 0, "peak": 0}

    def produce(task):
        with lock:
            counts["produced"] += 100
            counts["peak"] = max(counts["peak"], counts["produced"] - counts["consumed"])
        yield b"s" * 100

    def consume(task, pieces):
        for data in pieces:
            time.sleep(0.0005 if task == 0 else 0)
            with lock:
                counts["consumed"] += len(data)

    Pipeline(produce, threads=3, bytes_in_flight=1000).run(list(range(300)), consume)
    assert counts["peak"] <= 1000 + 100 + 3 * 100 + 100


def test_a_piece_larger_than_the_buffer_still_passes():
    big = b"y" * 10_000
    result = _collect(Pipeline(lambda task: [big, big], threads=2, bytes_in_flight=100), [1, 2])
    assert [data for _, data in result] == [big * 2, big * 2]


def test_worker_error_is_raised_and_stops_the_rest():
    started = []

    def produce(task):
        started.append(task)
        if task == 3:
            raise ValueError("bad item 3")
        time.sleep(0.001)
        yield b"ok"

    with pytest.raises(ValueError, match="bad item 3"):
        _collect(Pipeline(produce, threads=2), list(range(1000)))
    assert len(started) < 1000


def test_consumer_error_is_raised_and_workers_stop():
    closed = []

    def produce(task):
        try:
            for _ in range(1000):
                yield b"z" * 100
        finally:
            closed.append(task)

    def consume(task, pieces):
        next(pieces)
        raise OSError(28, "No space left on device")

    threads_before = threading.active_count()  # earlier tests' pools may still be alive
    with pytest.raises(OSError, match="No space"):
        Pipeline(produce, threads=3, bytes_in_flight=1000).run(list(range(10)), consume)
    assert closed  # generators of started tasks were closed
    assert threading.active_count() == threads_before


_STUCK_CONSUMER = textwrap.dedent("""
    import os, signal, sys, threading, time
    import dcpctl.pipeline as pipeline
    from dcpctl.pipeline import Pipeline

    pipeline.STOP_SECONDS = {stop_seconds}
    never = threading.Event()

    def consume(task, pieces):
        for _ in pieces:
            if task == 1:
                never.wait()  # a write to a store that stopped answering

    threading.Timer(0.5, os.kill, (os.getpid(), signal.{signal_name})).start()
    started = time.monotonic()
    try:
        Pipeline(lambda task: [b"piece"], threads=2).run([0, 1, 2, 3], consume)
    except BaseException as error:
        print(type(error).__name__, round(time.monotonic() - started, 1))
""")


@pytest.mark.parametrize("signal_name", ["SIGINT", "SIGTERM"])
def test_a_stop_is_raised_though_a_thread_is_stuck_in_a_call_that_never_returns(signal_name):
    """Ctrl-C or SIGTERM while a thread waits on a store that stopped answering: the command
    stops (and can remove what it wrote) once the others stopped, rather than never."""
    script = _STUCK_CONSUMER.format(stop_seconds=1.0, signal_name=signal_name)
    if signal_name == "SIGTERM":
        script = "from dcpctl.stopping import stop_on_signals; stop_on_signals()\n" + script
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=60)
    name, seconds = done.stdout.split()
    assert name == ("KeyboardInterrupt" if signal_name == "SIGINT" else "Terminated")
    assert 1.0 <= float(seconds) < 10


def test_no_tasks_and_unread_pieces():
    assert _collect(Pipeline(lambda task: [b"a"], threads=3), []) == []
    seen = []
    Pipeline(lambda task: [b"a", b"b", b"c"], threads=2).run([1, 2, 3], lambda t, p: seen.append(t))
    assert seen == [1, 2, 3]


def test_coalesce_joins_small_pieces_and_passes_big_ones():
    pieces = [b"a", b"bb", b"c" * 10, b"d", b"e" * 3]
    joined = list(coalesce(pieces, 4))
    assert b"".join(joined) == b"".join(pieces)
    assert joined == [b"abb" + b"c" * 10, b"d" + b"eee"]
    assert list(coalesce([b"x" * 8, b"y"], 4)) == [b"x" * 8, b"y"]
    assert list(coalesce([], 4)) == []


@pytest.mark.parametrize("threads", [1, 2, 4])
def test_each_lane_is_consumed_in_task_order_one_task_at_a_time(threads):
    lock = threading.Lock()
    consumed: dict[int, list[int]] = {0: [], 1: [], 2: []}
    busy = set()

    def produce(task):
        time.sleep((task * 7 % 5) / 2000)
        yield bytes([task])

    def consume(task, pieces):
        lane = task % 3
        with lock:
            assert lane not in busy
            busy.add(lane)
        time.sleep(0.0005)
        assert b"".join(pieces) == bytes([task])
        with lock:
            busy.discard(lane)
            consumed[lane].append(task)

    Pipeline(produce, threads=threads).run(list(range(60)), consume, lane_of=lambda t: t % 3)
    assert consumed == {lane: list(range(lane, 60, 3)) for lane in range(3)}


def test_lanes_are_consumed_side_by_side():
    # lane "a"'s only task cannot finish until lane "b"'s task has been consumed
    b_consumed = threading.Event()

    def consume(task, pieces):
        b"".join(pieces)
        if task == "a":
            assert b_consumed.wait(timeout=10), "lane b waited for lane a"
        else:
            b_consumed.set()

    Pipeline(lambda task: [b"x"], threads=2).run(["a", "b"], consume, lane_of=lambda t: t)


def test_one_thread_runs_everything_in_the_calling_thread():
    threads_seen = set()

    def produce(task):
        threads_seen.add(threading.get_ident())
        yield b"p"

    Pipeline(produce, threads=1).run(list(range(5)), lambda t, p: threads_seen.add(
        threading.get_ident()) or list(p))
    assert threads_seen == {threading.get_ident()}


def test_runs_keep_to_one_lane_a_size_and_neighbours():
    tasks = [("a", 3), ("a", 3), ("a", 3), ("b", 1), ("b", 9), ("b", 1), ("b", 1), ("a", 1)]
    runs = group_into_runs(tasks, lambda task: task[0], lambda task: task[1], max_bytes=6,
                           neighbours=lambda before, after: before[1] == after[1])
    assert [(run.lane, run.tasks, run.size_bytes) for run in runs] == [
        ("a", [("a", 3), ("a", 3)], 6), ("a", [("a", 3)], 3), ("b", [("b", 1)], 1),
        ("b", [("b", 9)], 9), ("b", [("b", 1), ("b", 1)], 2), ("a", [("a", 1)], 1)]


def test_a_run_produces_its_tasks_in_order_counting_each():
    run = group_into_runs([2, 0, 5], lambda task: 0, lambda task: task, max_bytes=10)[0]
    pieces = list(produce_run(run, lambda task: [b"x" * task, b"y"]))
    assert b"".join(pieces) == b"xxy" + b"y" + b"xxxxxy"
    assert run.produced_bytes == [3, 1, 6]

"""bench/ckpt_overhead.py's CPU accounting: a thread that spins shows up as its own kind,
the idle main thread does not take its seconds, and the report pairs blocks by round."""

from __future__ import annotations

import os
import threading
import time
from types import ModuleType

from .. import benchmod


def load_bench() -> ModuleType:
    return benchmod.load_bench("ckpt_overhead")


def test_a_spinning_thread_is_counted_as_a_thread_not_as_the_main_one() -> None:
    bench = load_bench()
    before = bench.cpu_by_thread(os.getpid())
    spun, stop = threading.Event(), threading.Event()

    def spin() -> None:
        while not stop.is_set():
            sum(range(1000))
            if time.thread_time() >= 0.3:  # its own CPU, however loaded the machine is
                spun.set()

    worker = threading.Thread(target=spin)
    worker.start()
    try:
        assert spun.wait(60), "the thread never got 0.3 s of CPU"
        during = bench.cpu_by_thread(os.getpid())  # the main thread waited meanwhile
    finally:
        stop.set()
        worker.join()
    spent = bench.minus(during, before)
    assert spent["threads"] >= 0.25, spent
    assert spent.get("main", 0.0) < spent["threads"], spent
    # Negative control: a process that does not exist has no threads to count.
    assert bench.cpu_by_thread(2**22 + 1) == {}


def test_zeromq_io_threads_are_their_own_kind() -> None:
    bench = load_bench()
    assert bench.thread_kind(10, 11, "ZMQbg/IO/0") == "zmq-io"
    assert bench.thread_kind(10, 10, "python3") == "main"
    assert bench.thread_kind(10, 12, "python3") == "threads"


def test_the_report_pairs_blocks_by_round() -> None:
    bench = load_bench()
    blocks = [
        bench.Block("lumen", 0, 1.1, 0.05, 0, 40.0, 900, 0.5, {"engine main": 12.0}),
        bench.Block("stop_and_restart", 0, 1.0, 0.05, 0, 40.0, 0, 0.1, {"engine main": 10.0}),
        bench.Block("stop_and_restart", 1, 2.0, 0.05, 0, 40.0, 0, 0.1, {"engine main": 10.0}),
        bench.Block("lumen", 1, 2.4, 0.05, 0, 40.0, 950, 0.5, {"engine main": 13.0}),
    ]
    text = bench.report(blocks, ["lumen", "stop_and_restart"])
    # TTFT ratios 1.1 and 1.2 (paired by round, not by position): mean 1.150
    assert "TTFT 1.150 ±" in text
    assert "engine main    : 2.5 ±" in text

"""What an engine leaves behind dies with it: its process group when it dies, and whatever
a previous lumend left running for the same worker when a new supervisor starts."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from lumenctl.localcluster import process_running as alive  # zombies count as gone
from lumend.config import WorkerConfig
from lumend.engine.adapter import VllmAdapter
from lumend.failover.lifeline import (
    RUNTIME_DIR_ENV,
    SUPERVISOR_PID_ENV,
    kill_group,
    reap_orphans,
)
from lumend.failover.supervisor import WorkerSupervisor


def wait_dead(pid: int, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while alive(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


@pytest.fixture
def spawned() -> Iterator[list[subprocess.Popen[bytes]]]:
    procs: list[subprocess.Popen[bytes]] = []
    try:
        yield procs
    finally:
        for p in procs:
            kill_group(p.pid)
            p.kill()
            p.wait()


def test_a_dead_engines_children_are_killed_with_its_group(
    spawned: list[subprocess.Popen[bytes]], tmp_path: Path,
) -> None:
    pid_file = tmp_path / "child.pid"
    # The "engine" starts a child of its own (as vLLM starts its engine core), then dies.
    leader = subprocess.Popen(["sh", "-c", f"sleep 60 & echo $! > {pid_file}; wait"],
                              start_new_session=True)
    spawned.append(leader)
    while not pid_file.exists() or not pid_file.read_text().strip():
        time.sleep(0.01)
    child = int(pid_file.read_text())
    leader.send_signal(signal.SIGKILL)
    leader.wait()
    assert alive(child), "the child outlives its killed parent unless its group is killed"
    kill_group(leader.pid)
    assert wait_dead(child)
    kill_group(leader.pid)  # nothing left: no error


def test_orphans_of_a_previous_supervisor_are_reaped_and_nothing_else(
    spawned: list[subprocess.Popen[bytes]], tmp_path: Path,
) -> None:
    mine, other = tmp_path / "w0", tmp_path / "w1"

    def start(runtime_dir: Path, supervisor_pid: int) -> subprocess.Popen[bytes]:
        env = {**os.environ, RUNTIME_DIR_ENV: str(runtime_dir),
               SUPERVISOR_PID_ENV: str(supervisor_pid)}
        p = subprocess.Popen(["sleep", "60"], env=env, start_new_session=True)
        spawned.append(p)
        return p

    orphan = start(mine, supervisor_pid=1)  # its lumend is gone
    current = start(mine, supervisor_pid=os.getpid())  # started by this supervisor
    elsewhere = start(other, supervisor_pid=1)  # another worker's
    time.sleep(0.2)  # exec done: /proc/<pid>/environ is sleep's
    assert reap_orphans(mine) == [orphan.pid]
    orphan.wait(10)
    assert current.poll() is None and elsewhere.poll() is None


def test_engines_see_only_their_workers_gpus_and_gms_needs_one_gpu(tmp_path: Path) -> None:
    def supervisor(gpus: list[int]) -> WorkerSupervisor:
        worker = WorkerConfig(name="v0", gpus=gpus, engine="vllm", shadows=1, model="/m",
                              args=[], port=9100)
        return WorkerSupervisor("node-1", worker, VllmAdapter(cuda=True),
                                runtime_dir=tmp_path / "run", log_dir=tmp_path / "logs")

    single, double = supervisor([3]), supervisor([2, 5])
    assert single.gms_socket is not None and double.gms_socket is None
    env = double.engine_environment(double.slots[0].spec)
    assert env["CUDA_VISIBLE_DEVICES"] == "2,5"
    assert env[RUNTIME_DIR_ENV] == str(tmp_path / "run" / "v0")
    assert env[SUPERVISOR_PID_ENV] == str(os.getpid())

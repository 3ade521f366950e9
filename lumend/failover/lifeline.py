"""Engines and GMS servers die with the lumend that supervises them.

Under systemd, `KillMode=mixed` already stops the whole cgroup when lumend dies; elsewhere a
supervisor killed with SIGKILL would leave engines serving unsupervised, holding the ports
and the failover lock its successor needs. Each child calls `die_with_supervisor()` at
start: the kernel sends it SIGKILL when its parent dies, and a child whose parent is already
gone exits at once.

That covers the process lumend started, not the processes it starts in turn (vLLM's engine
core and GPU workers: the kernel clears PDEATHSIG on fork, and they outlive a SIGKILLed API
server holding GPU memory). Every engine runs in a process group of its own, which the
supervisor kills as a whole; and what a previous lumend left behind is found by the
worker's runtime directory in the environment, and killed, before new engines start
(`reap_orphans`).
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import signal
from pathlib import Path

SUPERVISOR_PID_ENV = "LUMEN_SUPERVISOR_PID"
RUNTIME_DIR_ENV = "LUMEN_RUNTIME_DIR"
_PR_SET_PDEATHSIG = 1

log = logging.getLogger("lumend.failover")


def supervisor_env(runtime_dir: Path | None = None) -> dict[str, str]:
    """What the supervisor adds to a child's environment (inherited by its children)."""
    env = {SUPERVISOR_PID_ENV: str(os.getpid())}
    if runtime_dir is not None:
        env[RUNTIME_DIR_ENV] = str(runtime_dir)
    return env


def kill_group(pgid: int) -> None:
    """SIGKILL every process left in a group (the leader may be gone already)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)


def reap_orphans(runtime_dir: Path) -> list[int]:
    """Kill processes started for `runtime_dir` by a supervisor that is no longer this
    one (a lumend that died without stopping them); returns their pids."""
    marker = f"{RUNTIME_DIR_ENV}={runtime_dir}".encode()
    mine = f"{SUPERVISOR_PID_ENV}={os.getpid()}".encode()
    killed = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            environ = (entry / "environ").read_bytes().split(b"\0")
        except OSError:
            continue  # gone, or not ours to read
        if marker in environ and mine not in environ:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(int(entry.name), signal.SIGKILL)
                killed.append(int(entry.name))
    if killed:
        log.warning("killed %d process(es) a previous lumend left running for %s: %s",
                    len(killed), runtime_dir, killed)
    return killed


def die_with_supervisor() -> None:
    expected = os.environ.get(SUPERVISOR_PID_ENV)
    if not expected:
        return  # started by hand, not by lumend
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != int(expected):  # the supervisor died before prctl took effect
        os._exit(1)

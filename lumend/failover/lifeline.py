"""Engines and GMS servers die with the lumend that supervises them.

Under systemd, `KillMode=mixed` already stops the whole cgroup when lumend dies; elsewhere a
supervisor killed with SIGKILL would leave engines serving unsupervised, holding the ports
and the failover lock its successor needs. Each child calls `die_with_supervisor()` at
start: the kernel sends it SIGKILL when its parent dies, and a child whose parent is already
gone exits at once.
"""

from __future__ import annotations

import ctypes
import os
import signal

SUPERVISOR_PID_ENV = "LUMEN_SUPERVISOR_PID"
_PR_SET_PDEATHSIG = 1


def supervisor_env() -> dict[str, str]:
    """What the supervisor adds to a child's environment."""
    return {SUPERVISOR_PID_ENV: str(os.getpid())}


def die_with_supervisor() -> None:
    expected = os.environ.get(SUPERVISOR_PID_ENV)
    if not expected:
        return  # started by hand, not by lumend
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != int(expected):  # the supervisor died before prctl took effect
        os._exit(1)

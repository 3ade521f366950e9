"""The etcd channel pool's closer thread under the races that CI met: a release callback
(from a call's worker thread) starting the closer while `close()` drains the pool."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

from lumend.cluster.channels import ChannelPool


class Client:
    def __init__(self) -> None:
        self.closed = threading.Event()

    def close(self) -> None:
        self.closed.set()


def test_drain_while_another_thread_starts_the_closer(monkeypatch: pytest.MonkeyPatch) -> None:
    """The closer is published only once started: a drain that sees it can join it. Before
    the fix the pool published the thread and then started it, and a drain in between failed
    with "cannot join thread before it is started" (seen once in a CI run of the suite)."""
    starting = threading.Event()
    real_start = threading.Thread.start

    def slow_start(self: threading.Thread) -> None:
        if self.name == "etcd-closer":
            starting.set()
            time.sleep(0.3)  # widens the window a busy machine opened by chance
        real_start(self)

    monkeypatch.setattr(threading.Thread, "start", slow_start)
    clients: list[Client] = []

    def make(_: int) -> Any:
        clients.append(Client())
        return clients[-1]

    pool = ChannelPool(make)
    with pool.lend(0) as lease:
        pass
    retirer = threading.Thread(target=pool.retire, args=(lease,), name="retirer")
    real_start(retirer)
    assert starting.wait(5)
    pool.drain(5.0)  # raised RuntimeError before the fix
    retirer.join(5)
    assert clients[0].closed.is_set(), "the retired channel was never closed"


def test_a_closer_left_running_by_drain_does_not_take_the_next_ones_leases() -> None:
    """drain stops the closer it found; a channel retired afterwards gets a closer of its
    own (the old one, still closing a slow channel, never takes its work or its stop)."""
    release = threading.Event()

    class SlowClient(Client):
        def close(self) -> None:
            release.wait(30)
            super().close()

    made: list[Client] = []

    def make(index: int) -> Any:
        made.append(SlowClient() if index == 0 else Client())
        return made[-1]

    pool = ChannelPool(make)
    with pool.lend(0) as slow:
        pass
    pool.retire(slow)
    pool.drain(0.05)  # the closer is still inside the slow close
    with pool.lend(1) as quick:
        pass
    pool.retire(quick)
    assert made[1].closed.wait(5), "a channel retired after a drain was not closed"
    release.set()
    assert made[0].closed.wait(5)
    pool.drain(5.0)

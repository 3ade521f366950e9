"""Fixtures that start real etcd members and real lumend processes, and stop them by pid."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

import pytest

from lumenctl.localcluster import EtcdCluster, LocalCluster
from lumend.cluster.store import StoreUnavailable

T = TypeVar("T")


@pytest.fixture
def etcd(tmp_path: Path) -> Iterator[EtcdCluster]:
    cluster = EtcdCluster(tmp_path / "etcd", size=1)
    try:
        yield cluster.start()
    finally:
        cluster.stop()


@pytest.fixture
def etcd3(tmp_path: Path) -> Iterator[EtcdCluster]:
    cluster = EtcdCluster(tmp_path / "etcd", size=3)
    try:
        yield cluster.start()
    finally:
        cluster.stop()


@pytest.fixture
def local_cluster(tmp_path: Path) -> Iterator[Callable[..., LocalCluster]]:
    """Factory: `local_cluster(size=3, lease_ttl_s=3, etcd_members=1)`, stopped at teardown."""
    started: list[LocalCluster] = []

    def make(**kwargs: object) -> LocalCluster:
        cluster = LocalCluster(tmp_path / f"cluster{len(started)}", **kwargs)  # type: ignore[arg-type]
        started.append(cluster)
        return cluster.start()

    try:
        yield make
    finally:
        for cluster in started:
            cluster.stop()


def wait_until(probe: Callable[[], T | None], timeout_s: float, what: str) -> T:
    """Poll `probe` until it returns something truthy; fail naming `what` on timeout. A probe
    that finds etcd unreachable (a read's 2 s budget spent on a busy machine: CI saw etcd
    answer "context deadline exceeded" once, with the cluster fine) has not seen the state
    yet: it is polled again, and the error is what the timeout reports as last."""
    deadline = time.monotonic() + timeout_s
    last: T | StoreUnavailable | None = None
    while time.monotonic() < deadline:
        try:
            found = probe()
        except StoreUnavailable as exc:
            last = exc
        else:
            if found:
                return found
            last = found
        time.sleep(0.05)
    pytest.fail(f"timed out after {timeout_s} s waiting for {what} (last: {last!r})")

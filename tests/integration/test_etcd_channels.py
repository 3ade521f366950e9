"""The etcd store's channels under calls that fail or never return (real etcd, real gRPC).

What the chaos lab found: after a long black hole between a node and etcd, the node froze
for good (no renewal, no re-registration once the network healed). Its HA loop and its
lease thread share one store, and each closed the channel a failed call had used at once,
under the other's calls in flight and on its own event loop (grpc's close can deadlock
then). These tests pin the two rules that replace it: a call's failure never closes a
channel another call is using, and a call that never returns is abandoned, not awaited.
"""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import pyetcd.exceptions as etcd_errors
import pytest

from lumenctl.localcluster import EtcdCluster
from lumend.cluster.store import EtcdStore, ModRevisionIs, Put, StoreUnavailable

pytestmark = pytest.mark.etcd


def test_a_failed_call_does_not_close_the_channel_under_a_call_in_flight(
        etcd: EtcdCluster) -> None:
    async def scenario() -> tuple[str | None, int]:
        store = EtcdStore(etcd.endpoints, request_timeout_s=2.0)
        await store.put("k", b"v")
        attempts = 0
        started = threading.Event()

        def slow_read(c: Any) -> str | None:
            nonlocal attempts
            attempts += 1
            started.set()
            time.sleep(0.5)  # the other call fails (and its channel is retired) meanwhile
            value, _ = c.get("k")
            return None if value is None else value.decode()

        def failing(c: Any) -> None:
            raise etcd_errors.ConnectionFailedError()

        try:
            slow = asyncio.create_task(store._call("slow read", slow_read))
            await asyncio.to_thread(started.wait, 5)
            with pytest.raises(StoreUnavailable):
                await store._call("failing", failing)
            return await slow, attempts
        finally:
            await store.close()

    value, attempts = asyncio.run(scenario())
    assert value == "v"
    # One attempt: the read kept its channel (closing it under the read made it fail with
    # "Cannot invoke RPC on closed channel!" and be sent again).
    assert attempts == 1


def test_a_call_that_never_returns_is_abandoned_and_the_next_call_works(
        etcd: EtcdCluster) -> None:
    release = threading.Event()

    async def scenario() -> tuple[str, str | None]:
        store = EtcdStore(etcd.endpoints, request_timeout_s=0.25)
        await store.put("k", b"v")
        try:
            with pytest.raises(StoreUnavailable) as failed:
                # Bounded from outside: without abandonment this waits for the release.
                await asyncio.wait_for(store._call("wedged", lambda c: release.wait(20)), 10)
            got = await store.get("k")
            return str(failed.value), None if got is None else got.value.decode()
        finally:
            release.set()
            await store.close()

    try:
        error, value = asyncio.run(scenario())
    finally:
        release.set()
    assert "abandoned" in error
    assert value == "v"


def test_every_channel_is_closed_once_its_calls_are_done(etcd: EtcdCluster) -> None:
    async def scenario() -> tuple[int, int, int]:
        store = EtcdStore(etcd.endpoints, request_timeout_s=1.0, retry_budget_s=0.1)

        def failing(c: Any) -> None:
            raise etcd_errors.ConnectionFailedError()

        for _ in range(3):
            with pytest.raises(StoreUnavailable):
                await store._call("failing", failing)
        await store.put("k", b"v")
        await store.close()
        pool = store._channels
        return pool.made, pool.closed, pool.abandoned

    made, closed, abandoned = asyncio.run(scenario())
    assert made >= 2  # a fresh channel after failures, one for the put
    assert (closed, abandoned) == (made, 0)


def test_one_failure_keeps_the_channel_and_a_second_in_a_row_replaces_it(
        etcd: EtcdCluster) -> None:
    """On a lossy link one timeout is no dead connection (a new one costs a handshake whose
    lost SYN waits 1-3 s); a black hole fails the same channel again."""
    async def scenario() -> list[int]:
        store = EtcdStore(etcd.endpoints, request_timeout_s=1.0, retry_budget_s=0.0)

        def failing(c: Any) -> None:
            raise etcd_errors.ConnectionTimeoutError()

        made = []
        try:
            await store.put("k", b"v")
            for pattern in (["fail", "ok"], ["fail", "fail", "ok"]):
                for step in pattern:
                    if step == "fail":
                        with pytest.raises(StoreUnavailable):
                            await store._call("failing", failing)
                    else:
                        await store.put("k", b"v")
                made.append(store._channels.made)
            return made
        finally:
            await store.close()

    assert asyncio.run(scenario()) == [1, 2]


def test_a_mod_revision_compare_refuses_a_write_after_another_write(etcd: EtcdCluster) -> None:
    """The store's read-modify-write guard (`lumenctl config set` uses it)."""
    async def scenario() -> tuple[bool, bool, bool, bytes | None]:
        store = EtcdStore(etcd.endpoints)
        try:
            absent = await store.txn([ModRevisionIs("cfg", 0)], [Put("cfg", b"1")])
            read = await store.get("cfg")
            assert read is not None
            await store.put("cfg", b"2")  # another writer, after our read
            stale = await store.txn([ModRevisionIs("cfg", read.mod_revision)],
                                    [Put("cfg", b"3")])
            again = await store.get("cfg")
            assert again is not None
            fresh = await store.txn([ModRevisionIs("cfg", again.mod_revision)],
                                    [Put("cfg", b"4")])
            final = await store.get("cfg")
            return (absent.succeeded, stale.succeeded, fresh.succeeded,
                    None if final is None else final.value)
        finally:
            await store.close()

    assert asyncio.run(scenario()) == (True, False, True, b"4")


def test_a_cancelled_call_keeps_its_channel_until_its_thread_is_done(etcd: EtcdCluster) -> None:
    async def scenario() -> list[object]:
        store = EtcdStore(etcd.endpoints, request_timeout_s=2.0, retry_budget_s=0.1)
        await store.put("k", b"v")
        seen: list[object] = []
        started, finished = threading.Event(), threading.Event()

        def slow_read(c: Any) -> None:
            started.set()
            time.sleep(0.5)  # cancelled meanwhile, and its channel retired by a failure
            try:
                value, _ = c.get("k")
                seen.append(value)
            except Exception as exc:
                seen.append(type(exc).__name__)
            finished.set()

        def failing(c: Any) -> None:
            raise etcd_errors.ConnectionFailedError()

        try:
            slow = asyncio.create_task(store._call("slow read", slow_read))
            await asyncio.to_thread(started.wait, 5)
            slow.cancel()
            with pytest.raises(StoreUnavailable):
                await store._call("failing", failing)
            await asyncio.to_thread(finished.wait, 5)
            return seen
        finally:
            await store.close()

    assert asyncio.run(scenario()) == [b"v"]

"""Self-fencing arithmetic of the lease keeper, on a fake clock (no store call is made)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

import pytest

from lumend.cluster.lease import LeaseKeeper


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_confidence_ends_a_margin_before_the_lease_can_expire() -> None:
    clock = Clock()
    keeper = LeaseKeeper(store=None, ttl_s=10, clock=clock)  # type: ignore[arg-type]
    assert not keeper.confident()  # no lease yet
    keeper.lease_id, keeper._renewed_at = 1, clock.now
    assert keeper.margin_s == 2.0 and keeper.confident_for_s == 8.0
    clock.now += 7.9
    assert keeper.confident()
    clock.now += 0.2
    assert not keeper.confident()
    keeper.forget()
    assert not keeper.held and not keeper.confident()


class WedgedStore:
    """A store whose keepalive never answers (a grpc call wedged in its thread)."""

    def __init__(self) -> None:
        self.keepalives = 0

    async def keepalive(self, lease: int) -> int:
        self.keepalives += 1
        await asyncio.sleep(3600)
        return 0


def test_a_lease_unrenewed_past_its_ttl_is_given_up_even_if_no_keepalive_answers() -> None:
    clock = Clock()
    store = WedgedStore()
    keeper = LeaseKeeper(store, ttl_s=3, clock=clock, renew_in_thread=True)  # type: ignore[arg-type]

    async def scenario() -> list[bool]:
        keeper.lease_id, keeper._renewed_at = 7, clock.now
        keeper._start_thread(asyncio.get_running_loop())
        try:
            for _ in range(50):  # the thread's first keepalive is sent, and never returns
                if store.keepalives:
                    break
                await asyncio.sleep(0.01)
            outcomes = [await keeper.renew()]  # within the ttl: still held
            clock.now += 3.5
            outcomes.append(await keeper.renew())
            return outcomes
        finally:
            keeper._closing.set()

    assert asyncio.run(scenario()) == [True, False]
    assert store.keepalives == 1 and not keeper.held  # the agent then grants a new lease


class SlowStore:
    """Keepalives answer, the second one after `slow_s` (a lossy link, a slow etcd)."""

    def __init__(self, slow_s: float) -> None:
        self.slow_s = slow_s
        self.keepalives = 0

    async def keepalive(self, lease: int) -> int:
        self.keepalives += 1
        if self.keepalives == 2:
            await asyncio.sleep(self.slow_s)
        return 3


def _run_keeper(store: object, main_loop_work: Callable[[], Awaitable[None]]) -> LeaseKeeper:
    keeper = LeaseKeeper(store, ttl_s=3, renew_in_thread=True)  # type: ignore[arg-type]

    async def scenario() -> None:
        keeper.lease_id, keeper._renewed_at = 7, keeper._clock()
        keeper._start_thread(asyncio.get_running_loop())
        try:
            await main_loop_work()
        finally:
            keeper._closing.set()

    asyncio.run(scenario())
    return keeper


def test_a_slow_keepalive_is_not_taken_for_a_stalled_event_loop(
        caplog: pytest.LogCaptureFixture) -> None:
    store = SlowStore(slow_s=2.2)  # longer than the stall limit (1 s + half of 2 s)
    keeper = _run_keeper(store, lambda: asyncio.sleep(5.5))  # an idle, answering loop
    assert "has not answered" not in caplog.text
    assert store.keepalives >= 3 and keeper.held  # renewals went on after the slow one


def test_a_wedged_event_loop_lets_the_lease_lapse(caplog: pytest.LogCaptureFixture) -> None:
    store = SlowStore(slow_s=0.0)

    async def wedge() -> None:
        await asyncio.sleep(1.5)
        before = store.keepalives
        time.sleep(4.0)  # noqa: ASYNC251 - the loop answers nothing for longer than the limit
        during.append(store.keepalives - before)
        await asyncio.sleep(0.1)

    during: list[int] = []
    _run_keeper(store, wedge)
    assert "has not answered" in caplog.text
    assert during[0] <= 2  # renewals stop once the ping is out for longer than the limit

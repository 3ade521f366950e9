"""Self-fencing arithmetic of the lease keeper, on a fake clock (no store call is made)."""

from __future__ import annotations

import asyncio

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

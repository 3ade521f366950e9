"""Self-fencing arithmetic of the lease keeper, on a fake clock (no store call is made)."""

from __future__ import annotations

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

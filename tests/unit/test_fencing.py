from __future__ import annotations

import asyncio

import pytest

from lumend.cluster.fencing import EpochFence, StaleEpochError, UnknownEpochError


class Etcd:
    """The coordinator key's create revision as etcd would report it, and the reads."""

    def __init__(self, current: int) -> None:
        self.current = current
        self.reads: list[int] = []

    async def __call__(self, epoch: int) -> bool:
        self.reads.append(epoch)
        return epoch == self.current


def test_fence_refuses_epochs_below_the_highest_seen() -> None:
    etcd = Etcd(current=10)
    fence = EpochFence(etcd)
    asyncio.run(fence.admit(10))  # confirmed in etcd: the bar rises to it
    fence.observe(41)  # seen in etcd: a newer coordinator was elected
    with pytest.raises(StaleEpochError, match=r"epoch 10.*epoch 41"):
        asyncio.run(fence.admit(10))
    asyncio.run(fence.admit(41))  # the current one passes, without a read
    assert etcd.reads == [10]
    etcd.current = 57
    asyncio.run(fence.admit(57))  # a newer one, confirmed, passes and raises the bar
    with pytest.raises(StaleEpochError):
        asyncio.run(fence.admit(41))
    assert fence.highest == 57


def test_a_higher_epoch_that_etcd_does_not_confirm_is_refused_and_leaves_the_bar() -> None:
    etcd = Etcd(current=41)
    fence = EpochFence(etcd)
    fence.observe(41)
    for bogus in (2**62, 42, 10**6):
        with pytest.raises(UnknownEpochError, match=rf"epoch {bogus}: etcd says"):
            asyncio.run(fence.admit(bogus))
    assert fence.highest == 41 and fence.unknown_refused == 3
    # The real coordinator is still obeyed: the poisoning did not raise the bar.
    asyncio.run(fence.admit(41))
    # Negative control: the same high epoch, once etcd confirms it, is admitted.
    etcd.current = 2**62
    asyncio.run(fence.admit(2**62))
    assert fence.highest == 2**62


def test_without_a_verifier_and_in_the_sync_check_a_higher_epoch_is_refused() -> None:
    fence = EpochFence()
    fence.observe(41)
    with pytest.raises(UnknownEpochError):
        fence.check(42)
    with pytest.raises(UnknownEpochError):
        asyncio.run(fence.admit(42))
    fence.check(41)
    assert fence.highest == 41


def test_a_restored_etcd_lowers_the_bar_to_its_coordinator_and_no_further() -> None:
    """etcd restored from a snapshot answers at a revision below the epochs seen: the bar
    drops to the coordinator elected since; a coordinator deposed before the restore (an
    epoch between, or the old bar) stays refused, and a running etcd never lowers it."""
    etcd = Etcd(current=1519)
    fence = EpochFence(etcd)
    fence.observe(1519)
    # A running etcd answers at revisions at or above every epoch it handed out.
    assert not fence.rewound(1519, 1519) and not fence.rewound(2000, 1519)
    assert fence.highest == 1519 and fence.rewinds == 0
    # Negative control: before the restore is noticed, the new coordinator is refused.
    with pytest.raises(StaleEpochError):
        asyncio.run(fence.admit(19))
    etcd.current = 19
    assert fence.rewound(revision=40, epoch=19)
    assert fence.highest == 19 and fence.rewinds == 1
    asyncio.run(fence.admit(19))
    # The coordinator of before the restore: above the bar now, and etcd does not confirm it.
    with pytest.raises(UnknownEpochError):
        asyncio.run(fence.admit(1519))
    with pytest.raises(StaleEpochError):
        asyncio.run(fence.admit(7))  # below the new coordinator's: deposed
    # No coordinator elected yet in the restored etcd: the bar drops to nothing, and the
    # first one etcd confirms raises it.
    fence.observe(2500)
    assert fence.rewound(revision=60, epoch=None) and fence.highest == 0
    etcd.current = 61
    asyncio.run(fence.admit(61))
    assert fence.highest == 61

from __future__ import annotations

import pytest

from lumend.cluster.fencing import EpochFence, StaleEpochError


def test_fence_refuses_epochs_below_the_highest_seen() -> None:
    fence = EpochFence()
    fence.check(10)
    fence.observe(41)  # seen in etcd: a newer coordinator was elected
    with pytest.raises(StaleEpochError, match=r"epoch 10.*epoch 41"):
        fence.check(10)
    fence.check(41)  # the current one passes
    fence.check(57)  # a newer one passes and raises the bar
    with pytest.raises(StaleEpochError):
        fence.check(41)
    assert fence.highest == 57

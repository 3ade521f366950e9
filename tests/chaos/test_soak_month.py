"""A month of heartbeats compressed (marked `slow_chaos`: about 16 minutes, so CI runs the
ten-hour soak of tests/integration/test_etcd_heartbeats.py instead and this one runs with
LUMEN_SLOW_CHAOS=1). Same soak: 4 nodes x 16 workers whose records change every compressed
minute, the coordinator compacting every 5 minutes, real etcd with its own auto-compaction
off. What months of production would show and ten hours cannot: a slow leak across
thousands of compactions (the database must stay at its level of the first day)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from lumenctl.localcluster import EtcdCluster
from tests.integration.test_etcd_heartbeats import COMPACT_EVERY_S, STEP_S, MiB, soak

pytestmark = [pytest.mark.etcd, pytest.mark.slow_chaos]

DAYS = 30
STEPS = int(DAYS * 24 * 3600 / STEP_S)


@pytest.mark.timeout(3600)  # about 16 minutes here: 43 200 compressed minutes
def test_a_compressed_month_of_heartbeats_keeps_etcds_database_at_its_first_days_size(
        tmp_path: Path) -> None:
    etcd = EtcdCluster(tmp_path, auto_compaction_retention=None).start()
    try:
        sizes = asyncio.run(soak(etcd.endpoints, compact=True, seed=7, steps=STEPS))
    finally:
        etcd.stop()
    daily = int(24 * 3600 / COMPACT_EVERY_S)
    per_day = sizes[daily - 1::daily]
    print(f"etcd db size at the end of each compressed day: "
          f"{[round(s / MiB, 1) for s in per_day]} MiB")
    assert len(per_day) == DAYS, per_day
    # Bounded: the other days add (almost) nothing to the first day's database.
    assert max(sizes[daily:]) <= per_day[0] * 1.1 + MiB, per_day

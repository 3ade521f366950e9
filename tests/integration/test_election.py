"""Election and fencing against a real etcd: the transactions that enforce the rule."""

from __future__ import annotations

import asyncio

from lumenctl.localcluster import EtcdCluster
from lumend.cluster.election import Election
from lumend.cluster.keys import Keys
from lumend.cluster.models import CoordinatorRecord
from lumend.cluster.store import EtcdStore, Put

KEYS = Keys("t")


def record(node: str) -> CoordinatorRecord:
    return CoordinatorRecord(node=node, address="127.0.0.1", rpc="127.0.0.1:1", elected_at=0.0)


def test_one_winner_and_epoch_is_create_revision(etcd: EtcdCluster) -> None:
    async def go() -> None:
        store = EtcdStore(etcd.endpoints)
        election = Election(store, KEYS)
        lease_a, lease_b = await store.grant_lease(10), await store.grant_lease(10)
        won_a, won_b = await asyncio.gather(
            election.campaign(record("a"), lease_a), election.campaign(record("b"), lease_b)
        )
        assert (won_a is None) != (won_b is None), "exactly one campaign must win"
        kv = await store.get(KEYS.coordinator)
        assert kv is not None
        assert kv.create_revision == (won_a or won_b)
        assert kv.lease == (lease_a if won_a else lease_b)
        # A repeated campaign with the winner's own lease (a retried request) finds its epoch.
        winner_lease = lease_a if won_a else lease_b
        winner = "a" if won_a else "b"
        assert await election.campaign(record(winner), winner_lease) == kv.create_revision
        await store.close()

    asyncio.run(go())


def test_deposed_coordinator_cannot_write_or_resign(etcd: EtcdCluster) -> None:
    async def go() -> None:
        store = EtcdStore(etcd.endpoints)
        election = Election(store, KEYS)
        lease_a = await store.grant_lease(10)
        epoch_a = await election.campaign(record("a"), lease_a)
        assert epoch_a is not None
        assert await election.guarded(epoch_a, [Put(KEYS.root + "probe", b"a")])

        await store.revoke_lease(lease_a)  # as if a's lease expired while it was paused
        lease_b = await store.grant_lease(10)
        epoch_b = await election.campaign(record("b"), lease_b)
        assert epoch_b is not None and epoch_b > epoch_a

        # The deposed coordinator's writes and resignation are refused...
        assert not await election.guarded(epoch_a, [Put(KEYS.root + "probe", b"stale")])
        assert not await election.resign(epoch_a)
        probe = await store.get(KEYS.root + "probe")
        assert probe is not None and probe.value == b"a"
        kv = await store.get(KEYS.coordinator)
        assert kv is not None and kv.create_revision == epoch_b
        # ...while the current one's go through (the control: the guard is not just "deny").
        assert await election.guarded(epoch_b, [Put(KEYS.root + "probe", b"b")])
        assert await election.resign(epoch_b)
        assert await store.get(KEYS.coordinator) is None
        await store.close()

    asyncio.run(go())


def test_store_rotates_past_a_dead_endpoint(etcd: EtcdCluster) -> None:
    from lumenctl.localcluster import free_ports

    async def go() -> None:
        (dead,) = free_ports(1)
        store = EtcdStore([f"http://127.0.0.1:{dead}", *etcd.endpoints], request_timeout_s=1.0)
        await store.put(KEYS.root + "x", b"1")
        kv = await store.get(KEYS.root + "x")
        assert kv is not None and kv.value == b"1"
        await store.close()

    asyncio.run(go())

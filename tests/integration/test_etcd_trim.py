"""A newly elected coordinator facing 10 000 events and 200 joins in one cycle: elected once,
stays, and leaves the events at the limit (real etcd, which refuses a transaction of more
than 128 operations; in-process HA loops, the daemon's code)."""

from __future__ import annotations

import asyncio

from lumenctl.localcluster import EtcdCluster
from lumend.cluster.agent import EVENTS_KEPT, AgentTiming, ClusterAgent, NodeIdentity
from lumend.cluster.keys import Keys
from lumend.cluster.models import CoordinatorStatus, Event, NodeRecord, encode_value
from lumend.cluster.store import MAX_TXN_OPS, EtcdStore, Put, StoreError

KEYS = Keys("trim")
OLD_EVENTS = 10_100
JOINS = 200


def identity(name: str) -> NodeIdentity:
    return NodeIdentity(name=name, address="127.0.0.1", gateway="127.0.0.1:1",
                        rpc="127.0.0.1:2", checkpoint="127.0.0.1:3", metrics="127.0.0.1:4")


def node(name: str) -> NodeRecord:
    return NodeRecord(name=name, address="127.0.0.1", pid=1, version="0", started_at=0,
                      updated_at=0, gateway="g", rpc="r", checkpoint="c", metrics="m")


async def put_all(store: EtcdStore, puts: list[Put]) -> None:
    for i in range(0, len(puts), MAX_TXN_OPS):
        await store.txn([], puts[i:i + MAX_TXN_OPS])


def test_10000_events_and_200_joins_in_one_cycle_elect_one_coordinator_that_stays(
        etcd: EtcdCluster) -> None:
    async def scenario() -> None:
        store = EtcdStore(etcd.endpoints)
        try:
            # History of a long-lived cluster: more events than kept, and 200 nodes that
            # joined since the last coordinator wrote its member list (a restart wave).
            await put_all(store, [
                Put(KEYS.event(1_000_000 + i, "old", i % 10000), encode_value(Event(
                    at=1000.0 + i / 1000, kind="node_left", source="old", message=f"e{i}")))
                for i in range(OLD_EVENTS)])
            await store.put(KEYS.coordinator_status, encode_value(CoordinatorStatus(
                node="gone", epoch=1, at=0, decision="", members=[])))
            lease = await store.grant_lease(30)
            await put_all(store, [Put(KEYS.node(f"joined-{i:03d}"), encode_value(
                node(f"joined-{i:03d}")), lease) for i in range(JOINS)])

            agents = [ClusterAgent(store, KEYS, identity(f"n{i}"), AgentTiming.for_ttl(5))
                      for i in range(2)]
            stop = asyncio.Event()
            tasks = [asyncio.create_task(a.run(stop)) for a in agents]
            try:
                for _ in range(200):  # up to 10 s for both to have cycled a few times
                    await asyncio.sleep(0.05)
                    if min(a.cycles for a in agents) >= 4 and any(a.is_coordinator
                                                                   for a in agents):
                        break
                await asyncio.sleep(1.5)  # more cycles: the coordinator must stay
            finally:
                stop.set()
                await asyncio.gather(*tasks)
            leaders = [a for a in agents if a.is_coordinator]
            statuses = [a.status for a in agents]
            assert len(leaders) == 1, statuses
            assert sum(a.elections_won for a in agents) == 1, statuses
            assert sum(a.step_downs for a in agents) == 0, statuses
            assert leaders[0].trim_failures == 0

            events = await store.get_prefix(KEYS.events)
            # The newest 1000 as of the trim, and what the agents wrote since (an election, a
            # join under load; the next trim takes them).
            assert EVENTS_KEPT <= len(events.kvs) <= EVENTS_KEPT + 10, len(events.kvs)
            joined = [kv for kv in events.kvs if b'"kind":"node_joined"' in kv.value]
            assert len(joined) == JOINS + 2  # the 200 and the two agents' own nodes
            # The oldest were dropped, the newest kept (keys sort by time).
            assert events.kvs[-1].key > events.kvs[0].key
            kept_old = [kv for kv in events.kvs if b'"source":"old"' in kv.value]
            newest_old = max(kept_old, key=lambda kv: kv.key).value
            assert f'"message":"e{OLD_EVENTS - 1}"'.encode() in newest_old
            assert b'"message":"e0"' not in b"".join(kv.value for kv in kept_old)
        finally:
            await store.close()

    asyncio.run(scenario())


class TrimRefused(EtcdStore):
    """Real etcd, but every listing of the events fails as a refused request would."""

    def __init__(self, endpoints: list[str]) -> None:
        super().__init__(endpoints)
        self.refused = 0

    async def keys(self, prefix: str, *, limit: int = 0,
                   newest_first: bool = False) -> list[str]:
        self.refused += 1
        raise StoreError(f"etcd list keys {prefix}: INVALID_ARGUMENT: refused (test)")


def test_a_coordinator_that_cannot_trim_keeps_coordinating(etcd: EtcdCluster) -> None:
    async def scenario() -> None:
        store = TrimRefused(etcd.endpoints)
        try:
            await put_all(store, [Put(KEYS.event(1_000_000 + i, "old", i), b"{}")
                                  for i in range(EVENTS_KEPT + 5)])
            agent = ClusterAgent(store, KEYS, identity("n1"), AgentTiming.for_ttl(5),
                                 trim_every_s=0.0)
            for _ in range(5):
                await agent.cycle()
            assert agent.is_coordinator, agent.status
            assert agent.elections_won == 1 and agent.step_downs == 0
            assert agent.trim_failures == store.refused >= 4
        finally:
            await store.close()

    asyncio.run(scenario())

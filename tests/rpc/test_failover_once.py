"""A failover intent is carried out at most once, whoever asks (the coordinator's order, a
repeat of it, the node acting alone, the node after a restart), and the node acts alone
only after `alone_after_s` without a coordinator. Real etcd, a real worker supervisor with
sim engines."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from lumenctl.localcluster import EtcdCluster
from lumend.cluster.keys import Keys
from lumend.cluster.models import CoordinatorRecord, Intent, encode_value
from lumend.cluster.store import EtcdStore
from lumend.cluster.view import ClusterView, build_view
from lumend.failover.intents import FailoverIntents, IntentGone, Leaderless

from ..failover.test_supervisor import make_supervisor, running, slot_in, wait_for

KEYS = Keys("once")


@pytest.fixture
def etcd(tmp_path: Path) -> Iterator[EtcdCluster]:
    cluster = EtcdCluster(tmp_path / "etcd", size=1)
    try:
        yield cluster.start()
    finally:
        cluster.stop()


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


async def events(store: EtcdStore, kind: str) -> list[bytes]:
    return [kv.value for kv in (await store.get_prefix(KEYS.events)).kvs
            if f'"kind":"{kind}"'.encode() in kv.value]


def test_an_intent_runs_once_and_the_node_acts_alone_only_without_a_coordinator(
        etcd: EtcdCluster, tmp_path: Path) -> None:
    async def scenario() -> None:
        store = EtcdStore(etcd.endpoints)
        sup = make_supervisor(tmp_path)
        views: list[ClusterView] = []

        async def refresh() -> None:
            views.append(build_view(KEYS, await store.get_prefix(KEYS.root)))

        clock = Clock()
        intents = FailoverIntents("node-1", store, KEYS, {"w0": sup},
                                  lambda: views[-1] if views else None, alone_after_s=3.0,
                                  leaderless=Leaderless(clock))
        try:
            async with running(sup):
                await wait_for(lambda: slot_in(sup, "active") is not None
                               and slot_in(sup, "standby") is not None, 30, "active + standby")
                first = slot_in(sup, "active")
                assert first is not None
                asked = time.time()
                intent = Intent(kind="failover", target="w0", target_kind="worker",
                                requested_at=asked, requested_by="test")
                await store.put(KEYS.intent("failover", "w0"), encode_value(intent))
                # A coordinator is elected (a key without a lease stands in for one whose
                # node is stopped): the node never acts alone, however long it waits.
                await store.put(KEYS.coordinator, encode_value(CoordinatorRecord(
                    node="node-9", address="127.0.0.9", rpc="127.0.0.9:1", elected_at=0)))
                await refresh()
                for clock.now in (0.0, 10.0, 100.0):
                    assert intents.act_alone() == []
                # None elected: not before `alone_after_s` has passed ...
                await store.delete(KEYS.coordinator)
                await refresh()
                for clock.now in (100.0, 102.0, 103.0):
                    assert intents.act_alone() == []
                assert await store.get(KEYS.intent("failover", "w0")) is not None
                # ... then once, while the coordinator's order for the same intent (late)
                # and a repeat of it arrive: one switchover, one outcome for all three.
                clock.now = 103.5
                alone = intents.act_alone()
                assert len(alone) == 1
                assert intents.act_alone() == []  # the same view again: already started
                outcomes = await asyncio.gather(
                    alone[0], intents.carry_out("w0", asked, "ordered by coordinator epoch 7"),
                    intents.carry_out("w0", asked, "ordered by coordinator epoch 7"))
                assert outcomes[0] == outcomes[1] == outcomes[2]
                assert outcomes[0][0] != first.spec.engine_id
                assert intents.carried_out == {"coordinator": 0, "alone": 1}
                assert await store.get(KEYS.intent("failover", "w0")) is None
                done = await events(store, "failover_done")
                assert len(done) == 1 and b"carried out by node-1 alone" in done[0]
                # A restarted node (nothing remembered) ordered again with the old intent:
                # it is claimed already, so nothing happens.
                restarted = FailoverIntents("node-1", store, KEYS, {"w0": sup},
                                            lambda: views[-1], alone_after_s=3.0)
                with pytest.raises(IntentGone):
                    await restarted.carry_out("w0", asked, "ordered by coordinator epoch 8")
                assert len(await events(store, "failover_done")) == 1
                # The supervisor's slot states follow its probes (one per tick).
                await wait_for(lambda: (lambda a: a is not None
                                        and a.spec.engine_id == outcomes[0][0])(
                                   slot_in(sup, "active")),
                               10, "the new engine active in the supervisor's view")
        finally:
            await store.close()

    asyncio.run(scenario())

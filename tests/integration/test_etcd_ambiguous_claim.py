"""A failover claim whose commit landed but whose answer was lost is read back, not sent
again blind: the switchover runs exactly once. Real etcd and a real worker supervisor with
sim engines; the only thing made up is the lost answer, raised by the etcd client exactly
as it raises a deadline (ConnectionTimeoutError) after the real transaction has run."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyetcd.exceptions
import pyetcd.transactions
import pytest

from lumenctl.localcluster import EtcdCluster, free_ports
from lumend.cluster.keys import Keys
from lumend.cluster.models import Intent, encode_value
from lumend.cluster.store import (
    CreateRevisionIs,
    Delete,
    EtcdStore,
    StoreError,
    StoreUnavailable,
)
from lumend.failover.intents import FailoverIntents, IntentGone

from ..failover.test_supervisor import make_supervisor, running, slot_in, wait_for

KEYS = Keys("ambiguous")
INTENT = KEYS.intent("failover", "w0")


@pytest.fixture
def etcd(tmp_path: Path) -> Iterator[EtcdCluster]:
    cluster = EtcdCluster(tmp_path / "etcd", size=1)
    try:
        yield cluster.start()
    finally:
        cluster.stop()


class LostAnswer:
    """The etcd client, but the first claim of the intent loses its answer: `commit`
    True runs the real transaction first (it lands), False never sends it; `meanwhile`
    runs before the answer is lost (another node acting)."""

    def __init__(self, client: Any, owner: FlakyStore) -> None:
        self._client = client
        self._owner = owner

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)

    def transaction(self, compare: Any, success: Any = None, failure: Any = None) -> Any:
        owner = self._owner
        claim = any(isinstance(o, pyetcd.transactions.Delete) and o.key == INTENT
                    for o in success or [])
        if claim and not owner.lost:
            owner.lost += 1
            if owner.commit:
                owner.sent.append(self._client.transaction(compare, success, failure)[0])
            if owner.meanwhile is not None:
                owner.meanwhile(self._client)
            raise pyetcd.exceptions.ConnectionTimeoutError()
        result = self._client.transaction(compare, success, failure)
        if claim:
            owner.sent.append(result[0])
        return result


class FlakyStore(EtcdStore):
    def __init__(self, endpoints: list[str], commit: bool, meanwhile: Any = None) -> None:
        super().__init__(endpoints)
        self.commit = commit
        self.meanwhile = meanwhile
        self.lost = 0  # answers lost (only ever the first claim's)
        self.sent: list[bool] = []  # claims that reached etcd: did each succeed

    def _new_client(self, index: int) -> Any:
        return LostAnswer(super()._new_client(index), self)


async def kinds(store: EtcdStore) -> list[str]:
    found = []
    for kv in (await store.get_prefix(KEYS.events)).kvs:
        for kind in ("failover_claimed", "failover_done", "failover_refused"):
            if f'"kind":"{kind}"'.encode() in kv.value:
                found.append(kind)
    return found


async def write_intent(store: EtcdStore) -> float:
    asked = time.time()
    await store.put(INTENT, encode_value(Intent(kind="failover", target="w0",
                                                target_kind="worker", requested_at=asked,
                                                requested_by="test")))
    return asked


def test_a_claim_that_committed_but_lost_its_answer_switches_over_once(
        etcd: EtcdCluster, tmp_path: Path) -> None:
    async def scenario() -> None:
        plain = EtcdStore(etcd.endpoints)
        flaky = FlakyStore(etcd.endpoints, commit=True)
        sup = make_supervisor(tmp_path)
        intents = FailoverIntents("node-1", flaky, KEYS, {"w0": sup}, lambda: None,
                                  alone_after_s=3.0)
        try:
            async with running(sup):
                await wait_for(lambda: slot_in(sup, "active") is not None
                               and slot_in(sup, "standby") is not None, 30, "active + standby")
                first = slot_in(sup, "active")
                assert first is not None
                asked = await write_intent(plain)
                active, _ = await intents.carry_out("w0", asked, "ordered by coordinator 7")
                assert active != first.spec.engine_id
                # The claim was sent once and landed; its answer was lost; nothing resent.
                assert flaky.lost == 1
                assert flaky.sent == [True]
                assert await plain.get(INTENT) is None
                assert sorted(await kinds(plain)) == ["failover_claimed", "failover_done"]
                assert intents.carried_out["coordinator"] == 1
        finally:
            await flaky.close()
            await plain.close()

    asyncio.run(scenario())


def test_a_claim_lost_before_it_landed_is_sent_again_and_one_claimed_elsewhere_is_not(
        etcd: EtcdCluster, tmp_path: Path) -> None:
    """Negative controls: the read-back tells the three cases apart."""

    async def scenario() -> None:
        plain = EtcdStore(etcd.endpoints)
        sup = make_supervisor(tmp_path)
        try:
            # Another node claims the intent while our claim's answer is lost (ours never
            # landed): no switchover here.
            elsewhere = FlakyStore(etcd.endpoints, commit=False,
                                   meanwhile=lambda client: client.delete(INTENT))
            intents = FailoverIntents("node-1", elsewhere, KEYS, {"w0": sup}, lambda: None,
                                      alone_after_s=3.0)
            asked = await write_intent(plain)
            with pytest.raises(IntentGone, match="claimed or withdrawn"):
                await intents.carry_out("w0", asked, "ordered by coordinator 7")
            assert await kinds(plain) == []
            await elsewhere.close()
            # Our claim never landed and nobody else took the intent: sent again, claimed.
            unsent = FlakyStore(etcd.endpoints, commit=False)
            intents = FailoverIntents("node-1", unsent, KEYS, {"w0": sup}, lambda: None,
                                      alone_after_s=3.0)
            async with running(sup):
                await wait_for(lambda: slot_in(sup, "active") is not None
                               and slot_in(sup, "standby") is not None, 30, "active + standby")
                asked = await write_intent(plain)
                await intents.carry_out("w0", asked, "ordered by coordinator 7")
                assert unsent.sent == [True] and unsent.lost == 1
                assert sorted(await kinds(plain)) == ["failover_claimed", "failover_done"]
            await unsent.close()
        finally:
            await plain.close()

    asyncio.run(scenario())


def test_a_claim_refused_by_a_dead_endpoint_moves_on_and_is_not_ambiguous(
        etcd: EtcdCluster) -> None:
    """A connection refused before anything was sent is surely not applied: the
    non-idempotent claim goes to the next endpoint instead of being reported ambiguous."""
    async def scenario() -> None:
        plain = EtcdStore(etcd.endpoints)
        rotating = EtcdStore([f"http://127.0.0.1:{free_ports(1)[0]}", *etcd.endpoints])
        try:
            await write_intent(plain)
            kv = await plain.get(INTENT)
            assert kv is not None
            result = await rotating.txn([CreateRevisionIs(INTENT, kv.create_revision)],
                                        [Delete(INTENT)], idempotent=False)
            assert result.succeeded and await plain.get(INTENT) is None
        finally:
            await rotating.close()
            await plain.close()

    asyncio.run(scenario())


class ReadBackFails(FlakyStore):
    """The claim lands and its answer is lost, and then etcd cannot be read for a while
    either: the first read-back of the claim's event fails as an unreachable etcd does."""

    def __init__(self, endpoints: list[str]) -> None:
        super().__init__(endpoints, commit=True)
        self.read_back_failures = 0

    async def get(self, key: str) -> Any:
        if key.startswith(KEYS.events) and not self.read_back_failures:
            self.read_back_failures += 1
            raise StoreUnavailable(self.endpoints, 3, 6.0, "etcd connection timeout (test)")
        return await super().get(key)


def test_a_claim_whose_read_back_failed_too_is_settled_by_the_next_order(
        etcd: EtcdCluster, tmp_path: Path) -> None:
    async def scenario() -> None:
        plain = EtcdStore(etcd.endpoints)
        flaky = ReadBackFails(etcd.endpoints)
        sup = make_supervisor(tmp_path)
        intents = FailoverIntents("node-1", flaky, KEYS, {"w0": sup}, lambda: None,
                                  alone_after_s=3.0)
        try:
            async with running(sup):
                await wait_for(lambda: slot_in(sup, "active") is not None
                               and slot_in(sup, "standby") is not None, 30, "active + standby")
                asked = await write_intent(plain)
                with pytest.raises(StoreError):  # etcd could not say: the order fails
                    await intents.carry_out("w0", asked, "ordered by coordinator 7")
                assert await plain.get(INTENT) is None  # ... but the claim had landed
                assert await kinds(plain) == ["failover_claimed"]
                # The coordinator orders again: the node finds its own claim, switches once.
                await intents.carry_out("w0", asked, "ordered by coordinator 7")
                assert sorted(await kinds(plain)) == ["failover_claimed", "failover_done"]
                assert flaky.sent == [True] and flaky.read_back_failures == 1
        finally:
            await flaky.close()
            await plain.close()

    asyncio.run(scenario())

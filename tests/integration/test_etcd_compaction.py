"""The coordinator's compaction is fenced: the current coordinator compacts etcd's history,
a deposed one that still believes it leads (its lease looks fresh to it, its view is old)
compacts nothing (real etcd; history read back with etcdctl)."""

from __future__ import annotations

import asyncio
import os
import subprocess

from lumenctl.localcluster import EtcdCluster
from lumend.cluster.agent import AgentTiming, ClusterAgent, NodeIdentity
from lumend.cluster.keys import Keys
from lumend.cluster.store import EtcdStore

KEYS = Keys("compact")


def identity(name: str) -> NodeIdentity:
    return NodeIdentity(name=name, address="127.0.0.1", gateway="127.0.0.1:1",
                        rpc="127.0.0.1:2", checkpoint="127.0.0.1:3", metrics="127.0.0.1:4")


def history_at(etcd: EtcdCluster, revision: int) -> str:
    """etcdctl's answer for /probe as of `revision` ("compacted" once it is gone)."""
    env = {**os.environ, "ETCDCTL_API": "3"}
    out = subprocess.run(["etcdctl", "--endpoints", etcd.endpoints[0], "get", "/probe",
                          f"--rev={revision}", "--print-value-only"], capture_output=True,
                         text=True, env=env, timeout=10)
    return out.stdout.strip() if out.returncode == 0 else out.stderr


def test_only_the_current_coordinator_compacts(etcd: EtcdCluster) -> None:
    async def scenario() -> tuple[int, int, str]:
        store = EtcdStore(etcd.endpoints)
        try:
            # Each check is called by the test (besides the one every election makes, which
            # notes the revision the next check compacts to).
            a, b = (ClusterAgent(store, KEYS, identity(n), AgentTiming.for_ttl(10),
                                 compact_every_s=float("inf"), compact_keep_revisions=0)
                    for n in ("a", "b"))
            await a.cycle()
            epoch_a = a.epoch
            assert epoch_a is not None and a.compacted_revision == 0
            first = await store.put("/probe", b"v1")
            for i in range(2, 6):
                await store.put("/probe", f"v{i}".encode())
            # a's lease lapses (a paused host): the key goes, b is elected; a has not
            # noticed (no cycle since), its lease still looks fresh to its own clock.
            assert a.lease.lease_id is not None
            await store.revoke_lease(a.lease.lease_id)
            await b.cycle()
            assert b.epoch is not None and b.epoch > epoch_a
            assert a.epoch == epoch_a and a.lease.confident()
            await a._compact(epoch_a)
            await a._compact(epoch_a)
            assert a.compacted_revision == 0, "a deposed coordinator compacted etcd"
            kept = history_at(etcd, first)
            # The current coordinator compacts, to the revision its election noted.
            await store.put("/probe", b"v6")
            await b._compact(b.epoch)
            return first, b.compacted_revision, kept
        finally:
            await store.close()

    first, compacted, kept_after_deposed = asyncio.run(scenario())
    assert kept_after_deposed == "v1"  # the deposed node's checks left the history
    assert compacted > first
    assert "compacted" in history_at(etcd, first)
    assert history_at(etcd, compacted) == "v5"

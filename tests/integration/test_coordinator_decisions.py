"""The `decisions` setting through real parts (issues 15/16): real etcd holding the workers'
heartbeat records and the cluster's `config`, the view built from it as every node builds
it, the coordinator's decisions behind real gRPC, a client admitting a burst.

One of three workers holds 40 GiB of its peers' checkpoints. With `decisions paper` the
burst sends it nothing (L_hat counts the bytes as load: the chaos lab's 4/4/0); with the
default `cost_aware` the burst is balanced (max/mean within 1.5x)."""

from __future__ import annotations

import asyncio
from collections import Counter
from typing import Any

import grpc
import pytest

from lumenctl.localcluster import EtcdCluster
from lumend.cluster.keys import Keys
from lumend.cluster.models import ClusterSettings, encode_value
from lumend.cluster.store import EtcdStore
from lumend.cluster.view import ClusterView, build_view
from lumend.coordinator.service import CoordinatorService
from lumend.coordinator.settings import parse_setting
from lumend.rpc import lumen_pb2_grpc as stubs
from lumend.rpc.client import CoordinatorClient
from lumend.rpc.server import CoordinatorServicer

from ..unit.test_coordinator_loadbook import GIB, node, worker

pytestmark = pytest.mark.etcd

BURST = 60


def test_a_burst_through_etcd_and_grpc_balances_only_cost_aware(etcd: EtcdCluster) -> None:
    keys = Keys("t")

    async def scenario() -> dict[str, Counter[str]]:
        store = EtcdStore(etcd.endpoints, request_timeout_s=2.0)
        current: list[ClusterView] = []
        service = CoordinatorService("a", 1, lambda: current[-1] if current else None)
        servicer = CoordinatorServicer(lambda: service, lambda: "nobody",
                                       confidence=lambda _: None)
        server: Any = grpc.aio.server()
        stubs.add_CoordinatorServicer_to_server(servicer, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        client = CoordinatorClient(f"127.0.0.1:{port}")
        served: dict[str, Counter[str]] = {}
        try:
            for name in ("a", "b", "c"):
                await store.put(keys.node(name), encode_value(node(name)))
            for w in (worker("a0", "a", held=40 * GIB, budget=64 * GIB),
                      worker("b0", "b", budget=64 * GIB), worker("c0", "c", budget=64 * GIB)):
                await store.put(keys.worker(w.name), encode_value(w))
            settings = ClusterSettings()
            for decisions in ("paper", "cost_aware"):  # as `lumenctl config set` writes it
                settings = parse_setting(settings, "decisions", decisions)
                await store.put(keys.config, encode_value(settings))
                current.append(build_view(keys, await store.get_prefix(keys.root)))
                assert current[-1].settings is not None
                assert current[-1].settings.decisions == decisions
                counts: Counter[str] = Counter()
                for i in range(BURST):
                    a = await client.admit(f"{decisions}-{i}", None, "test")
                    assert a.target is not None
                    counts[a.target.worker] += 1
                for i in range(BURST):
                    await client.finish(f"{decisions}-{i}")
                served[decisions] = counts
        finally:
            await client.close()
            await server.stop(0)
            await store.close()
        return served

    served = asyncio.run(scenario())
    # Negative control: the paper's L_hat sends nothing to the worker holding checkpoints.
    assert served["paper"]["a0"] == 0 and sum(served["paper"].values()) == BURST
    cost = served["cost_aware"]
    assert set(cost) == {"a0", "b0", "c0"}
    assert max(cost.values()) / (BURST / 3) <= 1.5, cost

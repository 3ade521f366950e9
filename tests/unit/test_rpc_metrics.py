"""The coordinator's refusals and the gateway's engine-pool waits reach /metrics: an
operator sees a coordinator refusing calls because it is not sure of its lease (etcd slow or
unreachable) apart from callers whose view is stale."""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, generate_latest

from lumend.cluster.fencing import EpochFence
from lumend.rpc.agent_service import AgentService
from lumend.rpc.metrics import RpcCollector
from lumend.rpc.server import CoordinatorServicer


async def _no_failover(*_: Any) -> Any:
    raise AssertionError("no failover here")


def test_refused_calls_are_exported_by_why() -> None:
    servicer = CoordinatorServicer(lambda: None, lambda: "nobody")
    agent = AgentService("n1", EpochFence(), lambda: [], lambda: "ok", failover=_no_failover)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(RpcCollector(agent, lambda: None, None, servicer))
    text = generate_latest(registry).decode()
    assert 'lumen_coordinator_calls_refused_total{why="lease"} 0.0' in text
    servicer.refused["lease"] += 4
    servicer.refused["not_coordinator"] += 1
    text = generate_latest(registry).decode()
    assert 'lumen_coordinator_calls_refused_total{why="lease"} 4.0' in text
    assert 'lumen_coordinator_calls_refused_total{why="not_coordinator"} 1.0' in text


def test_the_gateways_pool_waits_and_timeouts_are_exported() -> None:
    from lumend.cluster.view import ClusterView
    from lumend.gateway.server import Gateway, GatewayTiming
    from lumend.metrics import GatewayCollector

    gateway = Gateway(lambda: ClusterView(cluster="t", revision=0, workers={}),
                      GatewayTiming())
    registry = CollectorRegistry(auto_describe=False)
    registry.register(GatewayCollector(gateway))
    gateway.counters.pool.waits, gateway.counters.pool.timeouts = 7, 2
    text = generate_latest(registry).decode()
    assert "lumen_gateway_pool_waits_total 7.0" in text
    assert "lumen_gateway_pool_timeouts_total 2.0" in text

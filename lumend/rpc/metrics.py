"""Prometheus metrics of the node's gRPC services."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from lumend.coordinator.commands import AgentCommands
from lumend.coordinator.service import CoordinatorService
from lumend.rpc.agent_service import AgentService
from lumend.rpc.server import CoordinatorServicer


class RpcCollector(Collector):
    def __init__(self, agent: AgentService,
                 coordinator: Callable[[], CoordinatorService | None],
                 commands: AgentCommands | None = None,
                 servicer: CoordinatorServicer | None = None) -> None:
        self._agent = agent
        self._coordinator = coordinator
        self._commands = commands
        self._servicer = servicer

    def collect(self) -> Iterator[Metric]:
        yield CounterMetricFamily(
            "lumen_agent_stale_epoch_refused", "Commands refused because they carried the "
            "epoch of a deposed coordinator.", value=self._agent.stale_refused)
        yield CounterMetricFamily(
            "lumen_agent_unconfirmed_epoch_refused", "Commands refused because they carried "
            "an epoch above the highest seen that etcd did not confirm as the coordinator "
            "key's (a forged or mistaken epoch), or etcd could not be read to confirm it.",
            value=self._agent.unknown_refused)
        commands = CounterMetricFamily("lumen_agent_commands", "Coordinator commands this "
                                       "node carried out, by command.", labels=["command"])
        for command, n in sorted(self._agent.commands.items()):
            commands.add_metric([command], n)
        yield commands
        orders = CounterMetricFamily(
            "lumen_coordinator_orders", "Agent commands this node sent as coordinator for "
            "the intents (failover, drain, undrain), by outcome (done, retry, or the refusal's "
            "gRPC code).", labels=["command", "outcome"])
        if self._commands is not None:
            for (command, outcome), n in sorted(self._commands.orders.items()):
                orders.add_metric([command, outcome], n)
        yield orders
        service = self._coordinator()
        decisions = CounterMetricFamily(
            "lumen_coordinator_decisions", "Decisions of this node's coordinator term, by "
            "kind (admit, no_worker, resume, recompute, no_survivor; migrate: a recovery "
            "off a drained worker, also counted as resume or recompute).", labels=["kind"])
        requests = GaugeMetricFamily("lumen_coordinator_requests", "Requests admitted by "
                                     "this node's coordinator and not finished.")
        if service is not None:
            for kind, n in sorted(service.decisions.items()):
                decisions.add_metric([kind], n)
            requests.add_metric([], len(service.requests))
        yield decisions
        yield requests
        refused = CounterMetricFamily(
            "lumen_coordinator_calls_refused", "Admit, Finish, Recover and Progress calls this "
            "node refused, by why: lease (its coordinator was not sure of its lease: etcd "
            "slow or unreachable), not_coordinator (the caller's view was stale).",
            labels=["why"])
        for why in ("lease", "not_coordinator"):
            refused.add_metric([why], 0 if self._servicer is None
                               else self._servicer.refused.get(why, 0))
        yield refused

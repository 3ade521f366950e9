"""A node's control plane, wired in one place: its gRPC server (Agent always, Coordinator
while elected), the gateway's link to the coordinator, and the holder's progress stream."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence

from lumend.checkpoint.holder import HolderService
from lumend.cluster.agent import ClusterAgent
from lumend.cluster.models import WorkerRecord
from lumend.config import NodeConfig
from lumend.coordinator.commands import AgentCommands
from lumend.coordinator.service import CoordinatorService
from lumend.gateway.coordinator import CoordinatorLink, LinkTiming
from lumend.gateway.metrics import CoordinatorLinkCollector
from lumend.rpc.agent_service import AgentService, FailoverFn
from lumend.rpc.metrics import RpcCollector
from lumend.rpc.progress import Holdings, ProgressReporter
from lumend.rpc.server import CoordinatorServicer, RpcBindError, RpcServer
from lumend.rpc.tls import RpcTls

log = logging.getLogger("lumend.rpc")

__all__ = ["ControlPlane", "RpcBindError"]


def rpc_tls(config: NodeConfig) -> RpcTls | None:
    files = config.rpc.tls_files
    return None if files is None else RpcTls(*files)


class ControlPlane:
    def __init__(self, config: NodeConfig, agent: ClusterAgent, holder: HolderService,
                 workers: Callable[[], Sequence[WorkerRecord]],
                 failover: FailoverFn, drained: set[str]) -> None:
        self._config = config
        self._agent = agent
        self._holder = holder
        tls = rpc_tls(config)
        self.coordinator: CoordinatorService | None = None
        self.service = AgentService(config.node.name, agent.fence, workers,
                                    lambda: agent.status, failover, drained)
        servicer = CoordinatorServicer(lambda: self.coordinator, self._following)
        self.server = RpcServer(self.service, servicer, tls)
        # A recovery waits about one lease TTL for a successor when the coordinator dies.
        self.link = CoordinatorLink(
            config.node.name, lambda: agent.view, tls,
            link_timing(config))
        self.progress = ProgressReporter(self._holdings, lambda: agent.view, tls)
        # While elected: the intents in each snapshot become Agent orders to their nodes.
        self.commands = AgentCommands(tls)
        agent.lead_duties.append(self.commands.duty)
        self.collectors = (CoordinatorLinkCollector(self.link),
                           RpcCollector(self.service, lambda: self.coordinator, self.commands,
                                        servicer))
        agent.role_listeners += [self._role_changed, self.commands.role_changed]

    def _role_changed(self, epoch: int | None) -> None:
        if epoch is None:
            if self.coordinator is not None:
                log.info("coordinator service stopped (epoch %d ended)", self.coordinator.epoch)
            self.coordinator = None
            return
        # A new term starts from nothing but etcd: loads and checkpoint bytes from the
        # heartbeats in the view, checkpoints from the holders' progress streams.
        self.coordinator = CoordinatorService(self._config.node.name, epoch,
                                              lambda: self._agent.view)
        log.info("coordinator service started for epoch %d on %s", epoch,
                 self._config.rpc.listen)

    def _following(self) -> str:
        view = self._agent.view
        if view is None or view.coordinator is None:
            return "no coordinator is elected yet"
        c = view.coordinator
        return f"the coordinator is {c.record.node} (epoch {c.epoch}) at {c.record.rpc}"

    def _holdings(self) -> Holdings:
        return {c.ckpt_id: (c.worker, c.nbytes, c.tokens)
                for c in self._holder.store.checkpoints.values()}

    async def start(self) -> None:
        await self.server.start(self._config.rpc.listen)

    async def run(self, stop: asyncio.Event) -> None:
        await self.progress.run(stop)

    async def stop(self) -> None:
        await self.server.stop()


def link_timing(config: NodeConfig) -> LinkTiming:
    """The gateway's coordinator link timing from the node's config: a recovery waits about
    one lease TTL for a successor when the coordinator dies; the call deadlines come from
    `[gateway] admit_deadline_s` (a recovery's is twice an admission's)."""
    return LinkTiming(coordinator_wait_s=config.etcd.lease_ttl_s + 2.0,
                      admit_deadline_s=config.gateway.admit_deadline_s,
                      recover_deadline_s=2 * config.gateway.admit_deadline_s)

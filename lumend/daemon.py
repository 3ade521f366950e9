"""Wires a node together from its config and runs it: the HA loop, systemd notifications and
the watchdog, metrics, config reload on SIGHUP, and a graceful stop on SIGTERM/SIGINT.

A graceful stop, in order: the gateway refuses new requests and `/ready` answers 503 (at once,
in the signal handler); the node resigns its roles and deregisters, so no gateway routes here
any more; the streams in flight (this gateway's, and other gateways' on this node's engines)
finish, for at most `[gateway] drain_s`; then the engines and GMS servers are stopped."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import time
from collections import Counter
from pathlib import Path

import msgspec

from lumend.assist.node import AssistCollector, AssistLinks
from lumend.checkpoint.holder import HolderBindError, HolderConfig, HolderService
from lumend.checkpoint.security import CurveKeys, KeyFileError
from lumend.cluster.agent import AgentTiming, ClusterAgent, NodeIdentity
from lumend.cluster.keys import Keys
from lumend.cluster.models import CheckpointUsage, WorkerRecord
from lumend.cluster.store import EtcdStore, Op, TlsFiles
from lumend.cluster.view import ClusterView
from lumend.config import ConfigError, NodeConfig, load_config
from lumend.engine.adapter import adapter_for
from lumend.failover.intents import DrainStates, FailoverIntents, Leaderless
from lumend.failover.supervisor import WorkerSupervisor
from lumend.gateway import readiness
from lumend.gateway.auth import ApiKeyFileError, load_api_keys
from lumend.gateway.server import Gateway, GatewayBindError, GatewayTiming
from lumend.metrics import (
    CheckpointCollector,
    EngineCollector,
    EtcdHygieneCollector,
    GatewayCollector,
    MetricsBindError,
    MetricsServer,
    NodeCollector,
    NodeMetrics,
)
from lumend.notify import Notifier, Readiness, SystemdLink, watchdog_interval_s
from lumend.reload import LIVE_KEYS, plan_reload
from lumend.rpc.plane import ControlPlane, RpcBindError

log = logging.getLogger("lumend")

class StartupError(Exception):
    """lumend cannot start; the message says why and what to do."""


def identity_of(config: NodeConfig) -> NodeIdentity:
    def advertised(listen: str) -> str:
        host, port = listen.rsplit(":", 1)
        host = host.strip("[]")
        if host in ("0.0.0.0", "::", ""):
            host = config.node.address
        return f"{host}:{port}"

    return NodeIdentity(
        name=config.node.name,
        address=config.node.address,
        gateway=advertised(config.gateway.listen),
        rpc=advertised(config.rpc.listen),
        checkpoint=advertised(config.checkpoint.listen),
        metrics=advertised(config.metrics.listen),
    )


def make_supervisors(config: NodeConfig) -> dict[str, WorkerSupervisor]:
    """One supervisor per configured worker: its GMS server and its engines."""
    return {
        w.name: WorkerSupervisor(
            config.node.name, w, adapter_for(w.engine),
            runtime_dir=Path(config.runtime_dir), log_dir=Path(config.state_dir) / "logs",
            host=config.node.address, checkpoint_keys=config.checkpoint.keys,
        )
        for w in config.workers
    }


def make_holder(config: NodeConfig) -> HolderService:
    """The node's checkpoint holder: `budget_bytes` for each worker of this node, CURVE
    with the cluster's keys unless the config says insecure."""
    ckpt = config.checkpoint
    try:
        curve = CurveKeys.load(ckpt.keys) if ckpt.keys else None
    except KeyFileError as exc:  # checked with the config; changed on disk since
        raise StartupError(f"checkpoint.keys: {exc}") from None
    return HolderService(HolderConfig(
        listen=ckpt.listen, workers=tuple(w.name for w in config.workers),
        budget_bytes=ckpt.budget_bytes, policy=ckpt.eviction, curve=curve,
    ))


def workers_readiness(supervisors: list[WorkerSupervisor]) -> Readiness:
    """Ready when every worker serves or has an engine initialised and standing by."""
    waiting = [s.worker.name for s in supervisors if not s.ready()]
    if waiting:
        return Readiness(False, f"waiting for engines of {', '.join(waiting)}")
    return Readiness(True, f"{len(supervisors)} workers serving or standing by")


def make_store(config: NodeConfig) -> EtcdStore:
    etcd = config.etcd
    return EtcdStore(
        etcd.endpoints,
        request_timeout_s=etcd.request_timeout_s,
        tls=TlsFiles(ca_cert=etcd.ca_cert, cert=etcd.cert, key=etcd.key),
    )


def workers_summary(workers: list[WorkerRecord]) -> str:
    if not workers:
        return "no workers"
    counts = Counter(w.state for w in workers)
    noun = "worker" if len(workers) == 1 else "workers"
    if len(counts) == 1:
        return f"{len(workers)} {noun} {workers[0].state}"
    return f"{len(workers)} {noun}: " + ", ".join(f"{n} {s}" for s, n in sorted(counts.items()))


async def run_node(config: NodeConfig, config_path: Path | None = None) -> None:
    await Node(config, config_path).run()


class Node:
    def __init__(self, config: NodeConfig, config_path: Path | None) -> None:
        self.config = config
        self.config_path = config_path
        self.store = make_store(config)
        self.supervisors = make_supervisors(config)
        self.holder = make_holder(config)
        self.agent = ClusterAgent(
            self.store,
            Keys(config.etcd.cluster),
            identity_of(config),
            AgentTiming.for_ttl(config.etcd.lease_ttl_s, config.etcd.heartbeat_interval_s),
            workers=self.workers,
        )
        self.link = SystemdLink(
            Notifier.from_env(), self.agent,
            lambda: workers_readiness(list(self.supervisors.values())), self.status_text,
            watchdog_s=watchdog_interval_s(),
        )
        self.metrics = NodeMetrics(
            NodeCollector(self.agent, config.node.name, config.etcd.cluster, self.workers,
                          ready=lambda: self.link.readiness().ready),
            EngineCollector(lambda: list(self.supervisors.values())),
            CheckpointCollector(self.holder.stats),
        )
        # Intents are carried out when the coordinator orders it (Agent Failover/Drain); the
        # node acts on them alone only after a lease TTL without any coordinator.
        leaderless, alone_after_s = Leaderless(), float(config.etcd.lease_ttl_s)
        self.intents = FailoverIntents(config.node.name, self.store, Keys(config.etcd.cluster),
                                       self.supervisors, lambda: self.agent.view,
                                       alone_after_s, leaderless)
        self.drains = DrainStates(config.node.name, self.store, Keys(config.etcd.cluster),
                                  lambda: self.agent.view, self.workers, alone_after_s,
                                  leaderless)
        # gRPC: the Agent service, the Coordinator service while elected, the gateway's link
        # to the coordinator and the holder's progress stream (lumend/rpc/plane.py).
        self.plane = ControlPlane(config, self.agent, self.holder, self.workers,
                                  self.intents.carry_out, self.drains.ordered)
        gw = config.gateway
        self.gateway = Gateway(lambda: self.agent.view, coordinator=self.plane.link,
                               timing=GatewayTiming(
                                   first_token_s=gw.first_token_s,
                                   token_deadline_s=gw.token_timeout_s,
                                   recover_within_s=gw.resume_within_s,
                                   client_write_s=gw.client_write_s,
                                   max_streams=gw.max_streams,
                                   pool_wait_s=gw.pool_wait_s,
                                   shadow_wait_s=gw.shadow_wait_s))
        self.gateway.log_admissions = gw.log_admissions
        # GET /ready and the refusal of new requests while stopping (lumend/gateway/readiness.py)
        self.readiness = readiness.NodeReadiness(config.node.name, lambda: self.agent.view)
        readiness.attach(self.gateway, self.readiness)
        self.metrics.registry.register(GatewayCollector(self.gateway))
        self.metrics.registry.register(EtcdHygieneCollector(self.agent))
        for collector in self.plane.collectors:
            self.metrics.registry.register(collector)
        self.agent.cycle_listeners += [self.metrics.observe_cycle, self.link.poke]
        # Draft-assist: the coordinator assigns drafters (Algorithm 3), every node attaches
        # its survivors' engines to theirs and publishes the acceptance.
        self.assist = AssistLinks(lambda: self.agent.view,
                                  lambda: [s.record() for s in self.supervisors.values()])
        self.metrics.registry.register(AssistCollector(self.assist))
        self.agent.lead_duties.append(self._assist_duty)
        self.server = MetricsServer(self.metrics)

    def workers(self) -> list[WorkerRecord]:
        held = self.holder.stats().workers
        records = []
        for s in self.supervisors.values():
            record = s.record()
            usage = held.get(record.name)
            if usage is not None:
                record = msgspec.structs.replace(record, checkpoints=CheckpointUsage(
                    bytes_held=usage.bytes_held, budget_bytes=usage.budget_bytes,
                    requests=usage.requests))
            record = self.drains.decorate(record)
            records.append(self.assist.decorate(record))
        return records

    def _assist_duty(self, view: ClusterView, epoch: int) -> list[Op]:
        coordinator = self.plane.coordinator
        if coordinator is None or coordinator.epoch != epoch:
            return []
        return coordinator.lead_ops(view, Keys(self.config.etcd.cluster))

    def status_text(self) -> str:
        return f"{workers_summary(self.workers())}; {self.agent.status}"

    async def run(self) -> None:
        config = self.config
        stop = asyncio.Event()
        reload_requested = asyncio.Event()
        loop = asyncio.get_running_loop()

        # The supervisors stop their engines on engines_stop, set only once the streams in
        # flight have drained (or drain_s passed); everything else stops on `stop`.
        engines_stop = asyncio.Event()

        def on_stop(sig: signal.Signals) -> None:
            if not stop.is_set():
                self.readiness.drain()  # before anything else: no new request is admitted
                log.info("%s: stopping: new requests refused, /ready answers 503", sig.name)
                self.link.stop(sig.name)
                stop.set()
            elif not engines_stop.is_set():
                log.warning("%s again: not waiting for the streams in flight any longer",
                            sig.name)
                engines_stop.set()

        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, on_stop, sig)
        loop.add_signal_handler(signal.SIGHUP, reload_requested.set)
        log.info(
            "lumend %s: node %s, cluster %r, etcd %s, lease ttl %d s, systemd notify %s, "
            "watchdog %s",
            config.node.name, config.node.name, config.etcd.cluster,
            ", ".join(config.etcd.endpoints), config.etcd.lease_ttl_s,
            self.link_via(), f"{self.link.watchdog_s:g} s" if self.link.watchdog_s else "off",
        )
        try:
            self.gateway.api_keys = load_api_keys(config.gateway.api_keys)
        except ApiKeyFileError as exc:  # checked with the config; changed on disk since
            await self.store.close()
            raise StartupError(f"gateway.api_keys: {exc}") from None
        try:
            await self.server.start(config.metrics.listen)
        except MetricsBindError as exc:
            await self.store.close()
            raise StartupError(str(exc)) from None
        try:
            self.holder.bind()
            await self.gateway.start(config.gateway.listen)
            await self.plane.start()
        except (HolderBindError, GatewayBindError, RpcBindError) as exc:
            self.holder.close()
            await self.gateway.stop()
            await self.server.stop()
            await self.store.close()
            raise StartupError(str(exc)) from None
        tasks = [
            asyncio.create_task(self.link.run(stop), name="systemd-link"),
            asyncio.create_task(self._reloads(stop, reload_requested), name="reload"),
            asyncio.create_task(self.intents.run(stop), name="failover-intents"),
            asyncio.create_task(self.drains.run(stop), name="drain-states"),
            asyncio.create_task(self.plane.run(stop), name="checkpoint-progress"),
            asyncio.create_task(self.holder.run(stop), name="checkpoint-holder"),
            asyncio.create_task(self.assist.run(stop), name="assist-links"),
            *(asyncio.create_task(s.run(engines_stop), name=f"supervisor-{name}")
              for name, s in self.supervisors.items()),
        ]
        if config.rpc.tls_files is None:
            log.warning("rpc: no [rpc] ca, cert and key: the control plane on %s is plaintext "
                        "and unauthenticated (anyone who reaches it can order failovers and "
                        "drains); give it certificates (examples/lumend.toml, [rpc])",
                        config.rpc.listen)
        try:
            await self.agent.run(stop)
        finally:
            if not self.link.stopping:
                self.link.stop("the HA loop ended")
            stop.set()
            # Resign and deregister first, so no one routes to this node's engines any more;
            # then the supervisors stop the engines and GMS servers as their tasks return.
            log.info("stopping: resigning roles and deregistering")
            await self.agent.shutdown()
            # No gateway routes here any more: let the streams in flight finish (bounded by
            # drain_s), then the supervisors stop the engines as their tasks return.
            self.readiness.drain()
            await self._drain(self.config.gateway.drain_s, engines_stop)
            self.readiness.stop()
            engines_stop.set()
            await self.gateway.stop()
            await self.plane.stop()
            await asyncio.gather(*tasks, return_exceptions=True)
            await self.store.close()
            await self.server.stop()
            log.info("stopped")

    def streams_in_flight(self) -> tuple[int, int]:
        """(this gateway's engine streams, requests running or waiting on this node's
        engines): what a graceful stop waits for."""
        local = sum(s.load.running + s.load.waiting for s in self.supervisors.values())
        return sum(self.gateway.in_flight.values()), local

    async def _drain(self, drain_s: float, cut: asyncio.Event, every_s: float = 0.1) -> None:
        """Wait until no stream is in flight here, `drain_s` has passed, or `cut` is set (a
        second SIGTERM); logs what was left when it gives up."""
        started = time.monotonic()
        deadline = started + drain_s
        gateway, engines = self.streams_in_flight()
        if gateway or engines:
            log.info("stopping: draining %d gateway streams and %d requests on this node's "
                     "engines (at most %g s, [gateway] drain_s)", gateway, engines, drain_s)
        while (gateway or engines) and not cut.is_set():
            left = deadline - time.monotonic()
            if left <= 0:
                log.warning("stopping: drain_s (%g s) passed with %d gateway streams and %d "
                            "engine requests still in flight; they are cut now", drain_s,
                            gateway, engines)
                return
            self.link.notifier.send(STATUS=f"stopping: draining {gateway} streams, "
                                    f"{engines} engine requests ({left:.0f} s left)")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(cut.wait(), min(every_s, left))
            gateway, engines = self.streams_in_flight()
        if not (gateway or engines):
            log.info("stopping: no streams in flight after %.1f s; stopping the engines",
                     time.monotonic() - started)

    def _reload_api_keys(self, path: str | None) -> bool | None:
        """Load the gateway's API keys from `path` again: whether they changed, None when
        the file cannot be used (the gateway keeps the keys it has)."""
        try:
            keys = load_api_keys(path)
        except ApiKeyFileError as exc:
            log.error("reload: gateway.api_keys: %s; the gateway keeps its current keys", exc)
            return None
        if keys == self.gateway.api_keys:
            return False
        self.gateway.api_keys = keys
        log.info("reload: gateway API keys: %s", "none, the API is open to anyone who can "
                 "reach it" if keys is None else f"{len(keys)} from {path}")
        return True

    def link_via(self) -> str:
        notifier = self.link.notifier
        return f"via {notifier.via} to {notifier.address}" if notifier.enabled else "off"

    # -- reload -------------------------------------------------------------------------------

    async def _reloads(self, stop: asyncio.Event, requested: asyncio.Event) -> None:
        while not stop.is_set():
            waiters = [asyncio.ensure_future(e.wait()) for e in (stop, requested)]
            try:
                await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for w in waiters:
                    w.cancel()
            if requested.is_set() and not stop.is_set():
                requested.clear()
                await self.reload()

    async def reload(self) -> str:
        """Re-read the config file: apply what can change live, refuse the rest (logged)."""
        self.link.reloading()
        outcome, result = await self._reload()
        self.metrics.reloads.labels(result).inc()
        log.info("SIGHUP: %s", outcome)
        self.link.reloaded(outcome)
        return outcome

    async def _reload(self) -> tuple[str, str]:
        if self.config_path is None:
            return "reload skipped: lumend was started without a config file", "invalid"
        try:
            new = load_config(self.config_path)
        except ConfigError as exc:
            for line in str(exc).splitlines():
                log.error("reload rejected: %s", line)
            return (f"reload rejected: {len(exc.problems)} problems in {self.config_path}; "
                    "the running config stays in force", "invalid")
        plan = plan_reload(self.config, new)
        refused = list(plan.refused)
        config = plan.config
        for key in plan.refused:
            log.warning("reload: %s changed but cannot change while lumend runs; the old "
                        "value stays in force until a restart (systemctl restart lumend)", key)
        applied = []
        # The key file is re-read on every reload: its contents change under the same path.
        keys_changed = self._reload_api_keys(config.gateway.api_keys)
        if keys_changed is None:
            config = msgspec.structs.replace(config, gateway=self.config.gateway)
            refused.append("gateway.api_keys")
        elif keys_changed and "gateway.api_keys" not in plan.live:
            applied.append("gateway.api_keys")
        for key in plan.live:
            if key == "gateway.api_keys" and keys_changed is None:
                continue
            if key == "metrics.listen":
                try:
                    await self.server.rebind(config.metrics.listen)
                except MetricsBindError as exc:
                    log.error("reload: %s; metrics stay on %s", exc, self.config.metrics.listen)
                    config = msgspec.structs.replace(config, metrics=self.config.metrics)
                    refused.append(key)
                    continue
            if key == "gateway.log_admissions":
                self.gateway.log_admissions = config.gateway.log_admissions
            log.info("reload: applied %s: %s", key, LIVE_KEYS[key])
            applied.append(key)
        self.config = config
        if not applied and not refused:
            return "reloaded: no changes", "applied"
        parts = []
        if applied:
            parts.append("applied " + ", ".join(applied))
        if refused:
            parts.append("needs a restart for " + ", ".join(refused))
        return "reloaded: " + "; ".join(parts), "refused" if refused else "applied"

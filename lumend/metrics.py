"""Prometheus metrics of one node, served over HTTP on `[metrics] listen` (GET /metrics).

Most values are read from the HA loop at scrape time (a custom collector), so a family
exists only while something really maintains it; the cycle-duration histogram and the
reload counter are observed as events happen. Names follow Prometheus conventions: the
`lumen_` prefix, base units (seconds), `_total` for counters.
"""

from __future__ import annotations

import logging
import math
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from typing import get_args

from aiohttp import web
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    GC_COLLECTOR,
    PLATFORM_COLLECTOR,
    PROCESS_COLLECTOR,
    CollectorRegistry,
    Histogram,
    generate_latest,
)
from prometheus_client import Counter as PromCounter
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from lumend import __version__
from lumend.checkpoint.holder import HolderStats
from lumend.cluster.agent import ClusterAgent, CycleReport
from lumend.cluster.models import WorkerRecord, WorkerState
from lumend.config import parse_listen
from lumend.failover.supervisor import WorkerSupervisor
from lumend.gateway.server import Gateway

log = logging.getLogger(__name__)

WORKER_STATES: tuple[str, ...] = get_args(WorkerState)
CYCLE_OUTCOMES = ("ok", "etcd_unavailable", "etcd_error", "error")
RELOAD_RESULTS = ("applied", "refused", "invalid")
# lumend's metrics exported under an old name too, same value, until the next release
# (operator guide section 8): old name -> name now. The engines' are in
# lumend.engine.metric_names.
DEPRECATED_NAMES = {
    "lumen_ckpt_bytes_held": "lumen_ckpt_held_bytes",  # 0.1, without the unit suffix
    # The same value as the name now, with the unit not last.
    "lumen_lease_seconds_since_renewal": "lumen_lease_renewal_age_seconds",
}


def deprecated_help(old: str) -> str:
    return f"Deprecated: use {DEPRECATED_NAMES[old]}."


class NodeCollector(Collector):
    """The node's state, read from the HA loop on every scrape."""

    def __init__(
        self,
        agent: ClusterAgent,
        node: str,
        cluster: str,
        workers: Callable[[], Sequence[WorkerRecord]],
        ready: Callable[[], bool],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._agent = agent
        self._node = node
        self._cluster = cluster
        self._workers = workers
        self._ready = ready
        self._clock = clock
        self.cycles: Counter[str] = Counter()

    def observe_cycle(self, report: CycleReport) -> None:
        self.cycles[report.outcome] += 1

    def collect(self) -> Iterator[Metric]:
        agent = self._agent
        info = GaugeMetricFamily("lumen_node_info", "This node: name, cluster and version "
                                 "(always 1).", labels=["node", "cluster", "version"])
        info.add_metric([self._node, self._cluster, __version__], 1)
        yield info
        yield _gauge("lumen_node_registered", "1 while this node's keys are registered in etcd "
                     "on the lease it holds.", agent.registered)
        yield _gauge("lumen_node_ready", "1 once the node is registered and its workers serve "
                     "or stand by (what systemd's READY=1 means).", self._ready())
        renewal_age = agent.lease.seconds_since_renewal()
        yield _gauge("lumen_lease_renewal_age_seconds", "Seconds since the etcd lease was last "
                     "renewed (+Inf without a lease).", renewal_age)
        yield _gauge("lumen_lease_ttl_seconds", "TTL of this node's etcd lease.",
                     agent.lease.ttl_s)

        states: Counter[str] = Counter(w.state for w in self._workers())
        workers = GaugeMetricFamily("lumen_workers", "This node's workers by state.",
                                    labels=["state"])
        for state in WORKER_STATES:
            workers.add_metric([state], states.get(state, 0))
        yield workers
        view = agent.view
        if view is not None:
            yield _gauge("lumen_cluster_nodes", "Nodes registered in the cluster, as this "
                         "node read them in its last HA cycle.", len(view.nodes))

        yield _gauge("lumen_coordinator", "1 while this node holds the coordinator role.",
                     agent.is_coordinator)
        yield _gauge("lumen_coordinator_epoch", "Highest coordinator epoch this node has seen "
                     "(the election's etcd create revision).", agent.fence.highest)
        yield CounterMetricFamily("lumen_coordinator_elections", "Elections this node won.",
                                  value=agent.elections_won)
        yield CounterMetricFamily("lumen_coordinator_step_downs", "Times this node gave up the "
                                  "coordinator role without a graceful stop.",
                                  value=agent.step_downs)

        cycles = CounterMetricFamily("lumen_ha_cycles", "HA loop iterations by outcome.",
                                     labels=["outcome"])
        for outcome in CYCLE_OUTCOMES:
            cycles.add_metric([outcome], self.cycles.get(outcome, 0))
        yield cycles
        last = agent.last_cycle_at
        age = math.inf if last is None else self._clock() - last
        yield _gauge("lumen_ha_last_cycle_age_seconds", "Seconds since the HA loop last "
                     "finished a cycle; the systemd watchdog stops when this exceeds "
                     "WatchdogSec.", age)
        yield CounterMetricFamily("lumen_etcd_keepalive_failures", "Lease keepalives that "
                                  "etcd did not answer.", value=agent.keepalive_failures)


ENGINE_STATES = ("stopped", "starting", "initialising", "standby", "active", "releasing")
FAILOVER_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class EngineCollector(Collector):
    """The engines of this node's workers, read from their supervisors on every scrape."""

    def __init__(self, supervisors: Callable[[], Sequence[WorkerSupervisor]]) -> None:
        self._supervisors = supervisors

    def collect(self) -> Iterator[Metric]:
        supervisors = self._supervisors()
        state = GaugeMetricFamily("lumen_engine_state", "1 for each engine's current "
                                  "lifecycle state.", labels=["worker", "engine", "state"])
        failovers = CounterMetricFamily("lumen_failovers", "Unplanned failovers: the active "
                                        "engine was lost and a shadow took over.",
                                        labels=["worker"])
        restarts = CounterMetricFamily("lumen_engine_restarts", "Engine processes that exited "
                                       "and were started again.", labels=["worker"])
        hung = CounterMetricFamily("lumen_engine_hung_kills", "Engines SIGKILLed after failing "
                                   "their liveness probes.", labels=["worker"])
        gms = CounterMetricFamily("lumen_gms_restarts", "GMS servers that died and were "
                                  "started again.", labels=["worker"])
        seconds = HistogramMetricFamily("lumen_failover_seconds", "From losing the active "
                                        "engine to a shadow serving.", labels=["worker"])
        log_free = GaugeMetricFamily("lumen_engine_log_free_bytes", "Bytes free on the disk "
                                     "of the worker's engine logs (state_dir/logs); below "
                                     "1 MiB what the engines write is lost.",
                                     labels=["worker"])
        stalled = GaugeMetricFamily("lumen_worker_stalled", "1 while the worker's active "
                                    "engine is taken as stalled (a missed probe, a silent "
                                    "engine core): admitted to only when no other can be.",
                                    labels=["worker"])
        for sup in supervisors:
            worker = sup.worker.name
            stalled.add_metric([worker], 1.0 if sup.stalled else 0.0)
            for slot in sup.slots:
                for name in ENGINE_STATES:
                    state.add_metric([worker, slot.spec.engine_id, name],
                                     1.0 if slot.state == name else 0.0)
            c = sup.counters
            failovers.add_metric([worker], c.failovers)
            restarts.add_metric([worker], c.engine_restarts)
            hung.add_metric([worker], c.hung_kills)
            gms.add_metric([worker], c.gms_restarts)
            buckets = [(str(b), float(sum(1 for x in c.failover_seconds if x <= b)))
                       for b in FAILOVER_BUCKETS]
            buckets.append(("+Inf", float(len(c.failover_seconds))))
            seconds.add_metric([worker], buckets, sum_value=sum(c.failover_seconds))
            if sup.log_dir_free is not None:
                log_free.add_metric([worker], float(sup.log_dir_free))
        yield from (state, failovers, restarts, hung, gms, seconds, log_free, stalled)


class CheckpointCollector(Collector):
    """The node's checkpoint holder, per worker it accounts for, read on every scrape."""

    def __init__(self, stats: Callable[[], HolderStats]) -> None:
        self._stats = stats

    def collect(self) -> Iterator[Metric]:
        stats = self._stats()
        held = GaugeMetricFamily("lumen_ckpt_held_bytes", "Bytes of KV checkpoint pages this "
                                 "node holds, by the worker they are charged to.",
                                 labels=["worker"])
        held_old = GaugeMetricFamily("lumen_ckpt_bytes_held",
                                     deprecated_help("lumen_ckpt_bytes_held"), labels=["worker"])
        budget = GaugeMetricFamily("lumen_ckpt_budget_bytes", "Checkpoint budget of each "
                                   "worker on this node.", labels=["worker"])
        requests = GaugeMetricFamily("lumen_ckpt_requests", "Requests with a checkpoint held "
                                     "here.", labels=["worker"])
        evictions = CounterMetricFamily("lumen_ckpt_evictions", "Checkpoints evicted to make "
                                        "room for others.", labels=["worker"])
        refusals = CounterMetricFamily("lumen_ckpt_refusals", "Checkpoints or pages refused "
                                       "because the worker's budget was full.",
                                       labels=["worker"])
        orphans = CounterMetricFamily("lumen_ckpt_orphans", "Checkpoints collected after no "
                                      "activity for the TTL.", labels=["worker"])
        for worker, w in sorted(stats.workers.items()):
            held.add_metric([worker], w.bytes_held)
            held_old.add_metric([worker], w.bytes_held)
            budget.add_metric([worker], w.budget_bytes)
            requests.add_metric([worker], w.requests)
            evictions.add_metric([worker], w.evictions)
            refusals.add_metric([worker], w.refusals)
            orphans.add_metric([worker], w.orphans)
        bad = CounterMetricFamily("lumen_ckpt_bad_frames", "Checkpoint messages refused as "
                                  "invalid, by reason.", labels=["reason"])
        for reason, n in sorted(stats.bad_frames.items()):
            bad.add_metric([reason], n)
        yield from (held, held_old, budget, requests, evictions, refusals, orphans, bad)


class GatewayCollector(Collector):
    """This node's gateway: requests by outcome, resumes, rejections."""

    def __init__(self, gateway: Gateway) -> None:
        self._gateway = gateway

    def collect(self) -> Iterator[Metric]:
        c = self._gateway.counters
        requests = CounterMetricFamily(
            "lumen_gateway_requests", "Completions proxied, by outcome: ok, resumed (the "
            "upstream broke and the request was resumed), failed, client_gone.",
            labels=["outcome"])
        for outcome in ("ok", "resumed", "failed", "client_gone"):
            requests.add_metric([outcome], c.requests.get(outcome, 0))
        yield requests
        yield CounterMetricFamily("lumen_gateway_resumes", "Streams resumed after their "
                                  "upstream broke mid-way.", value=c.resumes)
        yield CounterMetricFamily("lumen_gateway_migrations", "Streams moved off a worker "
                                  "under a drain --migrate intent.", value=c.migrations)
        rejected = CounterMetricFamily("lumen_gateway_rejected", "Requests refused before "
                                       "proxying, by error type.", labels=["type"])
        for kind, n in sorted(c.rejected.items()):
            rejected.add_metric([kind], n)
        yield rejected
        engine_errors = CounterMetricFamily(
            "lumen_gateway_engine_errors", "Engine client errors (4xx) passed on to the "
            "client with the engine's status; no worker is marked failed.", labels=["status"])
        for status, n in sorted(c.engine_errors.items()):
            engine_errors.add_metric([str(status)], n)
        yield engine_errors
        routed = CounterMetricFamily(
            "lumen_gateway_routed", "Where interrupted streams went: resume (the holder's "
            "worker, from its checkpoint), recompute, shadow (the worker's own shadow).",
            labels=["decision"])
        for decision, n in sorted(c.routed.items()):
            routed.add_metric([decision], n)
        yield routed
        streams = GaugeMetricFamily(
            "lumen_gateway_streams_in_flight", "Engine streams this gateway has open, by "
            "worker.", labels=["worker"])
        for worker, n in sorted(self._gateway.in_flight.items()):
            streams.add_metric([worker], n)
        yield streams
        opened = CounterMetricFamily(
            "lumen_gateway_streams_opened", "Engine streams this gateway has opened, by worker "
            "(resumes included): where the traffic went, however short the streams.",
            labels=["worker"])
        for worker, n in sorted(self._gateway.opened.items()):
            opened.add_metric([worker], n)
        yield opened
        yield CounterMetricFamily(
            "lumen_gateway_restarts", "Resumes recomputed from the request's start (guided "
            "decoding, or no clean text boundary), skipping what the client had.",
            value=c.restarts)
        yield CounterMetricFamily(
            "lumen_gateway_pool_waits", "Requests that waited for a connection to an engine "
            "because the pool (2 x max_streams) was full.", value=c.pool.waits)
        yield CounterMetricFamily(
            "lumen_gateway_pool_timeouts", "Requests whose wait for an engine connection ran "
            "out (5 s; treated like an unreachable engine).", value=c.pool.timeouts)
        keys = self._gateway.api_keys
        yield _gauge("lumen_gateway_api_keys", "API keys the gateway accepts; 0: none "
                     "configured, the API is open.", len(keys) if keys is not None else 0)
        yield from self._gateway.latency.families()  # by model_name


def _gauge(name: str, documentation: str, value: float | bool) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, documentation, value=float(value))


class NodeMetrics:
    """The node's registry: the collector above, the event-driven metrics, process metrics."""

    def __init__(self, collector: NodeCollector,
                 engines: EngineCollector | None = None,
                 checkpoints: CheckpointCollector | None = None) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.collector = collector
        self.registry.register(collector)
        for extra in (engines, checkpoints):
            if extra is not None:
                self.registry.register(extra)
        for default in (PROCESS_COLLECTOR, PLATFORM_COLLECTOR, GC_COLLECTOR):
            self.registry.register(default)
        self.cycle_duration = Histogram(
            "lumen_ha_cycle_duration_seconds", "Duration of one HA loop cycle (read the "
            "cluster, decide, act).", registry=self.registry,
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
        )
        self.reloads = PromCounter(
            "lumen_config_reloads", "Config reloads (SIGHUP) by result: applied (every "
            "change live), refused (some key needs a restart), invalid (file rejected).",
            ["result"], registry=self.registry,
        )
        for result in RELOAD_RESULTS:
            self.reloads.labels(result)

    def observe_cycle(self, report: CycleReport) -> None:
        self.collector.observe_cycle(report)
        self.cycle_duration.observe(report.duration_s)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


class MetricsBindError(Exception):
    """The metrics listen address cannot be bound; the message names the key and the fix."""


class MetricsServer:
    """GET /metrics on one address; `rebind` moves it (a live config reload)."""

    def __init__(self, metrics: NodeMetrics) -> None:
        self._metrics = metrics
        self._runner: web.AppRunner | None = None
        self.listen: str | None = None

    async def start(self, listen: str) -> None:
        host, port = parse_listen(listen)
        app = web.Application()
        app.router.add_get("/metrics", self._handle)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        try:
            await web.TCPSite(runner, host, port).start()
        except OSError as exc:
            await runner.cleanup()
            raise MetricsBindError(
                f'metrics.listen = "{listen}": cannot listen there ({exc.strerror or exc}); '
                "choose a free port or an address of this host"
            ) from exc
        self._runner, self.listen = runner, listen
        log.info("serving metrics on http://%s/metrics", listen)

    async def rebind(self, listen: str) -> None:
        """Listen on `listen` instead; on failure the old address keeps serving."""
        old_runner = self._runner
        await self.start(listen)
        if old_runner is not None:
            await old_runner.cleanup()

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def _handle(self, request: web.Request) -> web.Response:
        return web.Response(body=self._metrics.exposition(),
                            headers={"Content-Type": CONTENT_TYPE_LATEST})


class EtcdHygieneCollector(Collector):
    """etcd hygiene and fencing, read from the HA loop on every
    scrape: the coordinator's compaction and event trimming, etcd's database size and
    alarms as last read, heartbeat writes, commands refused for an epoch etcd did not
    confirm. Register it with the node's registry (lumend/daemon.py)."""

    def __init__(self, agent: ClusterAgent) -> None:
        self._agent = agent

    def collect(self) -> Iterator[Metric]:
        agent = self._agent
        yield CounterMetricFamily(
            "lumen_heartbeat_writes", "Node and worker records written by heartbeats (only "
            "records that changed meaningfully, or are due for a refresh).",
            value=agent.heartbeat_writes)
        yield _gauge("lumen_etcd_compacted_revision", "The revision this node last compacted "
                     "etcd to as coordinator (0: never).", agent.compacted_revision)
        yield CounterMetricFamily(
            "lumen_etcd_compaction_failures", "Compactions (or status reads) of etcd by this "
            "node as coordinator that failed; tried again later.",
            value=agent.compact_failures)
        yield CounterMetricFamily(
            "lumen_events_trim_failures", "Trims of the events to the newest 1000 by this "
            "node as coordinator that failed; tried again later.", value=agent.trim_failures)
        if agent.store_status_db_bytes is not None:
            yield _gauge("lumen_etcd_db_size_bytes", "etcd's database size as this node last "
                         "read it (as coordinator, every compaction check).",
                         agent.store_status_db_bytes)
        alarm = GaugeMetricFamily("lumen_etcd_alarm", "etcd alarms this node sees raised (1); "
                                  "NOSPACE: etcd refuses writes until compacted, defragmented "
                                  "and disarmed.", labels=["alarm"])
        for name in agent.alarms:
            alarm.add_metric([name], 1)
        yield alarm
        lease = agent.lease
        yield CounterMetricFamily("lumen_lease_renewals", "Successful keepalives of this "
                                  "node's etcd lease.", value=lease.renewals)
        yield _gauge("lumen_lease_renewal_lag_seconds", "The longest a renewal of this node's "
                     "lease came after its schedule (every TTL/3) since lumend started; "
                     "near TTL/3 x 2 the lease is at risk.", lease.lag_s)
        yield _gauge("lumen_lease_seconds_since_renewal",
                     deprecated_help("lumen_lease_seconds_since_renewal"),
                     lease.seconds_since_renewal())
        yield CounterMetricFamily(
            "lumen_agent_unknown_epoch_refused", "Agent commands refused because their epoch "
            "was higher than any seen and etcd did not confirm it as the coordinator's.",
            value=agent.fence.unknown_refused)

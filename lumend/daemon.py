"""Wires a node together from its config and runs it until SIGTERM/SIGINT."""

from __future__ import annotations

import asyncio
import logging
import signal
import time

from lumend.cluster.agent import AgentTiming, ClusterAgent, NodeIdentity
from lumend.cluster.keys import Keys
from lumend.cluster.models import WorkerRecord
from lumend.cluster.store import EtcdStore, TlsFiles
from lumend.config import NodeConfig

log = logging.getLogger("lumend")


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


def configured_workers(config: NodeConfig) -> list[WorkerRecord]:
    """Worker records before engine supervision exists: registered, engines not started."""
    now = time.time()
    return [
        WorkerRecord(
            name=w.name, node=config.node.name, gpus=list(w.gpus), engine=w.engine,
            model=w.model, state="starting", updated_at=now,
        )
        for w in config.workers
    ]


def make_store(config: NodeConfig) -> EtcdStore:
    etcd = config.etcd
    return EtcdStore(
        etcd.endpoints,
        request_timeout_s=etcd.request_timeout_s,
        tls=TlsFiles(ca_cert=etcd.ca_cert, cert=etcd.cert, key=etcd.key),
    )


async def run_node(config: NodeConfig) -> None:
    store = make_store(config)
    agent = ClusterAgent(
        store,
        Keys(config.etcd.cluster),
        identity_of(config),
        AgentTiming.for_ttl(config.etcd.lease_ttl_s, config.etcd.heartbeat_interval_s),
        workers=lambda: configured_workers(config),
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    log.info(
        "lumend %s: node %s, cluster %r, etcd %s, lease ttl %d s",
        config.node.name, config.node.name, config.etcd.cluster,
        ", ".join(config.etcd.endpoints), config.etcd.lease_ttl_s,
    )
    try:
        await agent.run(stop)
    finally:
        log.info("stopping: resigning roles and deregistering")
        await agent.shutdown()
        await store.close()
        log.info("stopped")

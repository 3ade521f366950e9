"""`lumenctl demo`: a local cluster, a fault, and the recovery, narrated."""

from __future__ import annotations

import asyncio
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from rich.console import Console

from lumenctl.localcluster import LocalCluster
from lumenctl.render import events_table, status_tables
from lumenctl.report import events_document, status_document
from lumend.cluster.keys import Keys
from lumend.cluster.store import EtcdStore
from lumend.cluster.view import ClusterView, build_view


def read_view(endpoints: list[str], cluster: str) -> ClusterView:
    async def go() -> ClusterView:
        store = EtcdStore(endpoints, request_timeout_s=1.0)
        try:
            keys = Keys(cluster)
            return build_view(keys, await store.get_prefix(keys.root))
        finally:
            await store.close()

    return asyncio.run(go())


def wait_for(
    endpoints: list[str],
    cluster: str,
    what: str,
    check: Callable[[ClusterView], bool],
    timeout_s: float,
) -> ClusterView:
    deadline = time.monotonic() + timeout_s
    while True:
        view = read_view(endpoints, cluster)
        if check(view):
            return view
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout_s:.0f} s waiting for {what}")
        time.sleep(0.05)


def run_demo(console: Console, nodes: int, lease_ttl_s: int, keep: bool) -> None:
    with tempfile.TemporaryDirectory(prefix="lumen-demo-") as tmp:
        cluster = LocalCluster(Path(tmp), size=nodes, lease_ttl_s=lease_ttl_s)
        console.rule("LUMEN demo")
        console.print(f"starting etcd and {nodes} lumend nodes on loopback (lease TTL "
                      f"{lease_ttl_s} s; logs in {tmp})")
        try:
            cluster.start()
            eps, name = cluster.endpoints, cluster.cluster
            view = wait_for(
                eps, name, f"{nodes} nodes and a coordinator",
                lambda v: len(v.nodes) == nodes and v.coordinator is not None, 30,
            )
            console.print(status_tables(status_document(view)))

            assert view.coordinator is not None
            victim, epoch = view.coordinator.record.node, view.coordinator.epoch
            console.rule(f"fault: SIGKILL the coordinator {victim}")
            cluster.node(victim).kill()
            killed_at = time.monotonic()
            view = wait_for(
                eps, name, "a new coordinator",
                lambda v: v.coordinator is not None and v.coordinator.epoch > epoch,
                lease_ttl_s * 3 + 10,
            )
            took = time.monotonic() - killed_at
            assert view.coordinator is not None
            console.print(
                f"[green]recovered:[/] {view.coordinator.record.node} took over with epoch "
                f"{view.coordinator.epoch} (was {epoch}) {took:.2f} s after the kill "
                f"(lease TTL {lease_ttl_s} s)"
            )
            view = wait_for(eps, name, f"{victim} to leave", lambda v: victim not in v.nodes, 30)
            console.print(status_tables(status_document(view)))

            assert view.coordinator is not None
            leader, epoch = view.coordinator.record.node, view.coordinator.epoch
            console.rule(f"planned stop: SIGTERM the coordinator {leader}")
            stopped_at = time.monotonic()
            cluster.node(leader).stop()
            view = wait_for(
                eps, name, "a handover",
                lambda v: v.coordinator is not None and v.coordinator.epoch > epoch, 30,
            )
            took = time.monotonic() - stopped_at
            assert view.coordinator is not None
            console.print(
                f"[green]handed over:[/] {view.coordinator.record.node} is coordinator "
                f"(epoch {view.coordinator.epoch}) {took:.2f} s after SIGTERM: it resigned, "
                "nobody waited for the lease"
            )

            console.rule(f"restart {victim} and {leader}: they rejoin as followers")
            cluster.node(victim).start()
            cluster.node(leader).start()
            view = wait_for(eps, name, "all nodes back", lambda v: len(v.nodes) == nodes, 30)
            console.print(status_tables(status_document(view)))
            console.print(events_table(events_document(name, view.events)))
            if keep:
                console.print(
                    f"cluster left running; try: lumenctl --endpoints {','.join(eps)} "
                    f"--cluster {name} status --watch   (Ctrl-C here stops it)"
                )
                while True:
                    time.sleep(3600)
        except KeyboardInterrupt:
            pass
        finally:
            console.print("stopping the local cluster")
            cluster.stop()

"""`lumenctl demo`: a local cluster, a fault, and the recovery, narrated."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path

from rich.console import Console

from lumenctl.localcluster import LocalCluster
from lumenctl.render import events_table, status_tables
from lumenctl.report import events_document, status_document
from lumend.cluster.keys import Keys
from lumend.cluster.models import WorkerRecord
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


def _whole(worker: WorkerRecord) -> bool:
    """Serving, with one active engine and every shadow standing by."""
    return worker.state == "serving" and sorted(e.state for e in worker.engines) == [
        "active", *["standby"] * (len(worker.engines) - 1)]


class Traffic:
    """Completions sent back to back to the first of `urls` that answers: a worker's engines
    (a standby refuses at once with 503, the active one answers) or a gateway."""

    def __init__(self, urls: list[str]) -> None:
        self.urls = urls
        self.results: list[tuple[float, bool]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Traffic:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        body = json.dumps({"prompt": "the quick brown fox", "max_tokens": 8}).encode()
        while not self._stop.is_set():
            ok = False
            for url in self.urls:
                request = urllib.request.Request(url + "/v1/completions", data=body,
                                                 headers={"Content-Type": "application/json"})
                try:
                    with urllib.request.urlopen(request, timeout=5) as response:
                        ok = response.status == 200
                except (urllib.error.URLError, OSError):
                    continue
                if ok:
                    break
            self.results.append((time.monotonic(), ok))
            if not ok:
                time.sleep(0.005)

    def first_success_after(self, t: float) -> float | None:
        return next((at for at, ok in self.results if ok and at > t), None)


def _engine_fault(console: Console, cluster: LocalCluster, worker: WorkerRecord) -> None:
    active = next(e for e in worker.engines if e.role == "active")
    assert active.pid is not None
    console.rule(f"fault: SIGKILL the active engine {active.id} (pid {active.pid}) under load")
    gateway = cluster.node(worker.node).gateway
    with Traffic([e.url for e in worker.engines]) as traffic, Traffic([gateway]) as clients:
        time.sleep(1.0)
        killed_at = time.monotonic()
        os.kill(active.pid, signal.SIGKILL)
        view = wait_for(
            cluster.endpoints, cluster.cluster, f"{worker.name} whole again",
            lambda v: (w := v.workers.get(worker.name)) is not None and _whole(w)
            and active.pid not in {e.pid for e in w.engines}, 60)
        time.sleep(0.5)
    back = traffic.first_success_after(killed_at)
    during = [ok for at, ok in traffic.results if at > killed_at and (back is None or at <= back)]
    took = f"{back - killed_at:.3f} s" if back is not None else "never"
    console.print(
        f"[green]recovered:[/] {worker.name} answered again {took} after the kill; "
        f"{during.count(False)} attempts failed fast meanwhile, none hung; "
        f"{sum(ok for _, ok in traffic.results)} completions in all")
    failed = sum(not ok for _, ok in clients.results)
    console.print(
        f"  meanwhile through {worker.node}'s gateway ({gateway}): {len(clients.results)} "
        f"completions, {failed} failed (a stream cut by the kill is resumed elsewhere)")
    healed = view.workers[worker.name]
    console.print("  engines now: " + ", ".join(
        f"{e.id} {e.state} (pid {e.pid})" for e in healed.engines)
        + "; the killed engine was restarted as the new shadow, mapping the weights from GMS")


def _planned_failover(console: Console, cluster: LocalCluster, worker: str) -> None:
    console.rule(f"planned: lumenctl failover {worker} --wait")
    result = subprocess.run(
        [sys.executable, "-m", "lumenctl", "--config", "/nonexistent",
         "--endpoints", ",".join(cluster.endpoints), "--cluster", cluster.cluster,
         "failover", worker, "--yes", "--wait"],
        capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
    for line in (result.stdout + result.stderr).strip().splitlines():
        console.print(f"  $ {line}")
    if result.returncode != 0:
        raise RuntimeError(f"lumenctl failover {worker} failed ({result.returncode})")


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
                eps, name, f"{nodes} nodes, a coordinator and every worker whole",
                lambda v: len(v.nodes) == nodes and v.coordinator is not None
                and len(v.workers) == nodes and all(_whole(w) for w in v.workers.values()),
                90,
            )
            console.print(status_tables(status_document(view)))

            _engine_fault(console, cluster, view.workers["node-1-w0"])
            _planned_failover(console, cluster, "node-2-w0")

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

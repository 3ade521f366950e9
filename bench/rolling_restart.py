"""The cost of a rolling restart of lumend under streaming load, with and without a drain.

A local cluster (real etcd, real lumend processes, real sim engines, no shadows) is
restarted one node at a time, as the Ansible role rolls a config, certificate or wheel
change, while clients keep streams going through every gateway that answers /ready 200 (a
load balancer that honours /ready). Two ways:

  drain      what the role does (ansible/roles/lumend/tasks/drain.yml): `lumenctl drain NODE
             --migrate --wait`, wait until no client streams through the node's gateway,
             SIGTERM, start, `lumenctl undrain NODE`, wait until it serves
  no drain   SIGTERM, start, wait until it serves (a graceful stop: streams get
             [gateway] drain_s to finish, then the engines stop)

Streams are longer than `drain_s` (--drain-s, 2 s here; 30 s by default in production, where
a stream longer than that is what is cut). Per way it counts the streams the clients saw
cut (an error, a refused or broken connection, or text that differs from the failure-free
stream), the upstreams the gateways saw break and recovered (lumen_gateway_recovery_seconds
observations), the streams migrated make-before-break, and the engines started (engine
reloads: lumend does not re-adopt its engines across a restart). Prints a table; asserts
nothing.

    python bench/rolling_restart.py [--nodes 4] [--clients 8] [--max-tokens 600]
"""

from __future__ import annotations

import argparse
import asyncio
import re
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from lumenctl.demo import read_view
from lumenctl.localcluster import LocalCluster, LumendNode
from lumenctl.sse import data_events
from lumend.engine.sim_core import decode, encode, reference_completion

STARTED = re.compile(r"engine \S+ started \(pid \d+")
COUNTERS = ("lumen_gateway_recovery_seconds_count", "lumen_gateway_migrations_total")


def expected(prompt: str, max_tokens: int) -> str:
    return decode(reference_completion(0, encode(prompt), max_tokens))


def engine_starts(node: LumendNode) -> int:
    return len(STARTED.findall(node.log_text()))


def scrape(node: LumendNode) -> dict[str, float]:
    """The node's gateway counters now (zeros while it does not answer)."""
    found = dict.fromkeys(COUNTERS, 0.0)
    try:
        with urllib.request.urlopen(node.metrics_url, timeout=5) as r:
            for line in r.read().decode().splitlines():
                series, _, value = line.rpartition(" ")
                name = series.split("{", 1)[0]  # the histograms are by model_name
                if name in found:
                    found[name] += float(value)
    except OSError:
        pass
    return found


def gateway_streams(node: LumendNode) -> float:
    total = 0.0
    with urllib.request.urlopen(node.metrics_url, timeout=5) as r:
        for line in r.read().decode().splitlines():
            if line.startswith("lumen_gateway_streams_in_flight{"):
                total += float(line.rsplit(" ", 1)[1])
    return total


def all_serving(cluster: LocalCluster) -> bool:
    view = read_view(cluster.endpoints, cluster.cluster)
    return (len(view.workers) == len(cluster.nodes)
            and all(w.state == "serving" for w in view.workers.values()))


def wait_for(probe: Any, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not probe():
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(0.1)


def lumenctl(cluster: LocalCluster, *args: str) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "lumenctl", "--config", "/nonexistent/lumend.toml",
         "--endpoints", ",".join(cluster.endpoints), "--cluster", cluster.cluster, *args],
        capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=300)
    if result.returncode != 0:
        raise RuntimeError(f"lumenctl {' '.join(args)}: {result.stderr}")


def set_drain_s(node: LumendNode, seconds: float) -> None:
    text = node.config_path.read_text()
    node.config_path.write_text(text.replace("[gateway]\n", f"[gateway]\ndrain_s = {seconds}\n",
                                             1))


@dataclass
class Load:
    """Clients streaming through the gateways that answer /ready 200, round robin."""

    cluster: LocalCluster
    clients: int
    max_tokens: int
    ready: list[str] = field(default_factory=list)
    ok: int = 0
    cut: int = 0
    refused: int = 0  # 503 before the first token (a stopping gateway); retried elsewhere
    stop: asyncio.Event = field(default_factory=asyncio.Event)
    n: int = 0
    why: Counter[str] = field(default_factory=Counter)  # what the cut streams saw

    async def poll_ready(self, session: aiohttp.ClientSession) -> None:
        while not self.stop.is_set():
            ready = []
            for node in self.cluster.nodes:
                try:
                    async with session.get(node.gateway + "/ready",
                                           timeout=aiohttp.ClientTimeout(total=1)) as r:
                        if r.status == 200:
                            ready.append(node.gateway)
                except (aiohttp.ClientError, TimeoutError):
                    pass
            self.ready = ready
            await asyncio.sleep(0.2)

    async def one(self, session: aiohttp.ClientSession, base: str) -> None:
        self.n += 1
        prompt = f"rolling restart, stream {self.n}"
        pieces, errors = [], []
        try:
            async with session.post(base + "/v1/completions", json={
                    "prompt": prompt, "max_tokens": self.max_tokens, "stream": True}) as r:
                if r.status == 503:
                    self.refused += 1
                    return
                if r.status != 200:
                    errors.append(f"status {r.status}")
                async for chunk in data_events(r.content):
                    if "error" in chunk:
                        errors.append(chunk["error"]["message"])
                    else:
                        pieces.append(chunk["choices"][0]["text"])
        except (aiohttp.ClientError, TimeoutError) as exc:
            errors.append(repr(exc))
        if errors or "".join(pieces) != expected(prompt, self.max_tokens):
            self.cut += 1
            self.why[errors[0][:90] if errors else "text differs"] += 1
        else:
            self.ok += 1

    async def client(self, session: aiohttp.ClientSession, index: int) -> None:
        turn = index
        while not self.stop.is_set():
            if not self.ready:
                await asyncio.sleep(0.1)
                continue
            turn += 1
            await self.one(session, self.ready[turn % len(self.ready)])


async def roll(cluster: LocalCluster, drain: bool, clients: int, max_tokens: int
               ) -> dict[str, Any]:
    counted = dict.fromkeys(COUNTERS, 0.0)  # counters of gateways since restarted
    starts = sum(engine_starts(n) for n in cluster.nodes)
    async with aiohttp.ClientSession() as session:
        load = Load(cluster, clients, max_tokens)
        tasks = [asyncio.create_task(load.poll_ready(session)),
                 *(asyncio.create_task(load.client(session, i)) for i in range(clients))]
        await asyncio.sleep(3)  # streams going everywhere
        started = time.monotonic()
        for node in cluster.nodes:
            if drain:
                await asyncio.to_thread(lumenctl, cluster, "drain", node.name, "--migrate",
                                        "--yes", "--wait", "--wait-timeout", "120")
                await asyncio.to_thread(wait_for, lambda n=node: gateway_streams(n) == 0, 120,
                                        f"no client streams through {node.name}'s gateway")
            for name, value in (await asyncio.to_thread(scrape, node)).items():
                counted[name] += value
            await asyncio.to_thread(node.stop, 60)
            node.start()
            if drain:
                await asyncio.to_thread(lumenctl, cluster, "undrain", node.name)
            await asyncio.to_thread(wait_for, lambda: all_serving(cluster), 60,
                                    f"{node.name} serving again")
        seconds = time.monotonic() - started
        await asyncio.sleep(3)
        load.stop.set()
        await asyncio.gather(*tasks)
    for node in cluster.nodes:
        for name, value in (await asyncio.to_thread(scrape, node)).items():
            counted[name] += value
    return {
        "streams": load.ok + load.cut, "cut": load.cut, "refused": load.refused,
        "broken": counted["lumen_gateway_recovery_seconds_count"],
        "migrated": counted["lumen_gateway_migrations_total"],
        "reloads": sum(engine_starts(n) for n in cluster.nodes) - starts,
        "seconds": seconds, "why": dict(load.why),
    }


def measure(args: argparse.Namespace, drain: bool, workdir: Path) -> dict[str, Any]:
    cluster = LocalCluster(workdir, size=args.nodes, lease_ttl_s=3, shadows=0,
                           engine_args=("--time-scale", str(args.time_scale)))
    try:
        cluster.start()
        wait_for(lambda: all_serving(cluster), 90, "every worker serving")
        # drain_s is read at start: restart each node on it once, before the measurement.
        for node in cluster.nodes:
            node.stop(30)
            set_drain_s(node, args.drain_s)
            node.start()
        wait_for(lambda: all_serving(cluster), 90, "every worker serving")
        time.sleep(2)  # every gateway's view and the coordinator caught up
        return asyncio.run(roll(cluster, drain, args.clients, args.max_tokens))
    finally:
        cluster.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--nodes", type=int, default=4)
    parser.add_argument("--clients", type=int, default=8, help="concurrent streams")
    parser.add_argument("--max-tokens", type=int, default=600)
    parser.add_argument("--time-scale", type=float, default=3.0)
    parser.add_argument("--drain-s", type=float, default=2.0, help="[gateway] drain_s")
    parser.add_argument("--ways", default="drain,plain",
                        help="comma-separated, in order: drain (the role's way), plain (no "
                             "drain); default both")
    parser.add_argument("--keep", type=Path, help="keep the clusters' logs in this folder")
    args = parser.parse_args()
    ways = args.ways.split(",")
    unknown = sorted(set(ways) - {"drain", "plain"})
    if unknown:
        parser.error(f"--ways: unknown way {', '.join(unknown)}: give drain, plain or "
                     "drain,plain")
    rows = []
    with tempfile.TemporaryDirectory(prefix="lumen-rolling-") as tmp:
        for way in ways:
            drain = way == "drain"
            result = measure(args, drain, (args.keep or Path(tmp)) / way)
            rows.append(("drain --migrate, then restart" if drain else "restart, no drain",
                         result))
    print(f"rolling restart of {args.nodes} nodes (1 worker each, sim engines, no shadow), "
          f"{args.clients} concurrent streams of {args.max_tokens} tokens, "
          f"drain_s {args.drain_s:g} s")
    header = ("way", "streams", "cut", "503 at start", "upstreams broken", "migrated",
              "engine reloads", "roll s")
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for way, r in rows:
        print(f"| {way} | {r['streams']:.0f} | {r['cut']:.0f} | {r['refused']:.0f} | "
              f"{r['broken']:.0f} | {r['migrated']:.0f} | {r['reloads']:.0f} | "
              f"{r['seconds']:.1f} |")
    for way, r in rows:
        for why, n in sorted(r["why"].items()):
            print(f"{way}: {n} cut: {why}")


if __name__ == "__main__":
    main()

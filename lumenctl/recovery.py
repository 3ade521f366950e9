"""One seeded trace replayed through a local cluster's gateways with a fault in the middle:
the machinery `lumenctl demo` and bench/recovery.py share.

A trace is Poisson arrivals with prompt and output lengths drawn from a seed; every request
streams through one of the gateways (round robin). At `fault_at` seconds the active engine
of the victim worker is SIGKILLed. Each outcome keeps its token times, so TTFT, TPOT, the
stall of interrupted streams and the recovery time (fault until the mean TTFT of requests
arriving in a sliding window is back within 10% of its level before the fault) follow, and
its text, checked against the failure-free stream token for token.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import time
import urllib.request
from collections import Counter
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from lumenctl.localcluster import LocalCluster
from lumenctl.sse import data_events
from lumend.cluster.keys import Keys
from lumend.cluster.store import EtcdStore
from lumend.cluster.view import ClusterView, build_view
from lumend.engine.sim_core import decode, encode, reference_completion

PAPER = {"ttft": -0.44, "tpot": -0.16, "recovery": -0.50}  # LUMEN vs S&R, 4 workers
WINDOW_S = 3.0  # the sliding window of the recovery time
STEP_S = 0.25


def read_view(endpoints: list[str], cluster: str) -> ClusterView:
    async def go() -> ClusterView:
        store = EtcdStore(endpoints, request_timeout_s=1.0)
        try:
            keys = Keys(cluster)
            return build_view(keys, await store.get_prefix(keys.root))
        finally:
            await store.close()

    return asyncio.run(go())


@dataclass(frozen=True)
class Request:
    at: float  # seconds after the trace starts
    prompt: str
    max_tokens: int


@dataclass
class Outcome:
    request: Request
    sent_at: float = 0.0  # seconds after the trace starts
    token_times: list[float] = field(default_factory=list)  # likewise
    text: str = ""
    error: str = ""
    request_id: str = ""  # the gateway's id for it (its chunks' "id")

    @property
    def ttft(self) -> float:
        return self.token_times[0] - self.sent_at

    @property
    def tpot(self) -> float | None:
        times = self.token_times
        return (times[-1] - times[0]) / (len(times) - 1) if len(times) > 1 else None

    @property
    def stall(self) -> float:
        times = self.token_times
        return max((b - a for a, b in itertools.pairwise(times)), default=0.0)


def trace(seed: int, duration_s: float, rate: float, prompt: tuple[int, int],
          output: tuple[int, int]) -> list[Request]:
    rng = random.Random(seed)
    words = ["alpha", "beta", "gamma", "delta", "kv", "page", "holder", "node", "token"]
    requests: list[Request] = []
    t = 0.0
    while True:
        t += rng.expovariate(rate)
        if t >= duration_s:
            return requests
        length = rng.randint(*prompt)
        text = f"request {len(requests)}:"
        while len(text) < length:
            text += " " + rng.choice(words)
        requests.append(Request(t, text[:length], rng.randint(*output)))


class Replay:
    """The trace through the gateways, the fault at `fault_at` (None: no fault); `outcomes`
    fill in live (times relative to `start`), so a watcher can show them while it runs."""

    def __init__(self, cluster: LocalCluster, requests: list[Request], fault_at: float | None,
                 victim: str, fault_signal: signal.Signals = signal.SIGKILL) -> None:
        self.cluster, self.requests = cluster, requests
        self.fault_at, self.victim = fault_at, victim
        # SIGKILL: the engine crashes; SIGSTOP: it hangs (alive, answering nothing) until
        # its supervisor's probes kill it.
        self.fault_signal = fault_signal
        self.outcomes = [Outcome(r) for r in requests]
        self.start = 0.0  # time.monotonic() when the trace started
        self.fault: float | None = None  # seconds into the trace, once done
        self.fault_pid: int | None = None  # the engine the fault hit

    def now(self) -> float:
        return time.monotonic() - self.start

    async def run(self, watch: Callable[[Replay], Coroutine[Any, Any, None]] | None = None) -> None:
        gateways = [n.gateway for n in self.cluster.nodes]
        timeout = aiohttp.ClientTimeout(total=None, sock_read=120)
        async with aiohttp.ClientSession(timeout=timeout,
                                         connector=aiohttp.TCPConnector(limit=0)) as session:
            self.start = time.monotonic()

            async def later(i: int, request: Request) -> None:
                await asyncio.sleep(max(0.0, request.at - self.now()))
                await self._one(session, gateways[i % len(gateways)], self.outcomes[i])

            watcher: asyncio.Task[None] | None = (
                asyncio.create_task(watch(self)) if watch is not None else None)
            fault = asyncio.create_task(self._fault()) if self.fault_at is not None else None
            try:
                await asyncio.gather(*(later(i, r) for i, r in enumerate(self.requests)))
                if fault is not None:
                    await fault
            finally:
                for task in (fault, watcher):
                    if task is not None and not task.done():
                        task.cancel()
                        await asyncio.gather(task, return_exceptions=True)

    async def _fault(self) -> None:
        assert self.fault_at is not None
        await asyncio.sleep(max(0.0, self.fault_at - self.now()))
        view = await asyncio.to_thread(read_view, self.cluster.endpoints, self.cluster.cluster)
        pid = next(e.pid for e in view.workers[self.victim].engines if e.role == "active")
        assert pid is not None
        os.kill(pid, self.fault_signal)
        self.fault, self.fault_pid = self.now(), pid

    async def _one(self, session: aiohttp.ClientSession, gateway: str,
                   outcome: Outcome) -> None:
        request = outcome.request
        outcome.sent_at = self.now()
        body = {"prompt": request.prompt, "max_tokens": request.max_tokens, "stream": True}
        try:
            async with session.post(gateway + "/v1/completions", json=body) as r:
                if r.status != 200:
                    outcome.error = f"HTTP {r.status}: {await r.text()}"
                    return
                async for chunk in data_events(r.content):
                    if "error" in chunk:
                        outcome.error = chunk["error"]["message"]
                        continue
                    outcome.token_times.append(self.now())
                    outcome.request_id = outcome.request_id or str(chunk.get("id", ""))
                    outcome.text += chunk["choices"][0]["text"]
        except aiohttp.ClientError as exc:
            outcome.error = f"{type(exc).__name__}: {exc}"


async def replay(cluster: LocalCluster, requests: list[Request], fault_at: float,
                 victim: str) -> tuple[list[Outcome], float]:
    """Every request of the trace, with the fault at `fault_at`; (outcomes, fault time)."""
    run = Replay(cluster, requests, fault_at, victim)
    await run.run()
    assert run.fault is not None
    return run.outcomes, run.fault


def recovery_time(outcomes: list[Outcome], fault: float, warmup: float) -> float | None:
    """Seconds from the fault until the mean TTFT of the requests sent in a window starting
    then is within 10% of the level before the fault; None: never within the trace."""
    ok = [o for o in outcomes if o.token_times]
    before = [o.ttft for o in ok if warmup <= o.sent_at < fault]
    if not before or not ok:
        return None
    level = statistics.fmean(before)
    end = max(o.sent_at for o in ok)
    t = fault
    while t + WINDOW_S <= end:
        window = [o.ttft for o in ok if t <= o.sent_at < t + WINDOW_S]
        if window and statistics.fmean(window) <= 1.1 * level:
            return t - fault
        t += STEP_S
    return None


@dataclass
class Result:
    config: str
    ttft_ms: float
    tpot_ms: float
    recovery_s: float | None
    stall_s: float
    interrupted: int
    requests: int
    errors: int
    mismatches: int
    restored_tokens: float
    decisions: Counter[str] = field(default_factory=Counter)  # "resume on w", "recompute on w"


def summarise(config: str, outcomes: list[Outcome], fault: float, warmup: float,
              restored: float) -> Result:
    ok = [o for o in outcomes if o.token_times and not o.error]
    mismatches = sum(
        o.text != decode(reference_completion(0, encode(o.request.prompt),
                                              o.request.max_tokens)) for o in ok)
    # Interrupted: in flight at the fault, with a gap far beyond the stream's usual one.
    in_flight = [o for o in ok if o.token_times[0] < fault < o.token_times[-1]]
    interrupted = [o for o in in_flight
                   if o.stall > 5 * statistics.median(
                       b - a for a, b in itertools.pairwise(o.token_times))]
    tpots = [t for o in ok if (t := o.tpot) is not None]
    return Result(
        config=config,
        ttft_ms=1000 * statistics.fmean(o.ttft for o in ok) if ok else float("nan"),
        tpot_ms=1000 * statistics.fmean(tpots) if tpots else float("nan"),
        recovery_s=recovery_time(ok, fault, warmup),
        stall_s=statistics.fmean(o.stall for o in interrupted) if interrupted else 0.0,
        interrupted=len(interrupted), requests=len(outcomes),
        errors=len(outcomes) - len(ok), mismatches=mismatches, restored_tokens=restored)


def ratio(value: float | None, base: float | None) -> str:
    if value is None or base is None or base == 0:
        return "n/a"
    return f"{value / base - 1:+.0%}"


# -- the cluster ------------------------------------------------------------------------


def lumenctl(cluster: LocalCluster, *args: str) -> str:
    """Run `lumenctl ARGS` against the cluster; its output. Raises RuntimeError with the
    output when it fails."""
    result = subprocess.run(
        [sys.executable, "-m", "lumenctl", "--config", "/nonexistent.toml",
         "--endpoints", ",".join(cluster.endpoints), "--cluster", cluster.cluster, *args],
        capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=120)
    if result.returncode != 0:
        raise RuntimeError(f"lumenctl {' '.join(args)} failed ({result.returncode}): "
                           f"{(result.stdout + result.stderr).strip()}")
    return result.stdout


Shadows = int | dict[str, int]  # standbys of every worker, or by worker name (else 0)


def whole_and_idle(view: ClusterView, workers: int, shadows: Shadows) -> bool:
    """Every worker serving, idle, with its active engine and its standbys."""
    def standbys(worker: str) -> int:
        return shadows if isinstance(shadows, int) else shadows.get(worker, 0)

    return (len(view.workers) == workers and view.coordinator is not None
            and all(w.state == "serving" and w.load.running + w.load.waiting == 0
                    and sorted(e.state for e in w.engines)
                    == ["active", *["standby"] * standbys(w.name)]
                    for w in view.workers.values()))


def wait_whole(cluster: LocalCluster, shadows: Shadows, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while not whole_and_idle(read_view(cluster.endpoints, cluster.cluster),
                             cluster.size * cluster.workers_per_node, shadows):
        if time.monotonic() > deadline:
            raise TimeoutError(f"the cluster was not whole and idle within {timeout_s:.0f} s; "
                               f"see the logs in {cluster.workdir}")
        time.sleep(0.2)
    time.sleep(2.0)  # every node's view (one HA cycle) and the coordinator's


def restored_by_engine(cluster: LocalCluster) -> dict[tuple[str, int | None], float]:
    """Tokens each running sim engine resumed from checkpoints instead of recomputing, by
    (engine id, pid): a restarted engine counts from zero again."""
    found: dict[tuple[str, int | None], float] = {}
    for worker in read_view(cluster.endpoints, cluster.cluster).workers.values():
        for engine in worker.engines:
            try:
                with urllib.request.urlopen(engine.url + "/metrics", timeout=5) as r:
                    for line in r.read().decode().splitlines():
                        if line.startswith("lumen_sim_restored_tokens_total "):
                            found[(engine.id, engine.pid)] = float(line.split()[1])
            except OSError:
                pass  # a standby or restarting engine
    return found


def restored_since(cluster: LocalCluster,
                   before: dict[tuple[str, int | None], float]) -> float:
    """Tokens restored since `before` (restored_by_engine) by the engines running now."""
    return sum(n - before.get(engine, 0.0) for engine, n in restored_by_engine(cluster).items())


# -- recovery decisions, from the gateways' logs ------------------------------------------

_ROUTING = re.compile(r"recovery routing(?: \(coordinator epoch (\d+)\))?: (.*)$")
_DECISION = re.compile(r"\b(resume|recompute) on (\S+)")


@dataclass(frozen=True)
class Decision:
    """One recovery routing decision a gateway logged (Algorithm 2's answer)."""

    node: str  # whose gateway asked
    kind: str  # resume | recompute
    worker: str  # where the request continues
    reason: str  # the coordinator's sentence (or the local one when degraded)
    coordinated: bool


class DecisionLog:
    """Follows the nodes' log files from now on and parses each recovery decision."""

    def __init__(self, cluster: LocalCluster) -> None:
        self.cluster = cluster
        self.offsets = {n.name: _size(n.log_path) for n in cluster.nodes}

    def new(self) -> list[Decision]:
        found = []
        for node in self.cluster.nodes:
            start = self.offsets.get(node.name, 0)
            try:
                with node.log_path.open("rb") as f:
                    f.seek(start)
                    data = f.read()
            except OSError:
                continue
            whole = data[:data.rfind(b"\n") + 1]  # a line still being written waits
            self.offsets[node.name] = start + len(whole)
            for line in whole.decode(errors="replace").splitlines():
                decision = parse_decision(node.name, line)
                if decision is not None:
                    found.append(decision)
        return found


def parse_decision(node: str, line: str) -> Decision | None:
    routing = _ROUTING.search(line)
    if routing is None:
        return None
    decision = _DECISION.search(routing.group(2))
    if decision is None:
        return None
    return Decision(node, decision.group(1), decision.group(2), routing.group(2).strip(),
                    routing.group(1) is not None)


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0

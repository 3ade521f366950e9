"""Recovery under each policy on a real local cluster: the same trace, the same fault.

Four lumend nodes (one sim worker each) on one etcd, clients streaming through the nodes'
gateways. Each configuration replays one seeded trace (Poisson arrivals, prompt and output
lengths drawn from it) and, at the same moment of it, SIGKILLs the active engine of the
same worker: a worker without a shadow restarts its engine (weights from its GMS server,
then initialisation), one with a shadow hands over to it. The interrupted streams are
resumed by the gateways as the policy decides (DESIGN.md section 5):
  stop_and_restart   no checkpoints; recompute on the least loaded survivor
  fixed_checkpoint   checkpoints on a fixed neighbour; interrupted requests go there
  lumen              Algorithms 1 and 2 (load-aware placement, resume or recompute)
  lumen + shadows    the same, with one shadow engine per worker
The policy is set live (`lumenctl config set mode ...`) on one cluster for the first three;
the fourth runs on a second cluster with shadows.

Per configuration: mean TTFT and mean TPOT over every request, the recovery time (from the
fault until the mean TTFT of requests arriving in a sliding window is back within 10% of
its level before the fault) and the stall of the interrupted streams (their longest gap
between two tokens), then the ratios against stop_and_restart next to the paper's (LUMEN,
arXiv 2606.17787, 4 workers: TTFT -44%, TPOT -16%, recovery -50%). Every stream is checked
against the failure-free stream token for token. Prints a table; asserts nothing.

    python bench/recovery.py [--duration 60] [--rate 3] [--fault-at 20] [--time-scale 8]

Needs the etcd binary. One run of the four configurations takes about 6 minutes on two
cores.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

from lumenctl.demo import read_view
from lumenctl.localcluster import LocalCluster
from lumend.cluster.view import ClusterView
from lumend.engine.sim_core import decode, encode, reference_completion

PAPER = {"ttft": -0.44, "tpot": -0.16, "recovery": -0.50}
VICTIM = "node-2-w0"
CONFIGS = ("stop_and_restart", "fixed_checkpoint", "lumen", "lumen+shadows")
WINDOW_S = 3.0  # the sliding window of the recovery time
STEP_S = 0.25


@dataclass(frozen=True)
class Request:
    at: float  # seconds after the trace starts
    prompt: str
    max_tokens: int


@dataclass
class Outcome:
    request: Request
    sent_at: float = 0.0
    token_times: list[float] = field(default_factory=list)
    text: str = ""
    error: str = ""

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


async def run_one(session: aiohttp.ClientSession, gateway: str, request: Request,
                  outcome: Outcome) -> None:
    outcome.sent_at = time.monotonic()
    body = {"prompt": request.prompt, "max_tokens": request.max_tokens, "stream": True}
    try:
        async with session.post(gateway + "/v1/completions", json=body) as r:
            if r.status != 200:
                outcome.error = f"HTTP {r.status}: {await r.text()}"
                return
            async for raw in r.content:
                line = raw.decode().strip()
                if not line.startswith("data:") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[5:])
                if "error" in chunk:
                    outcome.error = chunk["error"]["message"]
                    continue
                outcome.token_times.append(time.monotonic())
                outcome.text += chunk["choices"][0]["text"]
    except aiohttp.ClientError as exc:
        outcome.error = f"{type(exc).__name__}: {exc}"


async def replay(cluster: LocalCluster, requests: list[Request], fault_at: float
                 ) -> tuple[list[Outcome], float]:
    """Every request of the trace, with the fault at `fault_at`; (outcomes, fault time)."""
    gateways = [n.gateway for n in cluster.nodes]
    outcomes = [Outcome(r) for r in requests]
    timeout = aiohttp.ClientTimeout(total=None, sock_read=120)
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        start = time.monotonic()

        async def later(i: int, request: Request) -> None:
            await asyncio.sleep(max(0.0, start + request.at - time.monotonic()))
            await run_one(session, gateways[i % len(gateways)], request, outcomes[i])

        async def fault() -> float:
            await asyncio.sleep(max(0.0, start + fault_at - time.monotonic()))
            view = await asyncio.to_thread(read_view, cluster.endpoints, cluster.cluster)
            pid = next(e.pid for e in view.workers[VICTIM].engines if e.role == "active")
            assert pid is not None
            os.kill(pid, signal.SIGKILL)
            return time.monotonic()

        fault_task = asyncio.create_task(fault())
        await asyncio.gather(*(later(i, r) for i, r in enumerate(requests)))
        fault_time = await fault_task
    for o in outcomes:  # times relative to the trace start
        o.sent_at -= start
        o.token_times = [t - start for t in o.token_times]
    return outcomes, fault_time - start


def recovery_time(outcomes: list[Outcome], fault: float, warmup: float) -> float | None:
    """Seconds from the fault until the mean TTFT of the requests sent in a window starting
    then is within 10% of the level before the fault; None: never within the trace."""
    ok = [o for o in outcomes if o.token_times]
    before = [o.ttft for o in ok if warmup <= o.sent_at < fault]
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
    migrations: str = ""


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
        config=config, ttft_ms=1000 * statistics.fmean(o.ttft for o in ok),
        tpot_ms=1000 * statistics.fmean(tpots),
        recovery_s=recovery_time(ok, fault, warmup),
        stall_s=statistics.fmean(o.stall for o in interrupted) if interrupted else 0.0,
        interrupted=len(interrupted), requests=len(outcomes),
        errors=len(outcomes) - len(ok), mismatches=mismatches, restored_tokens=restored)


# -- the cluster ------------------------------------------------------------------------


def lumenctl(cluster: LocalCluster, *args: str) -> None:
    subprocess.run([sys.executable, "-m", "lumenctl", "--config", "/nonexistent.toml",
                    "--endpoints", ",".join(cluster.endpoints), "--cluster", cluster.cluster,
                    *args], check=True, capture_output=True, text=True)


def whole_and_idle(view: ClusterView, workers: int, shadows: int) -> bool:
    return (len(view.workers) == workers and view.coordinator is not None
            and all(w.state == "serving" and w.load.running + w.load.waiting == 0
                    and sorted(e.state for e in w.engines) == ["active", *["standby"] * shadows]
                    for w in view.workers.values()))


def wait_whole(cluster: LocalCluster, shadows: int, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while not whole_and_idle(read_view(cluster.endpoints, cluster.cluster), cluster.size,
                             shadows):
        if time.monotonic() > deadline:
            raise TimeoutError(f"the cluster was not whole and idle within {timeout_s} s; "
                               f"see the logs in {cluster.workdir}")
        time.sleep(0.2)
    time.sleep(2.0)  # every node's view (one HA cycle) and the coordinator's


def restored_tokens(cluster: LocalCluster) -> float:
    total = 0.0
    for worker in read_view(cluster.endpoints, cluster.cluster).workers.values():
        for engine in worker.engines:
            try:
                with urllib.request.urlopen(engine.url + "/metrics", timeout=5) as r:
                    for line in r.read().decode().splitlines():
                        if line.startswith("lumen_sim_restored_tokens_total "):
                            total += float(line.split()[1])
            except OSError:
                pass  # a standby or restarting engine
    return total


def run_config(cluster: LocalCluster, config: str, requests: list[Request],
               args: argparse.Namespace) -> Result:
    shadows = 1 if config.endswith("+shadows") else 0
    mode = config.removesuffix("+shadows")
    wait_whole(cluster, shadows)
    lumenctl(cluster, "config", "set", "mode", mode)
    time.sleep(1.0)
    restored_before = restored_tokens(cluster)
    print(f"  {config}: {len(requests)} requests over {args.duration:g} s, fault on "
          f"{VICTIM} at {args.fault_at:g} s ...", file=sys.stderr, flush=True)
    outcomes, fault = asyncio.run(replay(cluster, requests, args.fault_at))
    restored = restored_tokens(cluster) - restored_before
    return summarise(config, outcomes, fault, args.warmup, restored)


# -- output -----------------------------------------------------------------------------


def ratio(value: float | None, base: float | None) -> str:
    if value is None or base is None or base == 0:
        return "n/a"
    return f"{value / base - 1:+.0%}"


def table(results: list[Result]) -> str:
    base = results[0] if results and results[0].config == "stop_and_restart" else None
    head = (f"{'config':<18} {'TTFT ms':>8} {'TPOT ms':>8} {'recovery s':>10} "
            f"{'stall s':>8} {'interr.':>7} {'restored':>9} {'errors':>6} {'diff':>5}   "
            f"{'TTFT vs S&R':>11} {'TPOT vs S&R':>11} {'recov. vs S&R':>13}")
    lines = [head, "-" * len(head)]
    for r in results:
        recovery = "never" if r.recovery_s is None else f"{r.recovery_s:.2f}"
        lines.append(
            f"{r.config:<18} {r.ttft_ms:8.1f} {r.tpot_ms:8.2f} {recovery:>10} "
            f"{r.stall_s:8.2f} {r.interrupted:7d} {r.restored_tokens:9.0f} {r.errors:6d} "
            f"{r.mismatches:5d}   "
            f"{ratio(r.ttft_ms, base.ttft_ms if base else None):>11} "
            f"{ratio(r.tpot_ms, base.tpot_ms if base else None):>11} "
            f"{ratio(r.recovery_s, base.recovery_s if base else None):>13}")
    lines.append(f"{'paper (4 workers)':<18} {'':>8} {'':>8} {'':>10} {'':>8} {'':>7} "
                 f"{'':>9} {'':>6} {'':>5}   {PAPER['ttft']:>+11.0%} {PAPER['tpot']:>+11.0%} "
                 f"{PAPER['recovery']:>+13.0%}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration", type=float, default=60.0, help="trace length, s")
    parser.add_argument("--rate", type=float, default=3.0, help="arrivals per second")
    parser.add_argument("--fault-at", type=float, default=20.0, help="s into the trace")
    parser.add_argument("--warmup", type=float, default=4.0,
                        help="requests sent before this are left out of the pre-fault level")
    parser.add_argument("--prompt", type=int, nargs=2, default=(600, 1400),
                        metavar=("MIN", "MAX"), help="prompt length range, tokens")
    parser.add_argument("--output", type=int, nargs=2, default=(100, 200),
                        metavar=("MIN", "MAX"), help="output length range, tokens")
    parser.add_argument("--time-scale", type=float, default=8.0,
                        help="sim engine slowdown (the machine must keep up with it)")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--configs", default=",".join(CONFIGS),
                        help=f"comma-separated, from {', '.join(CONFIGS)}")
    parser.add_argument("--workdir", type=Path, default=None,
                        help="keep the clusters' logs here (default: a temporary directory)")
    args = parser.parse_args()
    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    unknown = [c for c in configs if c not in CONFIGS]
    if unknown:
        parser.error(f"unknown configs {unknown}; choose from {', '.join(CONFIGS)}")
    requests = trace(args.seed, args.duration, args.rate, tuple(args.prompt),
                     tuple(args.output))
    results: list[Result] = []
    with tempfile.TemporaryDirectory(prefix="lumen-bench-recovery-") as tmp:
        root = args.workdir or Path(tmp)
        for shadows in (0, 1):
            group = [c for c in configs if c.endswith("+shadows") == bool(shadows)]
            if not group:
                continue
            cluster = LocalCluster(root / f"shadows{shadows}", size=4, shadows=shadows,
                                   lease_ttl_s=3,
                                   engine_args=("--time-scale", str(args.time_scale)))
            try:
                cluster.start()
                for config in group:
                    results.append(run_config(cluster, config, requests, args))
            finally:
                cluster.stop()
    print(f"recovery on a local cluster: 4 workers (sim-small, time scale "
          f"{args.time_scale:g}), {len(requests)} requests over {args.duration:g} s, prompts "
          f"{args.prompt[0]}-{args.prompt[1]} tokens, outputs {args.output[0]}-"
          f"{args.output[1]}, SIGKILL of {VICTIM}'s active engine at {args.fault_at:g} s")
    print(table(results))
    print("stall: the longest gap between two tokens of the interrupted streams (mean); "
          "restored: tokens resumed from checkpoints instead of recomputed; diff: streams "
          "that differ from the failure-free stream")


if __name__ == "__main__":
    main()

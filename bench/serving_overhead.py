"""Where a request's time goes outside the engine's model, as load grows, on the real local
cluster.

The validation (`bench/validate_sim.py`) found the real cluster's mean TTFT above the
simulated one by more at higher load (+0.02 s before the fault, +0.05 s after the worker is
back), while the simulator adds one serving overhead measured on the idle cluster. This
bench measures that overhead under load and splits it by where it arises: one cluster, a
failure-free trace at each arrival rate in turn (under each recovery mode: LUMEN's
checkpoint streaming runs in the same processes), and per rate the mean TTFT as

- the client sees it (send to first token, this process),
- the gateways report it (`lumen_gateway_ttft_seconds`: the request in to its first token
  out), with the coordinator's admission inside (`lumen_gateway_decision_seconds{call=
  "admit"}`),
- the engines report it (`vllm:time_to_first_token_seconds`: the request's arrival at the
  engine's API server to its first token out; the engine's queueing and batching, which
  the simulator models, are in here, and so is any lag behind the cost model: the steps
  given up (`lumen_sim_step_late_seconds_total`) and the mean overrun per step, how far
  past its scheduled end each step was committed and its tokens sent
  (`lumen_sim_step_overrun_seconds_total`: a busy event loop or CPU wakes the engine late),

and their differences: client - gateway (the client's and the gateway's HTTP, and this
process's own event loop, whose lag is measured by a 10 ms ticker), gateway - engine (the
admission, the upstream request and the relay of the first token). The serving overhead
the simulator needs is client - engine; the bench fits it against the streams in flight
(Little's law: arrivals per second x mean end-to-end seconds) and prints the line.

    python bench/serving_overhead.py [--rates 0.5 1.5 2.5 3.0] [--duration 40]
        [--modes lumen stop_and_restart] [--model sim-medium] [--time-scale 8] [--seed 7]

The scrape and the split (`snapshot`, `ServingSplit`, `SplitWatch`) are also what
bench/validate_sim.py records before and after its fault.

Asserts nothing; prints a table and the fit. Needs the etcd binary. About 1 minute to start
plus modes x rates x (duration + ~15 s).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
import urllib.request
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from lumenctl.localcluster import LocalCluster
from lumenctl.recovery import Replay, lumenctl, read_view, trace, wait_whole

GATEWAY_SERIES = ("lumen_gateway_ttft_seconds", "lumen_gateway_decision_seconds")
ENGINE_SERIES = ("vllm:time_to_first_token_seconds",)
ENGINE_COUNTERS = ("lumen_sim_step_late_seconds_total", "lumen_sim_step_seconds_total",
                   "lumen_sim_step_overrun_seconds_total", "lumen_sim_steps_total")
TICK_S = 0.01


def parse_metrics(text: str, histograms: Sequence[str], counters: Sequence[str] = (),
                  ) -> dict[str, float]:
    """`name_sum` and `name_count` of each histogram (summed over label sets, except that
    the gateway's decision seconds keep only the admissions) and each counter's value."""
    out: dict[str, float] = defaultdict(float)
    for line in text.splitlines():
        if line.startswith("#") or not line.strip():
            continue
        series, _, value = line.rpartition(" ")
        name, _, labels = series.partition("{")
        if name in counters:
            out[name] += float(value)
            continue
        for histogram in histograms:
            if name in (histogram + "_sum", histogram + "_count"):
                if histogram == "lumen_gateway_decision_seconds" and 'call="admit"' not in labels:
                    continue
                out[name] += float(value)
    return out


def fetch(url: str) -> str:
    with urllib.request.urlopen(url, timeout=5) as response:
        return str(response.read().decode())


def snapshot(cluster: LocalCluster) -> dict[str, float]:
    """The series per source, "SOURCE|name" (a node's gateway by node name, an engine as
    "worker@URL#pid"): an engine that restarts, on the same URL or not, starts its own from
    zero, and `change` counts a new source from zero."""
    out: dict[str, float] = {}
    for node in cluster.nodes:
        for k, v in parse_metrics(fetch(node.metrics_url), GATEWAY_SERIES).items():
            out[f"{node.name}|{k}"] = v
    view = read_view(cluster.endpoints, cluster.cluster)
    for worker in view.workers.values():
        for engine in worker.engines:
            if engine.state == "active":
                text = fetch(engine.url + "/metrics")
                for k, v in parse_metrics(text, ENGINE_SERIES, ENGINE_COUNTERS).items():
                    out[f"{worker.name}@{engine.url}#{engine.pid}|{k}"] = v
    return out


def engine_changes(after: dict[str, float], before: dict[str, float]
                   ) -> dict[str, dict[str, float]]:
    """`change` per worker: what each worker's engines still there observed."""
    out: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for key, value in after.items():
        source, _, name = key.partition("|")
        worker, at, _ = source.partition("@")
        if at:
            out[worker][name] += value - before.get(key, 0.0)
    return out


def change(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    """What every source still there observed between two snapshots, summed by series (a
    source gone since, such as a killed engine, is left out: what it observed in between
    is lost)."""
    total: dict[str, float] = defaultdict(float)
    for key, value in after.items():
        total[key.partition("|")[2]] += value - before.get(key, 0.0)
    return total


def mean_of(delta: dict[str, float], histogram: str) -> tuple[float, int]:
    count = round(delta.get(histogram + "_count", 0.0))
    return (delta.get(histogram + "_sum", 0.0) / count if count else float("nan")), count


SPLIT_BEFORE_FAULT_S = 1.0


@dataclass(frozen=True)
class ServingSplit:
    """Mean TTFT at the gateways (request in to first token out) and at the engines
    (arrival at the engine's API server to first token out) over the first tokens out
    between `since` and `until` (s into the trace): the real side's serving path is
    client - engine; the engines' own queueing and batching are in `engine_s`. After the
    fault the engines also count each resumed request's first token on its new engine (a
    request the gateways count once), and the killed engine's last second is lost."""

    since: float
    until: float
    gateway_s: float
    engine_s: float
    counted: tuple[int, int]  # first tokens the gateways and the engines observed
    # Per worker (by name): first tokens its engines observed and their mean TTFT, which
    # shows how admission spread the requests.
    workers: dict[str, tuple[int, float]] = field(default_factory=dict)
    # The engines' mean overrun per step (`lumen_sim_step_overrun_seconds_total`): how far
    # past its scheduled end a step was committed, its tokens with it.
    overrun_s: float = float("nan")

    @staticmethod
    def of(after: dict[str, float], before: dict[str, float], since: float, until: float
           ) -> ServingSplit:
        delta = change(after, before)
        gateway_s, gateway_n = mean_of(delta, "lumen_gateway_ttft_seconds")
        engine_s, engine_n = mean_of(delta, "vllm:time_to_first_token_seconds")
        workers = {}
        for worker, series in sorted(engine_changes(after, before).items()):
            mean, count = mean_of(series, "vllm:time_to_first_token_seconds")
            workers[worker] = (count, mean)
        steps = delta.get("lumen_sim_steps_total", 0.0)
        overrun = (delta.get("lumen_sim_step_overrun_seconds_total", 0.0) / steps if steps
                   else float("nan"))
        return ServingSplit(since, until, gateway_s, engine_s, (gateway_n, engine_n),
                            workers, overrun)


class SplitWatch:
    """Scrapes the gateways' and engines' TTFT histograms before the trace, SPLIT_BEFORE_
    FAULT_S before the fault and (`end`) after the trace: the split before and after."""

    def __init__(self, cluster: LocalCluster) -> None:
        self.start = snapshot(cluster)
        self.at_fault: dict[str, float] | None = None
        self.splits: list[ServingSplit] = []

    async def __call__(self, run: Replay) -> None:
        assert run.fault_at is not None
        await asyncio.sleep(max(0.0, run.fault_at - SPLIT_BEFORE_FAULT_S - run.now()))
        at = run.now()
        self.at_fault = await asyncio.to_thread(snapshot, run.cluster)
        self.splits.append(ServingSplit.of(self.at_fault, self.start, 0.0, at))

    def end(self, cluster: LocalCluster, now: float) -> None:
        if self.at_fault is not None:
            self.splits.append(ServingSplit.of(snapshot(cluster), self.at_fault,
                                               self.splits[0].until, now))


@dataclass(frozen=True)
class Row:
    mode: str
    rate: float
    in_flight: float  # streams in flight on average (Little's law)
    completed: int
    client_s: float
    gateway_s: float
    engine_s: float
    admit_s: float
    counted: tuple[int, int]  # first tokens the gateways and the engines observed
    late_s: float  # the engines' lag behind their cost model, summed
    overrun_s: float  # mean per step: committed past its scheduled end (StepClock.ended)
    loop_lag_s: float  # this process's event loop: mean overshoot of a 10 ms sleep
    load: float

    @property
    def overhead_s(self) -> float:
        return self.client_s - self.engine_s


async def ticker(lags: list[float], stop: asyncio.Event) -> None:
    while not stop.is_set():
        before = time.monotonic()
        await asyncio.sleep(TICK_S)
        lags.append(time.monotonic() - before - TICK_S)


async def replay_measuring_lag(run: Replay) -> float:
    lags: list[float] = []
    stop = asyncio.Event()
    tick = asyncio.create_task(ticker(lags, stop))
    try:
        await run.run()
    finally:
        stop.set()
        await tick
    return statistics.fmean(lags) if lags else 0.0


def run_rate(cluster: LocalCluster, mode: str, rate: float, args: argparse.Namespace
             ) -> Row:
    requests = trace(args.seed, args.duration, rate, tuple(args.prompt), tuple(args.output))
    if not requests:
        raise SystemExit(f"rate {rate:g}/s over {args.duration:g} s sent no request (seed "
                         f"{args.seed}): raise --duration or the rate")
    before = snapshot(cluster)
    run = Replay(cluster, requests, None, "")
    loop_lag = asyncio.run(replay_measuring_lag(run))
    time.sleep(1.0)  # the last requests' histograms are observed as their streams end
    after = snapshot(cluster)
    delta = change(after, before)
    ok = [o for o in run.outcomes if not o.error and o.token_times]
    if not ok:
        errors = sorted({o.error for o in run.outcomes if o.error})
        raise SystemExit(f"{mode} at {rate:g}/s: no request completed ({'; '.join(errors)}); "
                         f"the cluster's logs are under {cluster.workdir}")
    gateway_s, gateway_n = mean_of(delta, "lumen_gateway_ttft_seconds")
    engine_s, engine_n = mean_of(delta, "vllm:time_to_first_token_seconds")
    admit_s, _ = mean_of(delta, "lumen_gateway_decision_seconds")
    e2e = [o.token_times[-1] - o.sent_at for o in ok]
    span = max(o.request.at for o in run.outcomes) if run.outcomes else args.duration
    steps = delta.get("lumen_sim_steps_total", 0.0)
    overrun = delta.get("lumen_sim_step_overrun_seconds_total", 0.0) / steps if steps else 0.0
    return Row(mode, rate, len(ok) / max(span, 1e-9) * statistics.fmean(e2e), len(ok),
               statistics.fmean(o.ttft for o in ok), gateway_s, engine_s, admit_s,
               (gateway_n, engine_n), delta.get("lumen_sim_step_late_seconds_total", 0.0),
               overrun, loop_lag, os.getloadavg()[0])


def fit(rows: Sequence[Row]) -> tuple[float, float]:
    """Least squares overhead = a + b x streams in flight."""
    xs, ys = [r.in_flight for r in rows], [r.overhead_s for r in rows]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx if sxx else 0.0
    return my - b * mx, b


def report(rows: Sequence[Row]) -> str:
    ms = 1e3
    lines = [f"{'mode':<16} {'rate/s':>6} {'streams':>7} {'done':>5} {'client':>7} {'gateway':>7} "
             f"{'engine':>7} {'cl-gw':>6} {'gw-eng':>6} {'admit':>6} {'cl-eng':>6} "
             f"{'late s':>6} {'overrun':>7} {'loop':>5} {'counted':>9} {'load':>5}",
             f"{'':<16} {'':>6} {'':>7} {'':>5} {'(mean TTFT, ms)':>23} {'(ms)':>20} "
             f"{'':>6} {'':>6} {'ms/step':>7} {'(ms)':>5}"]
    for r in rows:
        lines.append(
            f"{r.mode:<16} {r.rate:>6.2f} {r.in_flight:>7.1f} {r.completed:>5} "
            f"{r.client_s * ms:>7.0f} {r.gateway_s * ms:>7.0f} {r.engine_s * ms:>7.0f} "
            f"{(r.client_s - r.gateway_s) * ms:>6.1f} {(r.gateway_s - r.engine_s) * ms:>6.1f} "
            f"{r.admit_s * ms:>6.1f} {r.overhead_s * ms:>6.1f} {r.late_s:>6.2f} "
            f"{r.overrun_s * ms:>7.2f} "
            f"{r.loop_lag_s * ms:>5.1f} {r.counted[0]:>4}/{r.counted[1]:<4} {r.load:>5.2f}")
    for mode in dict.fromkeys(r.mode for r in rows):
        mine = [r for r in rows if r.mode == mode]
        if len(mine) >= 2:
            a, b = fit(mine)
            lines.append(f"{mode}: serving overhead (client - engine) ~= {a * ms:.1f} ms + "
                         f"{b * ms:.2f} ms x streams in flight (least squares over "
                         f"{len(mine)} rates)")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rates", type=float, nargs="+", default=[0.5, 1.5, 2.5, 3.0],
                        help="arrivals per second, all gateways together, one block each")
    parser.add_argument("--duration", type=float, default=40.0, help="trace per rate, s")
    parser.add_argument("--modes", nargs="+", default=["lumen", "stop_and_restart"],
                        help="the cluster's recovery modes, each over every rate")
    parser.add_argument("--prompt", type=int, nargs=2, default=(600, 1400))
    parser.add_argument("--output", type=int, nargs=2, default=(100, 200))
    parser.add_argument("--time-scale", type=float, default=8.0)
    parser.add_argument("--model", default="sim-medium")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--workdir", type=Path, default=None)
    args = parser.parse_args()
    if any(r <= 0 for r in args.rates) or args.duration <= 0:
        parser.error("--rates and --duration must be positive")
    root = args.workdir or Path(tempfile.mkdtemp(prefix="lumen-serving-overhead-"))
    cluster = LocalCluster(root, size=2, shadows=0, lease_ttl_s=3, model=args.model,
                           engine_args=("--time-scale", f"{args.time_scale:g}"))
    rows: list[Row] = []
    try:
        cluster.start()
        wait_whole(cluster, 0)
        for mode in args.modes:
            lumenctl(cluster, "config", "set", "mode", mode, "--yes")
            time.sleep(3.0)
            for rate in args.rates:
                row = run_rate(cluster, mode, rate, args)
                rows.append(row)
                print(f"{mode} at {rate:g}/s: client {row.client_s:.3f} s, engine "
                      f"{row.engine_s:.3f} s, load {row.load:.2f}", file=sys.stderr,
                      flush=True)
    finally:
        cluster.stop()
    print(report(rows))
    print("2 shared cores carry the whole cluster and this client: the overhead is the "
          "machine's as much as the code's")


if __name__ == "__main__":
    main()

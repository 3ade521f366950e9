"""The simulator against the real local cluster: one trace, one fault, the same cost model.

Real: --nodes lumend nodes (one sim worker each, no shadows, time-scaled sim engines of
--model) on one etcd, with their gateways, coordinator and checkpoint holders, in --policy's
mode; a seeded trace (Poisson arrivals, prompt and output lengths uniform in the given
ranges) streams through the gateways and node-2-w0's engine is SIGKILLed at --fault-at
(`--fault kill`) or SIGSTOPped (`--fault hang`: alive, answering nothing, until its
supervisor's probes kill it). Simulated: the same requests (arriving when the real ones were
sent) through `lumenctl sim`'s engine set up as those sim engines (`lumend.sim.local`: the
sim engine's step formula and coefficients x time scale, its prefill chunk, batch and KV
limits, its restart), the same fault at the moment the real signal was sent (a hang: killed
after the supervisor's modelled `hung_kill_after_s`; the real kill's moment is printed
beside it), the same policy.

Both sides are measured by the same functions: mean TTFT and mean TPOT over every
completed request (TPOT per request: first to last token over its tokens - 1), the
recovery time (`recovery_s`), the interrupted streams (real: the recovery decisions the
gateways logged; simulated: the requests on the killed worker, first token or not) and the
failure-free TTFT (requests sent after --warmup and at least 5 s before the fault). What
the cost model does not know is measured on the real cluster and given to the simulator,
and the output says so: the restarted engine's process start (kill-to-serving minus the
model's initialisation) and the serving overhead per request (under load: the clients'
mean TTFT minus the engines' own, `vllm:time_to_first_token_seconds`, over the first
tokens before the fault; `--overhead idle`: a lone request's TTFT through a gateway minus
the model's). The simulator's admission reads the workers' queues as the coordinator does
(`--admission-heartbeat`). Asserts nothing; prints the table, where the real side's time
went before and after the fault (client, gateways, engines, per worker, against the
simulated engines), how far the sim engines fell behind their cost model, and the load
average (2 shared cores: the real side's timing is the machine's too).

Several seeds and policies run one after another (each seed's trace under each policy, a
fresh cluster per run), and then a summary: per policy and metric the mean simulated /
real ratio over the seeds with its 95% Student-t interval and how many runs were within
15%, and LUMEN / stop-and-restart mean TTFT paired by seed, real and simulated.

    python bench/validate_sim.py [--model sim-medium] [--nodes 2] [--rate 2.5]
        [--duration 150] [--fault-at 45] [--fault kill|hang] [--warmup 20] [--time-scale 8]
        [--policy lumen [stop_and_restart ...]] [--seed 7 [11 ...]] [--save F.json]
    python bench/validate_sim.py --resimulate F.json   # the simulated side again, no cluster
        [--overhead loaded|idle] [--admission-heartbeat S]

Needs the etcd binary. About 4.5 minutes per run with the defaults.
"""

from __future__ import annotations

import argparse
import asyncio
import gzip
import json
import math
import os
import random
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import aiohttp

from lumenctl.admissions import first_admissions, read_admissions
from lumenctl.localcluster import LocalCluster, process_running
from lumenctl.recovery import (
    DecisionLog,
    Outcome,
    Replay,
    Request,
    lumenctl,
    read_view,
    trace,
    wait_whole,
)
from lumenctl.sse import data_events
from lumend.engine.sim_core import Scheduler, SimRequest, StepOutput
from lumend.engine.sim_models import sim_model
from lumend.sim.config import FaultKind, SimConfig, apply_policy
from lumend.sim.engine import simulate
from lumend.sim.local import LOCAL_HEARTBEAT_S, local_cluster_config, sim_engine_cost
from lumend.sim.stats import interval, paired_ratio
from lumend.sim.sweep import request_seconds
from lumend.sim.workload import Workload

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/: the serving-path scrape
from serving_overhead import ServingSplit, SplitWatch

VICTIM = "node-2-w0"
MODELS = ("sim-medium", "sim-small")  # the same step costs; sim-medium restarts in 6 s x scale
POLICIES = ("lumen", "fixed_checkpoint", "stop_and_restart")
# --fault: what is done to the victim's engine, and the simulator's fault kind for it.
FAULT_SIGNALS = {"kill": signal.SIGKILL, "hang": signal.SIGSTOP}
SIM_FAULTS = {"kill": FaultKind.worker, "hang": FaultKind.hang}
UNTOUCHED_BEFORE_FAULT_S = 5.0
RECOVERY_WINDOW_S, RECOVERY_STEP_S = 10.0, 0.5
# Back within 50% of the level (the table's recovery time) and, as the simulator's rule
# has it, within 20%: a 10 s window holds ~25 requests here; its mean TTFT was 0.77-1.16x
# the level before the fault and up to 1.43x after the worker was back (one burst), so at
# 20% noise decides the answer.
RECOVERY_TOLERANCES = (0.5, 0.2)
AGREEMENT = 0.15  # the bar: simulated within 15% of real
PROBES = 10  # lone requests per path for the idle TTFT
PROBE_TOKENS = 1000  # their prompt (a probe prefix adds a few)
PROBE_PAUSE_S = 0.2  # between probes: each finds the engine idle


@dataclass(frozen=True)
class Served:
    """One request as both sides report it (seconds from the trace's start)."""

    sent: float
    first: float
    last: float
    tokens: int
    interrupted: bool
    worker: int = -1  # simulated: the worker (in name order) its first token came from
    admitted: int = -1  # the worker (in name order) its first admission chose; -1: unknown
    request_id: str = ""  # real: the gateway's id, as its admission lines name it

    @property
    def ttft(self) -> float:
        return self.first - self.sent

    @property
    def tpot(self) -> float | None:
        return (self.last - self.first) / (self.tokens - 1) if self.tokens > 1 else None


@dataclass(frozen=True)
class Side:
    ttft_s: float
    tpot_s: float
    recovery_s: float | None  # back within the first of RECOVERY_TOLERANCES
    recovery_strict_s: float | None  # ... the second
    interrupted: int
    failure_free_ttft_s: float
    completed: int
    back_after_s: float | None


def failure_free_ttft(served: Sequence[Served], fault: float, warmup: float) -> float:
    """Mean TTFT of the requests sent after the warm-up and well before the fault (a request
    sent just before it can still be waiting on the killed engine)."""
    return statistics.fmean(s.ttft for s in served
                            if warmup <= s.sent < fault - UNTOUCHED_BEFORE_FAULT_S)


def recovery_s(served: Sequence[Served], fault: float, warmup: float,
               tolerance: float) -> float | None:
    """Seconds from the fault until TTFT is back to stay: the simulator's rule (the level
    before the fault, `failure_free_ttft`; TTFT over windows of arrivals, back when within
    `tolerance` above the level) at the local run's scale: 10 s windows sliding by 0.5 s,
    recovered at the first window after the last one above the level; 0 if none is,
    None if the trace ends above it."""
    level = failure_free_ttft(served, fault, warmup)
    end = max(s.sent for s in served)
    last_high: float | None = None
    t = fault
    while t + RECOVERY_WINDOW_S <= end:
        window = [s.ttft for s in served if t <= s.sent < t + RECOVERY_WINDOW_S]
        if window and statistics.fmean(window) > (1 + tolerance) * level:
            last_high = t
        t += RECOVERY_STEP_S
    if last_high is None:
        return 0.0
    if last_high + RECOVERY_STEP_S >= t:
        return None
    return last_high + RECOVERY_STEP_S - fault


def measure(served: Sequence[Served], fault: float, warmup: float,
            back_after: float | None, interrupted: int | None = None) -> Side:
    tpots = [t for s in served if (t := s.tpot) is not None]
    return Side(
        ttft_s=statistics.fmean(s.ttft for s in served),
        tpot_s=statistics.fmean(tpots),
        recovery_s=recovery_s(served, fault, warmup, RECOVERY_TOLERANCES[0]),
        recovery_strict_s=recovery_s(served, fault, warmup, RECOVERY_TOLERANCES[1]),
        interrupted=(sum(s.interrupted for s in served) if interrupted is None
                     else interrupted),
        failure_free_ttft_s=failure_free_ttft(served, fault, warmup),
        completed=len(served), back_after_s=back_after)


# -- the real cluster -------------------------------------------------------------------


def real_served(outcomes: Sequence[Outcome], admitted: Mapping[str, int] | None = None
                ) -> list[Served]:
    """Completed streams (interruptions are counted from the gateways' decisions);
    `admitted`: the worker each request id was first admitted to (`RealRun.admitted`)."""
    admitted = admitted or {}
    return [Served(o.sent_at, o.token_times[0], o.token_times[-1], o.request.max_tokens,
                   False, admitted=admitted.get(o.request_id, -1), request_id=o.request_id)
            for o in outcomes
            if not o.error and len(o.token_times) >= 2
            and len(o.text) == o.request.max_tokens]


@dataclass
class RealRun:
    outcomes: list[Outcome]
    fault: float
    killed_after: float  # the engine was gone this long after the fault (0: SIGKILL)
    back_after: float | None
    decisions: int  # recovery routing decisions the gateways logged: interrupted streams
    modelled_step_s: float  # the engines' steps as their cost model times them
    late_step_s: float  # time the engines fell behind that and gave up
    idle_ttft_direct_s: float  # a lone request straight to an engine
    idle_ttft_gateway_s: float  # the same through a gateway
    # Mean TTFT as the gateways and the engines observed it, before the fault (first tokens
    # out by SPLIT_BEFORE_FAULT_S before it) and after.
    splits: list[ServingSplit]
    # VICTIM's place among the workers in the coordinator's order (by name), which the
    # simulator's workers follow: admission breaks ties by that order, and which worker the
    # ties favour decides how many requests the killed one holds (seed 17,
    # stop-and-restart: simulated TTFT 1.79 s with the victim first, 2.05 s with it second,
    # as it was; real 2.05 s).
    victim_index: int
    # Request id -> the worker (index in name order) the gateways' first admission of it
    # chose, from their `[gateway] log_admissions` lines.
    admitted: dict[str, int]


def engine_metric_sum(urls: Sequence[str], name: str) -> float:
    import urllib.request

    total = 0.0
    for url in urls:
        with urllib.request.urlopen(url + "/metrics", timeout=5) as r:
            for line in r.read().decode().splitlines():
                if line.startswith(name + " "):
                    total += float(line.split()[1])
    return total


async def idle_ttft(url: str, prompt_tokens: int, count: int) -> float:
    """Median TTFT of `count` lone requests, one after another, to `url` (an engine or a
    gateway), after two that are not counted (first connections, first checkpoints).

    Each is read to its end and the next sent PROBE_PAUSE_S later, so that it finds the
    engine idle: a probe sent as soon as the one before gave its first token found the
    engine running that one's last step and waited for it (26 ms on sim-medium at time
    scale 8: 260 ms against an idle engine's 232, the model's 227)."""
    ttfts: list[float] = []
    async with aiohttp.ClientSession() as session:
        for i in range(count + 2):
            body = {"prompt": f"probe {i:02d} " + "x" * prompt_tokens, "max_tokens": 2,
                    "stream": True}
            started = time.monotonic()
            async with session.post(url + "/v1/completions", json=body) as r:
                async for _ in data_events(r.content):
                    if len(ttfts) == i:
                        ttfts.append(time.monotonic() - started)
            await asyncio.sleep(PROBE_PAUSE_S)
    return statistics.median(ttfts[2:])


class BackWatch:
    """When the victim's engine was gone (a hung one: when its supervisor killed it) and
    when the victim worker serves again from a new engine."""

    def __init__(self) -> None:
        self.back_at: float | None = None
        self.gone_at: float | None = None

    async def __call__(self, run: Replay) -> None:
        old: set[int | None] = set()
        gone = asyncio.create_task(self._gone(run))
        try:
            await self._back(run, old)
        finally:
            gone.cancel()
            await asyncio.gather(gone, return_exceptions=True)

    async def _gone(self, run: Replay) -> None:
        while run.fault_pid is None or process_running(run.fault_pid):
            await asyncio.sleep(0.02)
        self.gone_at = run.now()

    async def _back(self, run: Replay, old: set[int | None]) -> None:
        while self.back_at is None:
            view = await asyncio.to_thread(read_view, run.cluster.endpoints,
                                           run.cluster.cluster)
            worker = view.workers.get(run.victim)
            if worker is not None:
                active = {e.pid for e in worker.engines if e.state == "active"}
                if run.fault is None:
                    old = active or old
                elif worker.state == "serving" and active and not active & old:
                    self.back_at = run.now()
            await asyncio.sleep(0.1)


def wait_quiet(cluster: LocalCluster, timeout_s: float = 30.0) -> None:
    """Until every worker's heartbeat reports no request, then two heartbeats more (the
    coordinator reads etcd once a cycle): the trace starts from the empty cluster the
    simulator starts from. Started at once after the probes, the coordinator still saw the
    last probe on one worker, so the trace's first request went to the other, and ties
    broke the other way from there (seed 17: real 587 ms failure-free TTFT, simulated 647;
    the simulator with its first request on the other worker: 552-639 ms)."""
    deadline = time.monotonic() + timeout_s
    while True:
        view = read_view(cluster.endpoints, cluster.cluster)
        busy = {name: w.load.running + w.load.waiting for name, w in view.workers.items()
                if w.load.running + w.load.waiting}
        if not busy:
            break
        if time.monotonic() > deadline:
            raise SystemExit(f"the workers still report requests {timeout_s:g} s after the "
                             f"probes ended: {busy}; see the cluster's logs")
        time.sleep(0.1)
    time.sleep(2 * LOCAL_HEARTBEAT_S)


def run_real(requests: list[Request], args: argparse.Namespace, root: Path) -> RealRun:
    cluster = LocalCluster(root, size=args.nodes, shadows=0, lease_ttl_s=3, model=args.model,
                           engine_args=("--time-scale", f"{args.time_scale:g}"),
                           log_admissions=True)
    try:
        cluster.start()
        wait_whole(cluster, 0)
        lumenctl(cluster, "config", "set", "mode", args.policy, "--yes")
        time.sleep(1.0)
        engines = [e.url for w in read_view(cluster.endpoints, cluster.cluster).workers.values()
                   for e in w.engines if e.state == "active"]
        direct = asyncio.run(idle_ttft(engines[0], PROBE_TOKENS, PROBES))
        through = asyncio.run(idle_ttft(cluster.nodes[0].gateway, PROBE_TOKENS, PROBES))
        wait_quiet(cluster)
        decisions = DecisionLog(cluster)
        run = Replay(cluster, requests, args.fault_at, VICTIM, FAULT_SIGNALS[args.fault_kind])
        watch, split = BackWatch(), SplitWatch(cluster)

        async def both(run: Replay) -> None:
            await asyncio.gather(watch(run), split(run))

        asyncio.run(run.run(both))
        time.sleep(1.0)  # the last streams' histograms are observed as they end
        split.end(cluster, run.now())
        assert run.fault is not None
        back = None if watch.back_at is None else watch.back_at - run.fault
        if watch.gone_at is None:
            raise SystemExit(f"the {args.fault_kind} of {VICTIM}'s engine (pid "
                             f"{run.fault_pid}) at {run.fault:.1f} s: it never exited; see "
                             f"the cluster's logs in {root}")
        killed = max(0.0, watch.gone_at - run.fault)
        routed = len(decisions.new())
        wait_whole(cluster, 0)
        engines = [e.url for w in read_view(cluster.endpoints, cluster.cluster).workers.values()
                   for e in w.engines if e.state == "active"]
        modelled = engine_metric_sum(engines, "lumen_sim_step_seconds_total")
        late = engine_metric_sum(engines, "lumen_sim_step_late_seconds_total")
        names = sorted(read_view(cluster.endpoints, cluster.cluster).workers)
        first = first_admissions(read_admissions((n.name, n.log_path) for n in cluster.nodes))
        admitted = {rid: names.index(line.worker) for rid, line in first.items()
                    if line.worker in names}
        return RealRun(run.outcomes, run.fault, killed, back, routed, modelled, late, direct,
                       through, split.splits, names.index(VICTIM), admitted)
    finally:
        cluster.stop()


# -- the simulator ----------------------------------------------------------------------


def lone_ttft_s(model_name: str, tokens: int, time_scale: float) -> float:
    """A lone request's TTFT by the sim engine's own scheduler and cost model."""
    model = sim_model(model_name)
    scheduler = Scheduler(0, model.cost, model.limits)
    first: list[StepOutput | None] = []
    scheduler.add(SimRequest("probe", [65] * tokens, 1, first.append))
    seconds = 0.0
    while not first:
        step, decoding = scheduler.begin_step()
        seconds += step
        scheduler.end_step(decoding)
    return seconds * time_scale


def sent_requests(outcomes: Sequence[Outcome]) -> list[tuple[float, int, int]]:
    """(sent at, prompt tokens, output tokens) of every request the real run sent."""
    return sorted((o.sent_at, len(o.request.prompt), o.request.max_tokens) for o in outcomes)


def run_sim(sent: Sequence[tuple[float, int, int]], fault: float, victim: int,
            process_start_s: float, overhead_s: float, args: argparse.Namespace,
            phases: tuple[float, ...] = (), read_phase: float | None = None
            ) -> tuple[list[Served], float, int]:
    """The same requests (`sent_requests`), arriving when the real ones were sent; the
    fault at the real kill's moment on worker `victim` (`RealRun.victim_index`). Returns
    the requests served, when the worker was back after the fault and how many requests
    the fault cut off (on the killed worker, first token or not, as the gateways count
    them; not those admitted to a hung one before its kill: the engine never read them,
    and the gateways find them refused and admit them again). `phases`, `read_phase`: the
    workers' heartbeats and the coordinator's read of them as fractions of the heartbeat
    (SimConfig.admission_heartbeat_phases, admission_read_phase)."""
    workload = Workload([s[0] for s in sent], [s[1] for s in sent], [s[2] for s in sent])
    cfg = local_cluster_config(args.model, args.time_scale, args.nodes, fault_at_s=fault,
                               fault_kind=SIM_FAULTS[args.fault_kind],
                               restore_bytes_per_s=args.restore_mbps * 1e6,
                               process_start_s=process_start_s, request_overhead_s=overhead_s,
                               victim=victim,
                               heartbeat_s=args.admission_heartbeat_s)
    # A hung worker stalled as the product recorded did: never, before the stall existed.
    stall = args.hang_stall_s
    cfg = replace(cfg, hang_stall_s=cfg.hang_detect_s if stall is None else stall,
                  admission_heartbeat_phases=phases, admission_read_phase=read_phase)
    cfg = apply_policy(cfg, args.policy)
    result = simulate(workload, cfg)
    # The worker a request's first token came from: the victim's requests cut off with
    # their first token out finished elsewhere.
    out = [Served(r.arrival, r.first_token, r.finish, r.output, r.interrupted_at >= 0,
                  victim if r.interrupted_at >= 0 and r.first_token <= fault else r.worker,
                  r.admitted_to)
           for r in result.requests if r.finish >= 0]
    assert result.fault is not None and result.fault.back_at is not None
    # Back a restart after the engine was gone: after the fault, or after a hung one's kill.
    return out, result.fault.back_at - result.fault.at, result.fault.cut_off


def phase_spread(sent: Sequence[tuple[float, int, int]], fault: float, victim: int,
                 process_start_s: float, overhead_s: float, args: argparse.Namespace,
                 draws: int, seed: int) -> tuple[Side, ...]:
    """The simulated side under `draws` random phases of the nodes' heartbeats and of the
    coordinator's read of them (seeded by the trace's seed). Nobody chooses those phases on
    the real cluster, and they decide which of two tied workers a request goes to, and with
    it where a burst goes: one simulated run is one draw of them, the real run another."""
    if args.admission_heartbeat_s <= 0:
        return ()
    rng = random.Random(seed)
    sides = []
    for _ in range(draws):
        phases = tuple(rng.random() for _ in range(args.nodes))
        served, back, cut_off = run_sim(sent, fault, victim, process_start_s, overhead_s,
                                        args, phases, rng.random())
        sides.append(measure(served, fault, args.warmup, back, cut_off))
    return tuple(sides)


# -- output -----------------------------------------------------------------------------


def utilisation(model_name: str, rate: float, nodes: int, prompt: tuple[int, int],
                output: tuple[int, int], time_scale: float) -> float:
    """Offered load per worker as a share of one engine's capacity by the cost model (as
    `lumenctl sim --sweep --loads` states it)."""
    model = sim_model(model_name)
    seconds = request_seconds(sim_engine_cost(model, time_scale), sum(prompt) / 2,
                              sum(output) / 2, model.limits.prefill_chunk)
    return rate / nodes * seconds


def rows(real: Side, sim: Side) -> list[tuple[str, float | None, float | None, str]]:
    """(metric, real, simulated, unit) for the table and the summary over seeds."""
    return [
        ("mean TTFT", real.ttft_s, sim.ttft_s, "s"),
        ("mean TPOT", real.tpot_s, sim.tpot_s, "s"),
        (f"recovery time ({RECOVERY_TOLERANCES[0]:.0%})", real.recovery_s, sim.recovery_s,
         "s"),
        (f"recovery time ({RECOVERY_TOLERANCES[1]:.0%})", real.recovery_strict_s,
         sim.recovery_strict_s, "s"),
        ("requests interrupted", real.interrupted, sim.interrupted, ""),
        ("failure-free TTFT", real.failure_free_ttft_s, sim.failure_free_ttft_s, "s"),
        ("worker back after", real.back_after_s, sim.back_after_s, "s"),
        ("requests completed", real.completed, sim.completed, ""),
    ]


SUMMARISED = ("mean TTFT", "mean TPOT", f"recovery time ({RECOVERY_TOLERANCES[0]:.0%})",
              f"recovery time ({RECOVERY_TOLERANCES[1]:.0%})", "requests interrupted",
              "failure-free TTFT")


@dataclass(frozen=True)
class Validation:
    """One seed under one policy, measured on both sides."""

    seed: int
    policy: str
    real: Side
    sim: Side
    # The simulated side again under random heartbeat and coordinator read phases
    # (`phase_spread`); empty: not drawn.
    spread: tuple[Side, ...] = ()


def summary(runs: Sequence[Validation]) -> str:
    """Per policy and metric: the mean simulated / real ratio over seeds with its 95%
    interval and the runs within AGREEMENT; then LUMEN / stop-and-restart mean TTFT paired
    by seed on each side. A metric with no ratio in a run (never recovered, or 0 real) is
    left out of that run's count and said so."""
    lines = [f"{'policy':<18} {'metric':<22} {'sim / real (95%)':>18} {'within':>7}  "
             "per seed", "-" * 90]
    for policy in dict.fromkeys(r.policy for r in runs):
        mine = [r for r in runs if r.policy == policy]
        for metric in SUMMARISED:
            ratios = [(run.seed, sim / real) for run in mine
                      for name, real, sim, _ in rows(run.real, run.sim)
                      if name == metric and real and sim is not None]
            if not ratios:
                lines.append(f"{policy:<18} {metric:<22} {'n/a':>18}")
                continue
            mean, half = interval([r for _, r in ratios])
            within = sum(abs(r - 1) <= AGREEMENT for _, r in ratios)
            missing = len(mine) - len(ratios)
            per_seed = " ".join(f"{seed}:{r:.2f}" for seed, r in ratios)
            lines.append(f"{policy:<18} {metric:<22} {mean:>9.3f} ± {half:<6.3f} "
                         f"{within:>3}/{len(ratios):<3} {per_seed}"
                         + (f" ({missing} without a ratio)" if missing else ""))
    by_seed = {(r.policy, r.seed): r for r in runs}
    seeds = sorted({r.seed for r in runs if ("lumen", r.seed) in by_seed
                    and ("stop_and_restart", r.seed) in by_seed})
    if seeds:
        lumen = [by_seed["lumen", s] for s in seeds]
        restart = [by_seed["stop_and_restart", s] for s in seeds]
        for side in ("real", "sim"):
            mean, half = paired_ratio([getattr(x, side).ttft_s for x in lumen],
                                      [getattr(x, side).ttft_s for x in restart])
            lines.append(f"lumen / stop_and_restart mean TTFT, {side:<4} ({len(seeds)} seeds "
                         f"paired): {mean:.3f} ± {half:.3f}")
    return "\n".join(lines)


def spread_of(spread: Sequence[Side], real: Side, metric: str
              ) -> tuple[float, float, bool] | None:
    """The phase draws' (lowest, highest) simulated value of `metric` and whether the real
    one lies between them; None without draws or where a draw never recovered."""
    values = [sim for side in spread for name, _, sim, _ in rows(real, side) if name == metric]
    real_value = next(r for name, r, _, _ in rows(real, real) if name == metric)
    if not values or None in values or real_value is None:
        return None
    low, high = min(v for v in values if v is not None), max(v for v in values if v is not None)
    return low, high, low <= real_value <= high


def table(real: Side, sim: Side, spread: Sequence[Side] = ()) -> str:
    lines = [f"{'metric':<22} {'real':>10} {'simulated':>10} {'sim / real':>10}"
             + (f"  {len(spread)} phase draws: lowest-highest" if spread else ""),
             "-" * (55 + (40 if spread else 0))]
    for name, r, s, unit in rows(real, sim):
        def fmt(v: float | None, unit: str = unit) -> str:
            if v is None:
                return "never"
            return f"{v * 1000:.1f} ms" if unit == "s" and v < 1 else (
                f"{v:.2f} s" if unit == "s" else f"{v:.0f}")
        ratio = f"{s / r:.2f}" if r and s is not None else "n/a"
        drawn = spread_of(spread, real, name) if spread else None
        extra = "" if drawn is None else (
            f"  {fmt(drawn[0])} - {fmt(drawn[1])}{'' if drawn[2] else ', real outside'}")
        lines.append(f"{name:<22} {fmt(r):>10} {fmt(s):>10} {ratio:>10}{extra}")
    return "\n".join(lines)


def drawn_mean(spread: Sequence[Side], real: Side, metric: str) -> tuple[float | None, int]:
    """The mean simulated `metric` over the phase draws that have it, and how many do not
    (never recovered within the trace)."""
    values = [sim for side in spread for name, _, sim, _ in rows(real, side) if name == metric]
    have = [v for v in values if v is not None]
    return (statistics.fmean(have) if have else None), len(values) - len(have)


def spread_summary(runs: Sequence[Validation]) -> str:
    """Per policy and metric over the runs with phase draws (`phase_spread`): the mean over
    the draws / real (mean over seeds with its 95% interval, runs within AGREEMENT), the
    simulator's answer where the phases are unknown; and in how many runs the real value
    lay within the draws' range."""
    drawn = [r for r in runs if r.spread]
    if not drawn:
        return ""
    lines = [f"\nthe simulated side over {len(drawn[0].spread)} draws of the heartbeat phases per "
             "run (in range: real within the draws' lowest-highest):",
             f"{'policy':<18} {'metric':<22} {'draws mean / real':>18} {'within':>7} "
             f"{'in range':>9}  per seed", "-" * 90]
    for policy in dict.fromkeys(r.policy for r in drawn):
        mine = [r for r in drawn if r.policy == policy]
        for metric in SUMMARISED:
            ratios, never, inside, counted = [], 0, 0, 0
            for run in mine:
                real = next(x for name, x, _, _ in rows(run.real, run.real) if name == metric)
                mean, missing = drawn_mean(run.spread, run.real, metric)
                never += missing
                if real and mean is not None:
                    ratios.append((run.seed, mean / real))
                found = spread_of(run.spread, run.real, metric)
                if found is not None:
                    counted += 1
                    inside += found[2]
            label = f"{policy:<18} {metric:<22}"
            if not ratios:
                lines.append(f"{label} {'n/a':>18}")
                continue
            mean, half = interval([r for _, r in ratios])
            within = sum(abs(r - 1) <= AGREEMENT for _, r in ratios)
            lines.append(f"{label} {mean:>9.3f} ± {half:<6.3f} {within:>3}/"
                         f"{len(ratios):<3} {inside:>4}/{counted:<4} "
                         + " ".join(f"{seed}:{r:.2f}" for seed, r in ratios)
                         + (f" ({never} draws never recovered)" if never else ""))
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=MODELS, default=MODELS[0],
                        help="the engines' sim model")
    parser.add_argument("--nodes", type=int, default=2,
                        help="lumend nodes, one sim worker each (node-2's engine is killed)")
    parser.add_argument("--duration", type=float, default=150.0, help="trace length, s")
    parser.add_argument("--rate", type=float, default=2.5, help="arrivals per second, all")
    parser.add_argument("--fault-at", type=float, default=45.0, help="s into the trace")
    parser.add_argument("--fault", dest="fault_kind", choices=tuple(FAULT_SIGNALS),
                        default="kill", help="kill: SIGKILL the victim's engine (a crash); "
                        "hang: SIGSTOP it (alive, answering nothing) for its supervisor to "
                        "find and kill")
    parser.add_argument("--warmup", type=float, default=20.0,
                        help="requests sent before this (about one request's lifetime: the "
                        "batches fill up) are left out of the pre-fault level")
    parser.add_argument("--prompt", type=int, nargs=2, default=(600, 1400),
                        metavar=("MIN", "MAX"), help="prompt length range, tokens")
    parser.add_argument("--output", type=int, nargs=2, default=(100, 200),
                        metavar=("MIN", "MAX"), help="output length range, tokens")
    parser.add_argument("--time-scale", type=float, default=8.0, help="sim engine slowdown")
    parser.add_argument("--restore-mbps", type=float, default=500.0,
                        help="checkpoint restore bandwidth over loopback, MB/s (simulator)")
    parser.add_argument("--policy", choices=POLICIES, nargs="+", default=[POLICIES[0]],
                        help="the cluster's mode and the simulator's policy (several: each "
                        "seed runs under each)")
    parser.add_argument("--save", type=Path, default=None,
                        help="write every run's per-request times on both sides and its "
                        "metrics here (JSON)")
    parser.add_argument("--seed", type=int, nargs="+", default=[7],
                        help="the trace's seeds (several: a summary over them follows)")
    parser.add_argument("--workdir", type=Path, default=None,
                        help="keep the cluster's logs here (default: a temporary directory)")
    parser.add_argument("--overhead", choices=("loaded", "idle"), default="loaded",
                        help="the serving overhead the simulator is given: client - engine "
                        "TTFT under load before the fault (runs saved before the engines "
                        "exported their TTFT fall back to idle), or the idle probe's")
    parser.add_argument("--admission-heartbeat", dest="admission_heartbeat_s", type=float,
                        default=LOCAL_HEARTBEAT_S, metavar="S",
                        help="the simulator's admission reads each worker's queue as the "
                        "coordinator does, max(its last heartbeat's, the exact count), "
                        "heartbeats every S (default: the local cluster's, "
                        f"{LOCAL_HEARTBEAT_S:g} s); 0: exact counts")
    parser.add_argument("--resimulate", type=Path, default=None, metavar="SAVED.json",
                        help="no cluster: simulate again the real runs a --save wrote (after "
                        "a change to the simulator) and compare with their real side")
    parser.add_argument("--phase-draws", type=int, default=16, metavar="K",
                        help="also simulate each run under K random phases of the nodes' "
                        "heartbeats and the coordinator's read of them, and say whether the "
                        "real value lies within their range (0: not drawn)")
    args = parser.parse_args()
    # The product's stall (a hung worker admitted to no more from its first missed probe),
    # saved with each run: runs saved before it stalled nothing (resimulated so).
    args.hang_stall_s = SimConfig().hang_stall_s
    if args.phase_draws < 0:
        parser.error("--phase-draws must be 0 (none) or more")
    if args.admission_heartbeat_s < 0:
        parser.error("--admission-heartbeat must be 0 (exact counts) or a positive interval")
    if args.resimulate is not None:
        resimulate(args.resimulate, args.overhead, args.admission_heartbeat_s,
                   args.phase_draws)
        return
    runs: list[Validation] = []
    saved: list[dict[str, object]] = []
    for seed in args.seed:
        for policy in args.policy:
            one = argparse.Namespace(**{**vars(args), "seed": seed, "policy": policy})
            run, record = validate(one)
            runs.append(run)
            saved.append(record)
            if args.save is not None:  # after every run: a later one may fail
                args.save.write_text(json.dumps({"runs": saved}))
    if len(runs) > 1:
        print(f"\nsummary over {len(runs)} runs (seeds {' '.join(map(str, args.seed))}; "
              f"within = |sim / real - 1| <= {AGREEMENT:.0%}):")
        print(summary(runs))
        print(spread_summary(runs))


# What a simulation needs of the command line, saved with each run for --resimulate.
SETTINGS = ("model", "nodes", "time_scale", "restore_mbps", "warmup", "fault_kind",
            "hang_stall_s")


def resimulate(path: Path, which: str = "loaded", heartbeat_s: float = LOCAL_HEARTBEAT_S,
               phase_draws: int = 0) -> list[Validation]:
    """The simulated side of every run in `path` (a --save file, or it gzipped) again, with
    the simulator as it is now, against the real side measured then."""
    try:
        data = path.read_bytes()
        saved = json.loads(gzip.decompress(data) if data[:2] == b"\x1f\x8b" else data)["runs"]
    except (OSError, EOFError, ValueError, KeyError, TypeError) as exc:
        raise SystemExit(f"{path}: not a file --save wrote ({exc}); run the bench with "
                         "--save FILE first") from None
    runs = []
    for record in saved:
        missing = [k for k in ("settings", "given", "sent") if k not in record]
        if missing:
            raise SystemExit(f"{path}: seed {record.get('seed')} has no {', '.join(missing)} "
                             "(saved by an older bench): run it again with --save")
        try:
            # Runs saved before --fault were all kills; before the stall, none stalled.
            args = argparse.Namespace(**{"fault_kind": "kill", "hang_stall_s": None,
                                         **record["settings"]},
                                      policy=record["policy"],
                                      admission_heartbeat_s=heartbeat_s)
            given, fault = record["given"], record["fault"]
            splits = [ServingSplit(**x) for x in record.get("splits", [])]
            served = [Served(**x) for x in record.get("real", [])]
            overhead, source = given_overhead_s(given, splits, served, which)
            sent = [tuple(x) for x in record["sent"]]
            simulated, back_s, cut_off = run_sim(sent, fault, given["victim"],
                                                 given["process_start_s"], overhead, args)
            spread = phase_spread(sent, fault, given["victim"], given["process_start_s"],
                                  overhead, args, phase_draws, record["seed"])
            real = Side(**record["metrics"]["real"])
        except (KeyError, TypeError, ValueError) as exc:
            raise SystemExit(f"{path}: seed {record.get('seed')}: a malformed record "
                             f"({type(exc).__name__}: {exc}); run it again with --save") from None
        sim = measure(simulated, fault, args.warmup, back_s, cut_off)
        print(f"seed {record['seed']}, policy {record['policy']} (real side as saved; "
              f"serving overhead {overhead * 1000:.1f} ms, {source}):")
        print(table(real, sim, spread))
        for split in splits:
            print(split_line(split, served, simulated, overhead))
        print(admissions_compared(served, simulated, fault, args.warmup))
        runs.append(Validation(record["seed"], record["policy"], real, sim, spread))
    if len(runs) > 1:
        print(f"\nsummary over {len(runs)} runs (within = |sim / real - 1| <= "
              f"{AGREEMENT:.0%}):")
        print(summary(runs))
        print(spread_summary(runs))
    return runs


def mean_ttft_between(served: Sequence[Served], since: float, until: float) -> float | None:
    """Mean TTFT of the requests whose first token came out in (since, until]."""
    ttfts = [x.ttft for x in served if since < x.first <= until]
    return statistics.fmean(ttfts) if ttfts else None


def loaded_overhead_s(real: Sequence[Served], split: ServingSplit) -> float | None:
    """The serving path under load: the clients' mean TTFT minus the engines' own over the
    first tokens `split` covers (before the fault)."""
    client = mean_ttft_between(real, split.since, split.until)
    if client is None or not split.counted[1]:
        return None
    return max(0.0, client - split.engine_s)


def split_line(split: ServingSplit, real: Sequence[Served], simulated: Sequence[Served],
               overhead_s: float) -> str:
    """Where the real side's time went, against the simulated side over the same first
    tokens (out between `split.since` and `split.until`): the engines' own TTFT against the
    simulated one less the serving overhead it was given (what the simulator's engines
    took), overall and per worker."""
    nan = float("nan")
    client = mean_ttft_between(real, split.since, split.until) or nan
    sim = (mean_ttft_between(simulated, split.since, split.until) or nan) - overhead_s
    ms = 1000
    return (f"first tokens {split.since:.1f}-{split.until:.1f} s: mean TTFT real "
            f"{client * ms:.1f} ms at the client, {split.gateway_s * ms:.1f} at the gateways, "
            f"{split.engine_s * ms:.1f} at the engines ({split.counted[0]}/{split.counted[1]} "
            f"observed); client - engine {(client - split.engine_s) * ms:.1f} ms; at the "
            f"engines real - simulated {(split.engine_s - sim) * ms:.1f} ms; steps committed "
            f"{split.overrun_s * ms:.1f} ms past their end on average"
            f"{per_worker(split, simulated, overhead_s)}")


def per_worker(split: ServingSplit, simulated: Sequence[Served], overhead_s: float) -> str:
    """Each worker's first tokens and mean TTFT at its engines, real / simulated (the
    simulated worker i is the i-th real one by name, as the coordinator orders them)."""
    parts = []
    for i, (name, (count, mean)) in enumerate(sorted(split.workers.items())):
        mine = [x.ttft - overhead_s for x in simulated
                if x.worker == i and split.since < x.first <= split.until]
        sim = statistics.fmean(mine) if mine else float("nan")
        parts.append(f"{name} {count} / {len(mine)} requests, {mean * 1000:.0f} / "
                     f"{sim * 1000:.0f} ms")
    if not parts:
        return ""
    return "; per worker at the engines, real / simulated: " + ", ".join(parts)


# The admissions after the fault listed one by one (where a burst goes is what differs).
LISTED_AFTER_FAULT = 16
AFTER_FAULT_S = 10.0


def admissions_compared(real: Sequence[Served], simulated: Sequence[Served], fault: float,
                        warmup: float) -> str:
    """Where each request was first admitted, real against simulated (the same request:
    the simulated one arrived when the real one was sent): per window how many went to the
    same worker and each worker's count on both sides, when they first parted, and the
    first admissions after the fault one by one (workers by their place in name order)."""
    by_sent = {round(x.sent, 6): x for x in simulated if x.admitted >= 0}
    pairs = [(r, by_sent[key]) for r in real
             if r.admitted >= 0 and (key := round(r.sent, 6)) in by_sent]
    if not pairs:
        return ("admissions, real / simulated: none recorded on the real side (a run saved "
                "before the gateways logged their admissions)")
    lines = [f"admissions, real / simulated ({len(pairs)} requests; workers by name order):"]
    windows = (("warm-up", 0.0, warmup), ("before the fault", warmup, fault),
               (f"{AFTER_FAULT_S:g} s after it", fault, fault + AFTER_FAULT_S),
               ("the rest", fault + AFTER_FAULT_S, math.inf))
    for name, since, until in windows:
        mine = [(r, x) for r, x in pairs if since <= r.sent < until]
        if not mine:
            continue
        same = sum(r.admitted == x.admitted for r, x in mine)
        workers = sorted({r.admitted for r, _ in mine} | {x.admitted for _, x in mine})
        counts = ", ".join(f"w{i} {sum(r.admitted == i for r, _ in mine)}/"
                           f"{sum(x.admitted == i for _, x in mine)}" for i in workers)
        lines.append(f"  {name}: {same}/{len(mine)} to the same worker; per worker {counts}")
    apart = next((r for r, x in pairs if r.admitted != x.admitted), None)
    lines.append("  first parted: " + ("never" if apart is None else
                                       f"the request sent at {apart.sent:.2f} s"))
    after = [(r, x) for r, x in pairs if r.sent >= fault][:LISTED_AFTER_FAULT]
    if after:
        lines.append("  after the fault (s after it: real/simulated, ! where they differ): "
                     + " ".join(f"{r.sent - fault:+.2f}:{r.admitted}/{x.admitted}"
                                f"{'' if r.admitted == x.admitted else '!'}"
                                for r, x in after))
    return "\n".join(lines)


def given_overhead_s(given: dict[str, Any], splits: Sequence[ServingSplit],
                     real: Sequence[Served], which: str) -> tuple[float, str]:
    """The serving overhead the simulator is given, and what it is: under load (`loaded`:
    client - engine TTFT before the fault) where the run measured it, else the idle probe
    (runs saved before the engines exported their TTFT)."""
    idle = float(given.get("idle_overhead_s", given["overhead_s"]))
    if which == "loaded" and splits:
        loaded = loaded_overhead_s(real, splits[0])
        if loaded is not None:
            return loaded, "under load"
    return idle, "idle probe"


def validate(args: argparse.Namespace) -> tuple[Validation, dict[str, object]]:
    """One seed under one policy (args.seed, args.policy): the real run, then the simulated
    one; prints its table and returns it with what --save writes."""
    prompt, output = tuple(args.prompt), tuple(args.output)
    requests = trace(args.seed, args.duration, args.rate, prompt, output)
    load_before = os.getloadavg()
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="lumen-validate-sim-") as tmp:
        print(f"  real: {len(requests)} requests over {args.duration:g} s, "
              f"{FAULT_SIGNALS[args.fault_kind].name} of {VICTIM}'s engine at "
              f"{args.fault_at:g} s ...", file=sys.stderr, flush=True)
        root = (Path(tmp) if args.workdir is None
                else args.workdir / f"seed{args.seed}-{args.policy}")
        root.mkdir(parents=True, exist_ok=True)
        real_run = run_real(requests, args, root)
    real_wall = time.monotonic() - started
    load_after = os.getloadavg()
    fault, back = real_run.fault, real_run.back_after
    model = sim_model(args.model)
    init_s = model.init_s * args.time_scale
    # Its restart began when the engine was gone (a hung one: at the supervisor's kill).
    process_start = (max(0.0, back - real_run.killed_after - init_s) if back is not None
                     else 0.0)
    probe_tokens = PROBE_TOKENS + len("probe 00 ")
    modelled_lone = lone_ttft_s(args.model, probe_tokens, args.time_scale)
    idle_overhead = max(0.0, real_run.idle_ttft_gateway_s - modelled_lone)
    served = real_served(real_run.outcomes, real_run.admitted)
    overhead, source = given_overhead_s({"overhead_s": idle_overhead}, real_run.splits,
                                        served, args.overhead)
    sent = sent_requests(real_run.outcomes)
    simulated, back_s, cut_off = run_sim(sent, fault, real_run.victim_index, process_start,
                                           overhead, args)
    real = measure(served, fault, args.warmup, back, real_run.decisions)
    sim = measure(simulated, fault, args.warmup, back_s, cut_off)
    spread = phase_spread(sent, fault, real_run.victim_index, process_start, overhead, args,
                          args.phase_draws, args.seed)
    record: dict[str, object] = {
        "seed": args.seed, "policy": args.policy, "fault": fault,
        "settings": {name: getattr(args, name) for name in SETTINGS},
        "given": {"process_start_s": process_start, "overhead_s": overhead,
                  "idle_overhead_s": idle_overhead,
                  "victim": real_run.victim_index,
                  "killed_after_s": real_run.killed_after},
        "sent": sent,
        "splits": [asdict(x) for x in real_run.splits],
        "metrics": {"real": asdict(real), "simulated": asdict(sim)},
        "real": [asdict(x) for x in served],
        "simulated": [asdict(x) for x in simulated]}
    print(f"validation: {args.nodes} nodes x 1 {args.model} sim engine (time scale "
          f"{args.time_scale:g}), "
          f"policy {args.policy}, {len(requests)} requests (seed {args.seed}, Poisson "
          f"{args.rate:g}/s over {args.duration:g} s, prompts {prompt[0]}-{prompt[1]}, outputs "
          f"{output[0]}-{output[1]} tokens; utilisation "
          f"{utilisation(args.model, args.rate, args.nodes, prompt, output, args.time_scale):.0%} "
          f"of the cost "
          f"model's capacity per worker), {FAULT_SIGNALS[args.fault_kind].name} of one "
          f"engine at {fault:.2f} s")
    print(table(real, sim, spread))
    print(f"simulator given: restart = process start {process_start:.2f} s (measured: real "
          f"kill-to-serving minus the model's {init_s:g} s init) + init; serving overhead "
          f"{overhead * 1000:.1f} ms per request (measured {source}; under load: the "
          f"clients' mean TTFT minus the engines' before the fault; the idle probe gave "
          f"{idle_overhead * 1000:.0f} ms: a lone {probe_tokens}-token "
          f"request's TTFT through a gateway, {real_run.idle_ttft_gateway_s * 1000:.0f} ms, "
          f"minus the model's {modelled_lone * 1000:.0f} ms; straight to an engine "
          f"{real_run.idle_ttft_direct_s * 1000:.0f} ms; idle cluster, {PROBES} each); "
          f"restores {args.restore_mbps:g} MB/s beside the engine")
    if args.fault_kind == "hang":
        print(f"hung engine killed by its supervisor {real_run.killed_after:.2f} s after the "
              f"SIGSTOP (the simulator: {SimConfig().hang_detect_s:g} s, "
              f"SupervisorTiming.hung_kill_after_s)")
    for split in real_run.splits:
        print(split_line(split, served, simulated, overhead))
    print(admissions_compared(served, simulated, fault, args.warmup))
    late = real_run.late_step_s / real_run.modelled_step_s if real_run.modelled_step_s else 0
    print(f"sim engines' pacing: behind their cost model by {late:.1%} of "
          f"{real_run.modelled_step_s:.0f} modelled step-seconds")
    errors = sum(1 for o in real_run.outcomes if o.error)
    print(f"real run: {real_wall:.0f} s wall, {errors} errors, load average "
          f"{load_before[0]:.1f} before / {load_after[0]:.1f} after (1 min), "
          f"{os.cpu_count()} cores")
    return Validation(args.seed, args.policy, real, sim, spread), record


if __name__ == "__main__":
    main()

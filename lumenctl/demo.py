"""`lumenctl demo`: a local cluster, a fault, and the recovery, narrated."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from rich import box
from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.table import Table

from lumenctl.localcluster import LocalCluster
from lumenctl.recovery import (
    PAPER,
    Decision,
    DecisionLog,
    Replay,
    Result,
    lumenctl,
    ratio,
    read_view,
    restored_by_engine,
    restored_since,
    summarise,
    trace,
    wait_whole,
)
from lumenctl.render import events_table, status_tables
from lumenctl.report import events_document, status_document
from lumend.cluster.models import AssistAssignment, WorkerRecord
from lumend.cluster.view import ClusterView

__all__ = ["DemoOptions", "read_view", "run_demo", "wait_for"]

POLICIES = ("stop_and_restart", "fixed_checkpoint", "lumen")  # as lumenctl.main.POLICIES
MIB = 1 << 20


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


def _coordinator_faults(console: Console, cluster: LocalCluster, view: ClusterView) -> None:
    eps, name, ttl = cluster.endpoints, cluster.cluster, cluster.lease_ttl_s
    assert view.coordinator is not None
    victim, epoch = view.coordinator.record.node, view.coordinator.epoch
    console.rule(f"fault: SIGKILL the coordinator {victim}")
    cluster.node(victim).kill()
    killed_at = time.monotonic()
    view = wait_for(eps, name, "a new coordinator",
                    lambda v: v.coordinator is not None and v.coordinator.epoch > epoch,
                    ttl * 3 + 10)
    took = time.monotonic() - killed_at
    assert view.coordinator is not None
    console.print(
        f"[green]recovered:[/] {view.coordinator.record.node} took over with epoch "
        f"{view.coordinator.epoch} (was {epoch}) {took:.2f} s after the kill "
        f"(lease TTL {ttl} s)")
    view = wait_for(eps, name, f"{victim} to leave", lambda v: victim not in v.nodes, 30)

    assert view.coordinator is not None
    leader, epoch = view.coordinator.record.node, view.coordinator.epoch
    console.rule(f"planned stop: SIGTERM the coordinator {leader}")
    stopped_at = time.monotonic()
    cluster.node(leader).stop()
    view = wait_for(eps, name, "a handover",
                    lambda v: v.coordinator is not None and v.coordinator.epoch > epoch, 30)
    took = time.monotonic() - stopped_at
    assert view.coordinator is not None
    console.print(
        f"[green]handed over:[/] {view.coordinator.record.node} is coordinator "
        f"(epoch {view.coordinator.epoch}) {took:.2f} s after SIGTERM: it resigned, "
        "nobody waited for the lease")

    console.rule(f"restart {victim} and {leader}: they rejoin as followers")
    cluster.node(victim).start()
    cluster.node(leader).start()
    view = wait_for(eps, name, "all nodes back", lambda v: len(v.nodes) == cluster.size, 60)
    _wide(console).print(events_table(events_document(name, view.events)))


# -- the same fault under each policy -----------------------------------------------------


@dataclass(frozen=True)
class DemoOptions:
    nodes: int = 4
    lease_ttl_s: int = 3
    keep: bool = False
    short: bool = False  # only the policy comparison
    policies: tuple[str, ...] = POLICIES
    trace_s: float = 28.0
    fault_at_s: float = 12.0
    warmup_s: float = 5.0  # requests before this are left out of the pre-fault TTFT level
    rate: float = 3.0
    time_scale: float = 8.0
    seed: int = 7
    sim_seeds: int = 10  # the simulated comparison's seeds (0: skip it)

    @property
    def victim(self) -> str:
        """The worker killed in the comparison: the last node's, which has no shadow."""
        return f"node-{self.nodes}-w0"


class LiveView:
    """What the cluster does while a trace runs: traffic and latency, where checkpoints are
    held, each recovery decision. A rich table when the console is a terminal, else a plain
    line every `every_s` and one line per decision."""

    def __init__(self, console: Console, cluster: LocalCluster, mode: str, victim: str,
                 decisions: DecisionLog, every_s: float = 2.0) -> None:
        self.console, self.cluster, self.mode, self.victim = console, cluster, mode, victim
        self.decisions = decisions
        self.every_s = every_s
        self.seen: list[Decision] = []
        self.assists: dict[str, AssistAssignment] = {}  # by id, with their last counters
        self.ended: set[str] = set()
        self.live: Live | None = None

    async def watch(self, run: Replay) -> None:
        fault_told = False
        last_line = -self.every_s
        while True:
            view = await asyncio.to_thread(read_view, self.cluster.endpoints,
                                           self.cluster.cluster)
            new = self.decisions.new()
            self.seen += new
            now = run.now()
            started = [a for a in view.assists.values() if a.id not in self.assists]
            current = {a.id for a in view.assists.values()}
            ended = [a for i, a in self.assists.items() if i not in current
                     and i not in self.ended]
            self.ended |= {a.id for a in ended}
            self.assists.update({a.id: a for a in view.assists.values()})
            if self.live is not None:
                self.live.update(self.render(run, view, now), refresh=True)
            else:
                if run.fault is not None and not fault_told:
                    fault_told = True
                    self.console.print(
                        f"  t={run.fault:5.1f}s  fault: SIGKILL {self.victim}'s active engine "
                        "(no shadow: it restarts, mapping its weights from GMS)")
                for d in new:
                    self.console.print(f"  t={now:5.1f}s  decision ({d.node}'s gateway): "
                                       f"{d.reason}")
                for a in started:
                    self.console.print(f"  t={now:5.1f}s  assist: {a.recovering} loads its "
                                       f"model and drafts for {a.survivor} meanwhile (the "
                                       "survivor with the highest predicted gain)")
                for a in ended:
                    self.console.print(f"  t={now:5.1f}s  assist ended: {a.recovering} "
                                       f"serves again; {assist_text(a)}")
                if now - last_line >= self.every_s:
                    last_line = now
                    self.console.print(f"  t={now:5.1f}s  {self.traffic_line(run, now)}")
                    self.console.print(f"           held: {self.holders_line(view)}")
            await asyncio.sleep(0.5)

    @staticmethod
    def traffic(run: Replay, now: float) -> dict[str, float]:
        sent = [o for o in run.outcomes if o.sent_at and o.sent_at <= now]
        done = [o for o in sent if len(o.token_times) >= o.request.max_tokens or o.error]
        recent = [o.ttft for o in sent if o.token_times and now - 3.0 <= o.token_times[0]]
        gaps = []
        for o in sent:
            times = [t for t in o.token_times if t >= now - 3.0]
            if len(times) > 1:
                gaps.append((times[-1] - times[0]) / (len(times) - 1))
        return {"sent": len(sent), "done": len(done), "streaming": len(sent) - len(done),
                "errors": sum(bool(o.error) for o in sent),
                "ttft_ms": 1000 * statistics.fmean(recent) if recent else -1.0,
                "tpot_ms": 1000 * statistics.fmean(gaps) if gaps else -1.0}

    def traffic_line(self, run: Replay, now: float) -> str:
        t = self.traffic(run, now)
        return (f"sent {t['sent']:.0f}, done {t['done']:.0f}, streaming {t['streaming']:.0f}, "
                f"errors {t['errors']:.0f}; last 3 s: {_latency(t)}")

    @staticmethod
    def holders_line(view: ClusterView) -> str:
        return ", ".join(
            f"{w.name} {w.checkpoints.bytes_held / MIB:.1f} MiB ({w.checkpoints.requests} req)"
            + ("" if w.state == "serving" else f" [{w.state}]")
            for w in sorted(view.workers.values(), key=lambda w: w.name))

    def render(self, run: Replay, view: ClusterView, now: float) -> RenderableType:
        t = self.traffic(run, now)
        fault = (f"fault at {run.fault:.1f} s: {self.victim} SIGKILLed" if run.fault is not None
                 else f"fault at {run.fault_at:.0f} s: SIGKILL of {self.victim}")
        head = (f"[bold]mode {self.mode}[/]  t={now:5.1f} s  {fault}\n"
                f"sent {t['sent']:.0f}  done {t['done']:.0f}  streaming {t['streaming']:.0f}  "
                f"errors {t['errors']:.0f}   last 3 s: {_latency(t)}")
        for a in view.assists.values():
            head += (f"\nassist: {a.recovering} reloads and drafts for {a.survivor}; "
                     f"{assist_text(a)}")
        workers = Table(title="workers and the checkpoints they hold", title_justify="left")
        for column in ("worker", "state", "running", "held MiB", "requests", "budget MiB"):
            workers.add_column(column, justify="left" if column in ("worker", "state")
                               else "right")
        for w in sorted(view.workers.values(), key=lambda w: w.name):
            held = w.checkpoints
            workers.add_row(w.name, w.state, str(w.load.running),
                            f"{held.bytes_held / MIB:.1f}", str(held.requests),
                            f"{held.budget_bytes / MIB:.0f}")
        decisions = Table(title=f"recovery decisions ({len(self.seen)})", title_justify="left",
                          show_header=False)
        decisions.add_column("decision")
        for d in self.seen[-8:]:
            decisions.add_row(f"{d.node}: {d.reason}")
        return Group(head, workers, decisions)


def assist_text(a: AssistAssignment) -> str:
    if not a.drafted_tokens:
        return "no drafts verified yet"
    return (f"acceptance {a.accepted_tokens / a.drafted_tokens:.0%} ({a.accepted_tokens} of "
            f"{a.drafted_tokens} drafted tokens)")


def _latency(t: dict[str, float]) -> str:
    ttft = f"{t['ttft_ms']:.0f} ms" if t["ttft_ms"] >= 0 else "-"
    tpot = f"{t['tpot_ms']:.1f} ms" if t["tpot_ms"] >= 0 else "-"
    return f"TTFT {ttft}, TPOT {tpot}"


def _policy_run(console: Console, cluster: LocalCluster, mode: str, options: DemoOptions,
                shadows: dict[str, int]) -> Result:
    requests = trace(options.seed, options.trace_s, options.rate, (600, 1400), (80, 160))
    console.rule(f"policy {mode}: the same trace, the same fault")
    wait_whole(cluster, shadows)
    console.print(f"$ lumenctl config set mode {mode} --yes")
    for line in lumenctl(cluster, "config", "set", "mode", mode, "--yes").strip().splitlines():
        console.print(f"  {line}")
    time.sleep(1.0)  # the coordinator reads the setting on its next decision
    restored_before = restored_by_engine(cluster)
    console.print(f"{len(requests)} streamed completions over {options.trace_s:g} s through "
                  f"the {len(cluster.nodes)} gateways; SIGKILL of {options.victim}'s engine "
                  f"at {options.fault_at_s:g} s")
    decisions = DecisionLog(cluster)
    live = LiveView(console, cluster, mode, options.victim, decisions)
    run = Replay(cluster, requests, options.fault_at_s, options.victim)
    if console.is_terminal:
        with Live(console=console, auto_refresh=False) as screen:
            live.live = screen
            asyncio.run(run.run(live.watch))
    else:
        asyncio.run(run.run(live.watch))
    time.sleep(0.5)
    live.seen += decisions.new()
    assert run.fault is not None
    result = summarise(mode, run.outcomes, run.fault, options.warmup_s,
                       restored_since(cluster, restored_before))
    result.decisions = Counter(f"{d.kind} on {d.worker}" for d in live.seen)
    where = ", ".join(f"{what} x{n}" for what, n in sorted(result.decisions.items()))
    assists = "; ".join(f"{a.recovering} drafted for {a.survivor} while it reloaded, "
                        f"{assist_text(a)}" for a in live.assists.values())
    console.print(
        f"[green]{mode}:[/] {len(live.seen)} streams broke with the engine and were routed: "
        f"{where or 'none'}; {result.restored_tokens:.0f} tokens restored from "
        f"checkpoints; {assists or 'no draft-assist'}; {result.errors} requests failed, "
        f"{result.mismatches} differ from the failure-free stream")
    return result


def comparison_table(results: list[Result], options: DemoOptions) -> Table:
    base = next((r for r in results if r.config == "stop_and_restart"), None)

    def cell(r: Result, value: float | None, base_value: float | None, fmt: str) -> str:
        if value is None:
            return "never"
        shown = format(value, fmt)
        if base is None or r is base:
            return shown
        return f"{shown} ({ratio(value, base_value)})"

    table = Table(title=f"one trace, one fault (SIGKILL of {options.victim}'s engine); in "
                  "brackets: vs stop_and_restart", box=box.SIMPLE_HEAD)
    for column in ("policy", "TTFT ms", "TPOT ms", "recovery s", "stall s", "stalled",
                   "resumed / recomputed", "restored tokens", "failed / differ"):
        table.add_column(column, justify="left" if column == "policy" else "right",
                         no_wrap=column == "policy")
    for r in results:
        kinds = Counter(what.split(" ")[0] for what in r.decisions.elements())
        table.add_row(
            r.config,
            cell(r, r.ttft_ms, base.ttft_ms if base else None, ".0f"),
            cell(r, r.tpot_ms, base.tpot_ms if base else None, ".1f"),
            cell(r, r.recovery_s, base.recovery_s if base else None, ".1f"),
            f"{r.stall_s:.2f}", str(r.interrupted), f"{kinds['resume']} / {kinds['recompute']}",
            f"{r.restored_tokens:.0f}", f"{r.errors} / {r.mismatches}")
    table.add_row("paper: LUMEN", f"({PAPER['ttft']:+.0%})", f"({PAPER['tpot']:+.0%})",
                  f"({PAPER['recovery']:+.0%})", "", "", "", "", "")
    return table


def _wide(console: Console, width: int = 140) -> Console:
    """Where output is not a terminal (a pipe, a log) tables get room to be read whole."""
    if console.is_terminal or console.width >= width:
        return console
    return Console(file=console.file, width=width, no_color=True, highlight=False)


def _compare(console: Console, cluster: LocalCluster, options: DemoOptions,
             shadows: dict[str, int]) -> list[Result]:
    # The demo's sim engines model a large model's compute (time-scaled) but move real
    # checkpoint bytes over loopback through Python (tens of MB/s): measured, the two
    # would weigh the stand-in's plumbing against the model it stands in for, and every
    # recovery would recompute. The comparison uses the cost model's own figures.
    console.print("$ lumenctl config set costs constant --yes  (the sim's modelled compute "
                  "against its loopback restores would compare unlike things)")
    for line in lumenctl(cluster, "config", "set", "costs", "constant",
                         "--yes").strip().splitlines():
        console.print(f"  {line}")
    # Its survivors take new prompts throughout: the default objective (ttft) declines to
    # slow their prefill with verified drafts, so draft-assist would not run at all.
    console.print("$ lumenctl config set assist_objective throughput --yes  (the survivors "
                  "take new prompts throughout: the default, ttft, would not slow them with "
                  "drafts, and the demo shows draft-assist)")
    for line in lumenctl(cluster, "config", "set", "assist_objective", "throughput",
                         "--yes").strip().splitlines():
        console.print(f"  {line}")
    results = [_policy_run(console, cluster, mode, options, shadows)
               for mode in options.policies]
    console.rule("the policies side by side")
    _wide(console).print(comparison_table(results, options))
    console.print(
        "recovery: from the fault until the mean TTFT of new requests is back within 10% of "
        "its level before; stalled: streams in flight at the fault with a gap over 5x their "
        "usual one; stall s: their longest gap (mean); "
        "resumed/recomputed: the coordinator's recovery routing (Algorithm 2); restored: "
        "tokens loaded from checkpoints instead of recomputed; differ: streams that are not "
        "token for token the failure-free stream. One run per policy on this machine: "
        "bench/recovery.py replays longer traces for steadier numbers.")
    return results


def _simulated(console: Console, options: DemoOptions) -> None:
    if options.sim_seeds < 1:
        return
    console.rule("where coordination matters: the simulator, over seeds")
    console.print(f"simulating the scenario below on {options.sim_seeds} seeds (seconds): "
                  "the local cluster's sim engines are too small for the long "
                  "prompts and slow reload where the policies differ, and one run each is "
                  "noise")
    from lumenctl.demo_sim import simulated_comparison, simulated_table, simulated_verdicts

    cells = simulated_comparison(options.sim_seeds)
    _wide(console, 170).print(simulated_table(cells, options.sim_seeds))
    for line in simulated_verdicts(cells):
        console.print(line)
    console.print("recovery: fault until TTFT and TPOT are back within 20% of their pre-fault "
                  "level (docs/simulator.md, Metrics); S&R: stop_and_restart; fixed: "
                  "fixed_checkpoint; shadows: shadow_only, a shadow engine per worker and no "
                  "checkpoints; lumen: LUMEN's coordinated checkpoints without shadows; "
                  "lumen_shadow: LUMEN as deployed, both. The paper's ratios are its LUMEN's. "
                  "`lumenctl sim --sweep` maps where each policy wins.")


def run_demo(console: Console, options: DemoOptions) -> list[Result]:
    nodes = options.nodes
    shadowed = "node-1"  # the engine-kill and planned-failover steps use its shadow
    shadows = {f"{shadowed}-w0": 1}
    with tempfile.TemporaryDirectory(prefix="lumen-demo-") as tmp:
        # The comparison's victim has no shadow: it reloads, and drafts for a survivor
        # meanwhile (draft-assist, Algorithm 3, under mode lumen).
        cluster = LocalCluster(Path(tmp), size=nodes, lease_ttl_s=options.lease_ttl_s,
                               shadows=0, node_shadows={shadowed: 1},
                               node_draft_models={f"node-{nodes}": "sim-draft"},
                               engine_args=("--time-scale", f"{options.time_scale:g}"))
        console.rule("LUMEN demo")
        console.print(f"starting etcd and {nodes} lumend nodes on loopback, one sim worker "
                      f"each ({shadowed}-w0 with a shadow engine, the others without; lease "
                      f"TTL {options.lease_ttl_s} s; logs in {tmp})")
        results: list[Result] = []
        try:
            cluster.start()
            eps, name = cluster.endpoints, cluster.cluster
            view = wait_for(
                eps, name, f"{nodes} nodes, a coordinator and every worker whole",
                lambda v: len(v.nodes) == nodes and v.coordinator is not None
                and len(v.workers) == nodes and all(_whole(w) for w in v.workers.values()),
                120,
            )
            _wide(console).print(status_tables(status_document(view)))
            if not options.short:
                _engine_fault(console, cluster, view.workers[f"{shadowed}-w0"])
                _planned_failover(console, cluster, f"{shadowed}-w0")
                _coordinator_faults(console, cluster, read_view(eps, name))
            results = _compare(console, cluster, options, shadows)
            if options.keep:
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
    if results:
        _simulated(console, options)
    return results

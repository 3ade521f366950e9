"""What LUMEN's checkpoints cost before any failure, on the real local cluster.

The validation (`bench/validate_sim.py`) found the real cluster's failure-free TTFT under
LUMEN 6% above stop-and-restart's over eight seeds (1.02-1.12), where the simulator gives
1.000. This bench measures that cost where it arises: one cluster, the same failure-free
trace under each mode in turn (`lumenctl config set mode`), alternating the order every
round so that drift falls on both; per block, the mean TTFT and TPOT, the checkpoint blocks
the engines streamed, the time the sim engines fell behind their cost model, and the CPU
seconds of every process of the cluster by thread kind (read from /proc: a process's main
thread, its other Python threads, ZeroMQ's I/O threads, where CurveZMQ encrypts and
decrypts).

    python bench/ckpt_overhead.py [--rounds 3] [--duration 40] [--rate 2.5]
        [--modes lumen stop_and_restart] [--seed 7]

Asserts nothing; prints a table per mode and the ratios to the first mode, paired by
round. Needs the etcd binary. About 1 minute to start plus rounds x modes x (duration +
~10 s).
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
from lumenctl.recovery import Outcome, Replay, lumenctl, read_view, trace, wait_whole
from lumend.sim.stats import interval, paired_ratio

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
ENGINE_COUNTERS = ("lumen_sim_ckpt_blocks_saved_total", "lumen_sim_step_late_seconds_total",
                   "lumen_sim_step_seconds_total")


def thread_kind(pid: int, tid: int, comm: str) -> str:
    if comm.startswith("ZMQbg"):
        return "zmq-io"
    return "main" if tid == pid else "threads"


def minus(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {k: after[k] - before.get(k, 0.0) for k in after}


def cpu_by_thread(pid: int) -> dict[str, float]:
    """CPU seconds of `pid`'s live threads so far, by kind (threads that ended are lost:
    the cluster's threads are long-lived pools)."""
    seconds: dict[str, float] = defaultdict(float)
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except FileNotFoundError:
        return seconds
    for tid in tids:
        try:
            stat = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
        except (FileNotFoundError, ProcessLookupError):
            continue
        comm = stat[stat.index("(") + 1:stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2:].split()
        utime, stime = int(fields[11]), int(fields[12])  # stat fields 14 and 15
        seconds[thread_kind(pid, int(tid), comm)] += (utime + stime) / CLOCK_TICKS
    return seconds


def cluster_processes(cluster: LocalCluster) -> dict[str, int]:
    """Role -> pid: every lumend, every active engine, etcd."""
    procs = {f"lumend {n.name}": n.pid for n in cluster.nodes}
    view = read_view(cluster.endpoints, cluster.cluster)
    for name, worker in sorted(view.workers.items()):
        for engine in worker.engines:
            if engine.state == "active" and engine.pid is not None:
                procs[f"engine {name}"] = engine.pid
    for i, member in enumerate(cluster.etcd.members):
        if member.proc is not None:
            procs[f"etcd {i}"] = member.proc.pid
    return procs


def cpu_snapshot(procs: dict[str, int]) -> dict[str, float]:
    """CPU seconds so far, by "role kind" (roles without their node: lumend, engine)."""
    total: dict[str, float] = defaultdict(float)
    for role, pid in procs.items():
        group = role.split()[0]
        for kind, s in cpu_by_thread(pid).items():
            total[f"{group} {kind}"] += s
    return total


def engine_counters(cluster: LocalCluster) -> dict[str, float]:
    total: dict[str, float] = defaultdict(float)
    view = read_view(cluster.endpoints, cluster.cluster)
    for worker in view.workers.values():
        for engine in worker.engines:
            if engine.state != "active":
                continue
            with urllib.request.urlopen(engine.url + "/metrics", timeout=5) as r:
                for line in r.read().decode().splitlines():
                    name, _, value = line.partition(" ")
                    if name in ENGINE_COUNTERS:
                        total[name] += float(value)
    return total


@dataclass
class Block:
    mode: str
    round: int
    ttft_s: float
    tpot_s: float
    errors: int
    wall_s: float
    blocks_saved: float
    late_s: float
    cpu_s: dict[str, float] = field(default_factory=dict)


def served(outcomes: Sequence[Outcome], warmup_s: float) -> list[Outcome]:
    return [o for o in outcomes if not o.error and o.token_times and o.sent_at >= warmup_s]


def run_block(cluster: LocalCluster, mode: str, round_: int, args: argparse.Namespace
              ) -> Block:
    lumenctl(cluster, "config", "set", "mode", mode, "--yes")
    time.sleep(args.settle)
    procs = cluster_processes(cluster)
    cpu_before, counters_before = cpu_snapshot(procs), engine_counters(cluster)
    started = time.monotonic()
    requests = trace(args.seed + round_, args.duration, args.rate, tuple(args.prompt),
                     tuple(args.output))
    run = Replay(cluster, requests, None, "")
    asyncio.run(run.run())
    wall = time.monotonic() - started
    cpu = minus(cpu_snapshot(procs), cpu_before)
    counters = minus(engine_counters(cluster), counters_before)
    ok = served(run.outcomes, args.warmup)
    tpots = [t for o in ok if (t := o.tpot) is not None]
    return Block(mode, round_, statistics.fmean(o.ttft for o in ok), statistics.fmean(tpots),
                 sum(1 for o in run.outcomes if o.error), wall,
                 counters.get("lumen_sim_ckpt_blocks_saved_total", 0.0),
                 counters.get("lumen_sim_step_late_seconds_total", 0.0), cpu)


def pm(value: tuple[float, float], digits: int) -> str:
    return f"{value[0]:.{digits}f} ± {value[1]:.{digits}f}"


def report(blocks: Sequence[Block], modes: Sequence[str]) -> str:
    kinds = sorted({k for b in blocks for k in b.cpu_s})
    lines = [f"{'mode':<18} {'round':>5} {'TTFT s':>7} {'TPOT ms':>8} {'late s':>7} "
             f"{'blocks':>7} {'err':>4} " + " ".join(f"{k:>15}" for k in kinds)]
    for b in blocks:
        lines.append(f"{b.mode:<18} {b.round:>5} {b.ttft_s:>7.3f} {b.tpot_s * 1e3:>8.1f} "
                     f"{b.late_s:>7.2f} {b.blocks_saved:>7.0f} {b.errors:>4} "
                     + " ".join(f"{b.cpu_s.get(k, 0.0):>15.1f}" for k in kinds))
    base = modes[0]
    for mode in modes[1:]:
        pairs = [(a, b) for a in blocks for b in blocks
                 if a.mode == base and b.mode == mode and a.round == b.round]
        if not pairs:
            continue
        ttft = paired_ratio([a.ttft_s for a, _ in pairs], [b.ttft_s for _, b in pairs])
        tpot = paired_ratio([a.tpot_s for a, _ in pairs], [b.tpot_s for _, b in pairs])
        lines.append(f"{base} / {mode}, paired by round: TTFT {pm(ttft, 3)}, "
                     f"TPOT {pm(tpot, 3)}")
        for kind in kinds:
            extra = [a.cpu_s.get(kind, 0.0) - b.cpu_s.get(kind, 0.0) for a, b in pairs]
            lines.append(f"  CPU s per block, {base} minus {mode}, {kind:<15}: "
                         f"{pm(interval(extra), 1)}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--modes", nargs="+", default=["lumen", "stop_and_restart"])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--duration", type=float, default=40.0, help="trace per block, s")
    parser.add_argument("--warmup", type=float, default=5.0,
                        help="requests sent before this (s into a block) are not measured")
    parser.add_argument("--settle", type=float, default=3.0,
                        help="s after a mode change before the block starts")
    parser.add_argument("--rate", type=float, default=2.5, help="arrivals per second, all")
    parser.add_argument("--prompt", type=int, nargs=2, default=(600, 1400))
    parser.add_argument("--output", type=int, nargs=2, default=(100, 200))
    parser.add_argument("--time-scale", type=float, default=8.0)
    parser.add_argument("--model", default="sim-medium")
    parser.add_argument("--seed", type=int, default=7, help="round r's trace uses seed + r")
    parser.add_argument("--workdir", type=Path, default=None)
    args = parser.parse_args()
    if args.rounds < 1 or len(args.modes) < 1:
        parser.error("--rounds and --modes need at least one")
    root = args.workdir or Path(tempfile.mkdtemp(prefix="lumen-ckpt-overhead-"))
    cluster = LocalCluster(root, size=2, shadows=0, lease_ttl_s=3, model=args.model,
                           engine_args=("--time-scale", f"{args.time_scale:g}"))
    blocks: list[Block] = []
    try:
        cluster.start()
        wait_whole(cluster, 0)
        for round_ in range(args.rounds):
            order = args.modes if round_ % 2 == 0 else list(reversed(args.modes))
            for mode in order:
                block = run_block(cluster, mode, round_, args)
                blocks.append(block)
                print(f"round {round_} {mode}: TTFT {block.ttft_s:.3f} s, blocks "
                      f"{block.blocks_saved:.0f}, load {os.getloadavg()[0]:.2f}",
                      file=sys.stderr, flush=True)
    finally:
        cluster.stop()
    print(report(blocks, args.modes))
    print(f"load average at the end: {os.getloadavg()[0]:.2f} (2 shared cores: the cluster "
          f"competes with whatever else runs)")


if __name__ == "__main__":
    main()

"""Simulator throughput: wall time and events/s per policy at 64 workers.

Prints a table; asserts nothing. Two workloads:
* `trace-1h`: one hour of the conversation trace as published (~5.5 req/s), 64 workers.
* `scaled`: the trace time-scaled to the paper-scale per-worker load (Llama-3-70B).
Each policy runs twice (faulted and failure-free reference), as `lumenctl sim` does;
events/s counts the events of both runs over their CPU time. `--profile` prints cProfile's
top functions (the table's times then include the profiler's overhead).

    .venv/bin/python bench/sim_perf.py [--scaled-seconds 600] [--profile]
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time

from lumend.sim.config import MAIN_POLICIES, SCENARIOS, FaultKind, FaultSpec, SimConfig
from lumend.sim.runner import run_policy
from lumend.sim.workload import Workload, synthetic


def bench(label: str, workload: Workload, cfg: SimConfig) -> None:
    total = 0.0
    for name in MAIN_POLICIES:
        started = time.process_time()
        run = run_policy(workload, cfg, name)
        cpu = time.process_time() - started
        total += cpu
        events = run.metrics.events + run.metrics.reference_events
        print(f"{label:10} {name:18} {len(workload):>9} {events:>10} {cpu:>8.2f} "
              f"{events / cpu:>12,.0f} {run.metrics.mean_ttft_s:>8.2f}")
    print(f"{label:10} {'all three':18} {'':>9} {'':>10} {total:>8.2f}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--scaled-seconds", type=float, default=600.0)
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args()
    sc = SCENARIOS["paper-scale"]
    cfg = SimConfig(workers=64, model=sc.model, gpu=sc.gpu,
                    fault=FaultSpec(kind=FaultKind.fraction, at_s=300.0, fraction=0.25))
    print(f"{'workload':10} {'policy':18} {'requests':>9} {'events':>10} {'cpu_s':>8} "
          f"{'events/s':>12} {'ttft_s':>8}")
    hour = synthetic(rate=5.5, duration_s=3600.0, seed=0)
    scaled = synthetic(rate=sc.rate_per_worker * 64, duration_s=args.scaled_seconds, seed=0)
    if args.profile:
        profile = cProfile.Profile()
        profile.enable()
    bench("trace-1h", hour, cfg)
    bench(f"scaled-{args.scaled_seconds:g}s", scaled, cfg)
    if args.profile:
        profile.disable()
        pstats.Stats(profile).sort_stats("tottime").print_stats(15)


if __name__ == "__main__":
    main()

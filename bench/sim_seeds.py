"""Policies side by side over several seeds, with paired 95% intervals (issue 15).

    .venv/bin/python bench/sim_seeds.py --scenario paper-4w --seeds 5
    .venv/bin/python bench/sim_seeds.py --scenario paper-8w --seeds 5 --rate 10
    .venv/bin/python bench/sim_seeds.py --scenario paper-4w --policies lumen,lumen_paper

For every seed each policy's faulted run is compared with its failure-free reference; the
table prints the mean over seeds of mean TTFT, TPOT, recovery time and failure-free TTFT,
each with a 95% interval (Student t over seeds), and LUMEN's ratio against each baseline
paired by seed (the mean of per-seed ratios with its interval). Prints numbers; asserts
nothing.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lumend.sim.config import SCENARIOS, FaultSpec, SimConfig
from lumend.sim.runner import run_policies
from lumend.sim.stats import interval
from lumend.sim.workload import synthetic

KEYS = ("mean_ttft_s", "mean_tpot_s", "recovery_time_s", "baseline_mean_ttft_s",
        "uninterrupted_mean_ttft_s")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--scenario", default="paper-4w", choices=sorted(SCENARIOS))
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--rate", type=float, default=None, help="req/s per worker")
    ap.add_argument("--duration", type=float, default=None)
    ap.add_argument("--workers", type=int, default=None)
    ap.add_argument("--policies", default="stop_and_restart,fixed_checkpoint,lumen")
    ap.add_argument("--restore-gbps", type=float, default=None)
    ap.add_argument("--restore-in-step", action="store_true",
                    help="pages load inside the step that schedules the resumed request, "
                         "stalling the holder's batch (LUMEN's vLLM connector before "
                         "2026-12-07); default: beside the engine")
    args = ap.parse_args()
    sc = SCENARIOS[args.scenario]
    names = [n.strip() for n in args.policies.split(",") if n.strip()]
    rate = args.rate if args.rate is not None else sc.rate_per_worker
    workers = args.workers or sc.workers
    duration = args.duration or sc.duration_s
    per_seed: dict[str, list[dict[str, float | None]]] = {n: [] for n in names}
    started = time.perf_counter()
    for seed in range(args.seeds):
        cfg = SimConfig(workers=workers, model=sc.model, gpu=sc.gpu, seed=seed,
                        fault=FaultSpec(kind=sc.fault, at_s=sc.fault_at_s,
                                        fraction=sc.fail_fraction))
        if args.restore_gbps is not None:
            cfg = replace(cfg, restore_bytes_per_s=args.restore_gbps * 1e9)
        if args.restore_in_step:
            cfg = replace(cfg, restore_async=False)
        workload = synthetic(rate * workers, duration, seed)
        for run in run_policies(workload, cfg, names):
            m = run.metrics
            per_seed[m.policy].append({k: getattr(m, k) for k in KEYS})
    print(f"{args.scenario}: {workers} x {sc.model}, {rate:g} req/s per worker, "
          f"{args.seeds} seeds, {time.perf_counter() - started:.0f} s")
    print(f"{'policy':22} {'TTFT s':>16} {'TPOT ms':>16} {'recovery s':>16} "
          f"{'fault-free TTFT':>16} {'untouched TTFT':>16}")
    for n in names:
        cells = []
        for k in KEYS:
            vals = [row[k] for row in per_seed[n]]
            scale = 1000.0 if k == "mean_tpot_s" else 1.0
            cells.append(_fmt([None if v is None else v * scale for v in vals]))
        print(f"{n:22} " + " ".join(f"{c:>16}" for c in cells))
    if "lumen" in names:
        for other in names:
            if other == "lumen":
                continue
            parts = []
            for k in KEYS:
                ratios = [x / y for a, b in zip(per_seed["lumen"], per_seed[other],
                                                 strict=True)
                          if (x := a[k]) is not None and (y := b[k])]
                parts.append(f"{k.removesuffix('_s')} {_fmt(ratios, 'x')}")
            print(f"lumen / {other}: " + ", ".join(parts))


def _fmt(values: Sequence[float | None], unit: str = "") -> str:
    vals = [v for v in values if v is not None]
    if not vals:
        return "-"
    m, half = interval(vals)
    never = len(values) - len(vals)
    return f"{m:.3g}±{half:.2g}{unit}" + (f" ({never} never)" if never else "")


if __name__ == "__main__":
    main()

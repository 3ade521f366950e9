"""Where LUMEN loses to stop-and-restart in the sweep's 1 GB/s cells (issue 15).

    nice -n 10 .venv/bin/python bench/sweep_losses.py --seeds 0-5
    nice -n 10 .venv/bin/python bench/sweep_losses.py --cells 0.7,1,nvme,1,4 --variants
    .venv/bin/python bench/sweep_losses.py --model llama-3-70b --seeds 0-9 --fixed \
        --cells 0.7,8,nvme,4,4 0.7,4,nvme,4,4 0.7,2,nvme,4,4 --mean-queue

The last is the demo's simulated scenario (4 x Llama-3-70B, prompts x4) at the restore
speeds where restoring and recomputing cost about the same per token; `--fixed` adds fixed
checkpointing (the best baseline there) and `--mean-queue` LUMEN with the delay term of
routing priced at the live workers' mean queue instead of the chosen worker's
(`lumen-meanqueue`; tried and not kept: it moved the demo's LUMEN / fixed TTFT by about 1%,
and it resumes onto a holder running 99 requests beside a survivor running 1, which the
degraded gateways' test refuses; `policy.completion_estimates`).

Per cell (load, restore GB/s, reload s or nvme, prompt scale, workers; the sweep's axes,
`lumend/sim/sweep.py`) and seed, stop-and-restart and LUMEN run on the same workload and
fault as the sweep runs them. `--variants` adds LUMEN without draft assist
(`lumen-noassist`), LUMEN with the recompute target of `ab47bb0` (`lumen-oldtarget`: the
survivor with the least estimate instead of the shortest queue) and that target with the
recompute's own seconds priced at each survivor's decode batch (`d*B + e*C` in every step)
instead of a full chunk's cost per token (`lumen-oldtarget-batchown`), each also without
assist, and LUMEN with draft-assist's gain weighing throughput (`lumen-throughputassist`:
the decode speed-up counted on every decode-only step, against the default "ttft", which
counts it only where prefill is capacity-bound or absent). Each run is split into:

* ff: failure-free mean TTFT over the whole trace (the reference run);
* ttft: the sweep's figure, mean TTFT over the impact window (common to the policies);
* intr: mean TTFT of the requests the fault moved (interrupted or queued on the failed
  worker), and their mean seconds from detection to their next token (recompute);
* others: mean TTFT of the window's requests the fault never touched;
* resumed: moved requests resumed from their checkpoint (the rest recomputed);
* qroute: mean queue length (requests admitted, not finished) of the survivor each moved
  request was sent to, at the moment it was routed, minus the shortest live queue then;
* assist: draft rounds (assisted sequence-steps);
* tpot: per-token TPOT over the window; recovery: the run's recovery time (s).

Ratios to stop-and-restart (and to fixed checkpointing with `--fixed`) are means of
per-seed ratios with 95% Student-t intervals. Prints numbers; asserts nothing.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lumend.coordinator import policy
from lumend.sim.config import SimConfig, apply_policy
from lumend.sim.engine import Req, SimResult, Simulation
from lumend.sim.metrics import impact_window, mean, recovery_of, tpot_per_token, ttft
from lumend.sim.runner import reference_config
from lumend.sim.stats import interval, paired_ratio
from lumend.sim.sweep import Cell, cell_config, cell_workload
from lumend.sim.workload import Workload

DEFAULT_CELLS = ("0.7,1,nvme,1,4", "0.7,1,120,1,4", "0.5,1,nvme,4,8", "0.5,1,120,4,8",
                 "0.7,25,nvme,1,4")

Estimates = Callable[[policy.LoadSnapshot, "int | None", int, int, policy.PolicyConfig],
                     "tuple[float, int | None, float]"]
Routes = list[tuple[int, int, bool]]
# Variants: LUMEN's routing with the recompute target of `ab47bb0` (the survivor with the
# least estimate, not the shortest queue), and that with the recompute's own seconds priced
# at each survivor's decode batch instead of a full chunk's cost per token.
OLD_TARGET = "lumen-oldtarget"
BATCH_OWN = "lumen-oldtarget-batchown"
# LUMEN with draft-assist's gain weighing throughput (`assist_objective = "throughput"`):
# the decode speed-up over the share of steps that decode only, minus the prefill slowdown
# over the share that carry prefill (the rule before "ttft", the default).
THROUGHPUT_ASSIST = "lumen-throughputassist"
# LUMEN with the delay its request's seconds impose priced at the live workers' mean queue
# (the rule before the live mean queue, `policy.completion_estimates`).
MEAN_QUEUE = "lumen-meanqueue"


def least_estimate(per_token: list[float] | None) -> Estimates:
    """`policy.completion_estimates` with `ab47bb0`'s recompute target: the live worker where
    recomputing is estimated to complete soonest (ties: shorter queue, lower index). Own
    seconds at `per_token[i]` per token on worker i when given, else the config's."""
    def estimates(snapshot: policy.LoadSnapshot, holder: int | None, prefix_blocks: int,
                  total_tokens: int, cfg: policy.PolicyConfig
                  ) -> tuple[float, int | None, float]:
        queued = policy.work(snapshot, cfg)
        queue = snapshot.queue

        def own(i: int, tokens: float) -> float:
            if per_token is None:
                return policy.recompute_s(tokens, cfg)
            return max(0.0, tokens) * per_token[i]

        def cost(i: int, seconds: float) -> float:
            return queued[i] + seconds * (1.0 + cfg.delay_weight * queue[i])

        costs = [(cost(i, own(i, total_tokens)), queue[i], i)
                 for i, q in enumerate(queued) if q != math.inf]
        recompute, _, target = min(costs) if costs else (math.inf, 0, None)
        resume = math.inf
        if holder is not None and snapshot.alive[holder] and prefix_blocks > 0:
            tokens = min(prefix_blocks * cfg.block_tokens, max(total_tokens - 1, 0))
            resume = cost(holder, policy.restore_s(tokens, cfg) + own(holder,
                                                                        total_tokens - tokens))
        return resume, target, recompute
    return estimates


def mean_queue_estimates(snapshot: policy.LoadSnapshot, holder: int | None,
                          prefix_blocks: int, total_tokens: int, cfg: policy.PolicyConfig
                          ) -> tuple[float, int | None, float]:
    """`policy.completion_estimates` with each option's delay term at the live workers'
    mean queue: queued work + own seconds x (1 + delay_weight x that mean)."""
    queued = policy.work(snapshot, cfg)
    live = [q for q, ok in zip(snapshot.queue, snapshot.alive, strict=True) if ok]
    sharing = 1.0 + cfg.delay_weight * (sum(live) / len(live) if live else 0.0)

    def cost(i: int, seconds: float) -> float:
        return queued[i] + seconds * sharing

    target = policy.least_loaded(snapshot, cfg)
    recompute = math.inf if target is None else cost(target, policy.recompute_s(total_tokens,
                                                                                cfg))
    resume = math.inf
    if holder is not None and snapshot.alive[holder] and prefix_blocks > 0:
        tokens = min(prefix_blocks * cfg.block_tokens, max(total_tokens - 1, 0))
        resume = cost(holder, policy.restore_s(tokens, cfg)
                      + policy.recompute_s(total_tokens - tokens, cfg))
    return resume, target, recompute


class Traced(Simulation):
    """The simulator, recording where each moved request is routed and the queues then;
    `variant` swaps the policy's estimates while a request is routed (OLD_TARGET, BATCH_OWN)."""

    def __init__(self, workload: Workload, cfg: SimConfig, variant: str = "") -> None:
        super().__init__(workload, cfg)
        self.routes: Routes = []  # (its queue - min queue, worker, resumed)
        self.variant = variant

    def _recover(self, r: Req, now: float) -> None:
        before = list(self.col_queue)
        per_token: list[float] | None = None
        if self.variant == BATCH_OWN:
            per_token = []
            for w in self.workers:
                p = max(1, self.cfg.prefill_budget(len(w.running)))
                per_token.append(self.cost.step_time(p, len(w.running), w.ctx_sum) / p)
        if self.variant in (OLD_TARGET, BATCH_OWN, MEAN_QUEUE):
            saved = policy.completion_estimates
            swapped = (mean_queue_estimates if self.variant == MEAN_QUEUE
                       else least_estimate(per_token))
            setattr(policy, "completion_estimates", swapped)  # noqa: B010
            try:
                super()._recover(r, now)
            finally:
                setattr(policy, "completion_estimates", saved)  # noqa: B010
        else:
            super()._recover(r, now)
        if r.worker >= 0:
            live = [q for q, ok in zip(before, self.col_alive, strict=True) if ok]
            self.routes.append((before[r.worker] - min(live), r.worker, r.resumed))


@dataclass
class Run:
    result: SimResult
    reference: SimResult
    routes: list[tuple[int, int, bool]]


def simulate_traced(workload: Workload, cfg: SimConfig, variant: str = ""
                    ) -> tuple[SimResult, Routes]:
    sim = Traced(workload, cfg, variant)
    return sim.run(), sim.routes


def parse_cell(text: str) -> Cell:
    load, bw, reload, scale, workers = text.split(",")
    return Cell(float(load), float(bw), None if reload == "nvme" else float(reload),
                float(scale), int(workers))


def variants(base: SimConfig, names: list[str]) -> dict[str, SimConfig]:
    out: dict[str, SimConfig] = {}
    for name in names:
        baseline = name in ("stop_and_restart", "fixed_checkpoint")
        cfg = apply_policy(base, name if baseline else "lumen")
        if name.endswith("-noassist"):
            cfg = replace(cfg, policy=replace(cfg.policy, draft_assist=False))
        if name == THROUGHPUT_ASSIST:
            cfg = replace(cfg, policy=replace(cfg.policy, assist_objective="throughput"))
        out[name] = cfg
    return out


def figures(run: Run, window: float) -> dict[str, float]:
    res, ref = run.result, run.reference
    fault = res.fault
    assert fault is not None and fault.detected_at is not None
    lo, hi = fault.at, fault.at + window
    win = [r for r in res.requests if lo <= r.arrival <= hi or r.epoch > 0]
    moved = [r for r in res.requests if r.epoch > 0]
    others = [r for r in win if r.epoch == 0]
    recompute = [r.replay_first - fault.detected_at for r in moved if r.replay_first >= 0]
    firsts = [r.first_token - fault.detected_at for r in moved
              if r.interrupted_at < 0 and r.first_token >= 0]
    return {
        "ff": mean([ttft(r) for r in ref.requests]),
        "ttft": mean([ttft(r) for r in win]),
        "intr": mean([ttft(r) for r in moved]),
        "recomp": mean(recompute + firsts),
        "others": mean([ttft(r) for r in others]),
        "moved": float(len(moved)),
        "resumed": float(sum(1 for r in moved if r.resumed)),
        "qroute": mean([float(d) for d, _, _ in run.routes]),
        "assist": float(res.draft_rounds),
        "tpot": tpot_per_token(win),
        "recovery": math.nan if (rec := recovery_of(res, 10.0)) is None else rec,
    }


def fmt(values: list[float]) -> str:
    vals = [v for v in values if not math.isnan(v)]
    if not vals:
        return "-"
    m, h = interval(vals)
    return f"{m:.3f} ± {h:.3f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cells", nargs="*", default=list(DEFAULT_CELLS))
    ap.add_argument("--seeds", default="0-5")
    ap.add_argument("--duration", type=float, default=600.0)
    ap.add_argument("--fail-at", type=float, default=200.0)
    ap.add_argument("--variants", action="store_true")
    ap.add_argument("--fixed", action="store_true", help="add fixed checkpointing")
    ap.add_argument("--throughput", action="store_true",
                    help=f"add {THROUGHPUT_ASSIST} (assist_objective throughput)")
    ap.add_argument("--mean-queue", action="store_true",
                    help=f"add {MEAN_QUEUE} (and without assist)")
    ap.add_argument("--model", default=SimConfig().model)
    ap.add_argument("--gpu", default=SimConfig().gpu)
    args = ap.parse_args()
    lo, _, hi = args.seeds.partition("-")
    seeds = list(range(int(lo), int(hi or lo) + 1))
    names = ["stop_and_restart"] + (["fixed_checkpoint"] if args.fixed else []) + ["lumen"]
    if args.variants:
        names += ["lumen-noassist", THROUGHPUT_ASSIST, OLD_TARGET, OLD_TARGET + "-noassist",
                  BATCH_OWN, BATCH_OWN + "-noassist"]
    if args.throughput and not args.variants:
        names.append(THROUGHPUT_ASSIST)
    if args.mean_queue:
        names += [MEAN_QUEUE, MEAN_QUEUE + "-noassist"]
    base = SimConfig(model=args.model, gpu=args.gpu)
    base = replace(base, fault=replace(base.fault, kind=base.fault.kind.worker,
                                       at_s=args.fail_at))
    keys = ("ff", "ttft", "intr", "recomp", "others", "moved", "resumed", "qroute", "assist",
            "tpot", "recovery")
    for text in args.cells:
        cell = parse_cell(text)
        started = time.perf_counter()
        per: dict[str, dict[str, list[float]]] = {n: {k: [] for k in keys} for n in names}
        for seed in seeds:
            cfg = replace(cell_config(base, cell), seed=seed)
            workload = cell_workload(cfg, cell, args.duration, seed)
            runs: dict[str, Run] = {}
            for name, pcfg in variants(cfg, names).items():
                variant = name.removesuffix("-noassist")
                res, routes = simulate_traced(workload, pcfg, variant)
                ref, _ = simulate_traced(workload, reference_config(pcfg))
                runs[name] = Run(res, ref, routes)
            window = impact_window([recovery_of(r.result, cfg.bin_s) for r in runs.values()],
                                   runs[names[0]].result, cfg.bin_s)
            for name, run in runs.items():
                for k, v in figures(run, window).items():
                    per[name][k].append(v)
        print(f"\ncell {text} (load, restore GB/s, reload, prompt x, workers), seeds "
              f"{args.seeds}, {time.perf_counter() - started:.0f} s")
        print(f"  {'policy':16s} " + " ".join(f"{k:>15s}" for k in keys))
        for name in names:
            print(f"  {name:16s} " + " ".join(f"{fmt(per[name][k]):>15s}" for k in keys))
        for base_name, label in (("stop_and_restart", "S&R"), ("fixed_checkpoint", "fixed")):
            if base_name not in per:
                continue
            for name in names:
                if name in ("stop_and_restart", "fixed_checkpoint"):
                    continue
                ratios = []
                for k in ("ff", "ttft", "intr", "others", "tpot"):
                    m, h = paired_ratio(per[name][k], per[base_name][k])
                    ratios.append(f"{k} {m:.3f} ± {h:.3f}")
                print(f"  {name} / {label}: " + ", ".join(ratios))


if __name__ == "__main__":
    main()

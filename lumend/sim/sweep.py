"""A sweep: the baselines, LUMEN and LUMEN with shadows over a grid of cluster conditions.

Axes: load (utilisation), restore bandwidth, reload time, prompt length (a scale on the
synthetic trace's prompts) and cluster size. Per cell every policy runs on the same seeds;
LUMEN is compared with the cell's best baseline (the one with the lower mean TTFT over the
seeds) by the per-seed ratio (`stats.paired_ratio`), so a cell's verdict is paired by seed.

Load is a share of one worker's estimated capacity, `1 / request_seconds`: a request's
prefill at a full chunk's per-token cost plus its output at the marginal decode cost of one
more sequence in a 64-sequence batch. For Qwen3-32B on a100-tp4 that is 6.29 req/s at the
trace's prompts, where the failure-free runs were measured to saturate (~6.3), and scaling
prompts lowers the rate so the offered work per worker stays the same share.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from lumend.engine.costmodel import CostModel, load_cost_model
from lumend.sim.config import SimConfig
from lumend.sim.runner import metrics_document, run_policies
from lumend.sim.stats import interval, paired_ratio
from lumend.sim.workload import Workload, synthetic

BASELINES = ("stop_and_restart", "fixed_checkpoint")
LUMENS = ("lumen", "lumen_shadow")
SWEEP_POLICIES = (*BASELINES, *LUMENS)
KEYS = ("mean_ttft_s", "recovery_time_s", "baseline_mean_ttft_s")
MEAN_PROMPT, MEAN_OUTPUT = 1155.0, 211.0  # the synthetic trace's means (workload.py)
NVME = "nvme"  # reload axis value: weights / SimConfig.reload_gbps + init_s

# The default grid: 32 cells, a few minutes on one core with 3 seeds of 600 s.
DEFAULT_AXES = {"loads": "0.5,0.7", "restore_gbps": "25,1", "reload_s": "nvme,120",
                "prompt_scales": "1,4", "sizes": "4,8"}


class GridError(ValueError):
    """A grid axis that does not parse; the message names the option and the fix."""


@dataclass(frozen=True, slots=True)
class Cell:
    load: float                 # share of a worker's estimated capacity
    restore_gbps: float         # checkpoint pages host -> GPU
    reload_s: float | None      # None: from NVMe (weights / reload_gbps + init_s)
    prompt_scale: float
    workers: int

    def label(self) -> dict[str, Any]:
        return {"load": self.load, "restore_gbps": self.restore_gbps,
                "reload_s": NVME if self.reload_s is None else self.reload_s,
                "prompt_scale": self.prompt_scale, "workers": self.workers}


@dataclass(frozen=True, slots=True)
class Grid:
    loads: tuple[float, ...]
    restore_gbps: tuple[float, ...]
    reload_s: tuple[float | None, ...]
    prompt_scales: tuple[float, ...]
    sizes: tuple[int, ...]

    def cells(self) -> list[Cell]:
        return [Cell(load, bw, reload, scale, size) for size in self.sizes
                for reload in self.reload_s for scale in self.prompt_scales
                for load in self.loads for bw in self.restore_gbps]

    def describe(self) -> str:
        reloads = ",".join(NVME if r is None else f"{r:g}" for r in self.reload_s)
        return (f"load {_join(self.loads)} x restore {_join(self.restore_gbps)} GB/s x reload "
                f"{reloads} s x prompt scale {_join(self.prompt_scales)} x workers "
                f"{_join(self.sizes)}: {len(self.cells())} cells")

    def document(self) -> dict[str, list[Any]]:
        return {"loads": list(self.loads), "restore_gbps": list(self.restore_gbps),
                "reload_s": [NVME if r is None else r for r in self.reload_s],
                "prompt_scales": list(self.prompt_scales), "sizes": list(self.sizes)}


def _join(values: Sequence[float]) -> str:
    return ",".join(f"{v:g}" for v in values)


def _numbers(option: str, text: str, example: str) -> list[float]:
    items = [s.strip() for s in text.split(",")]
    if not text.strip() or any(not s for s in items):
        raise GridError(f"{option}: empty value in {text!r}; give a comma list such as "
                        f"{example}")
    out = []
    for s in items:
        try:
            v = float(s)
        except ValueError:
            raise GridError(f"{option}: {s!r} is not a number; give a comma list such as "
                            f"{example}") from None
        if not math.isfinite(v):
            raise GridError(f"{option}: {s!r} is not a finite number")
        out.append(v)
    if len(set(out)) != len(out):
        raise GridError(f"{option}: a value is repeated in {text!r}; give each once")
    return out


def parse_grid(loads: str, restore_gbps: str, reload_s: str, prompt_scales: str,
               sizes: str) -> Grid:
    """The grid from the sweep options' comma lists; GridError names a bad value and the fix."""
    load = _numbers("--loads", loads, DEFAULT_AXES["loads"])
    for v in load:
        if not 0 < v < 1.5:
            raise GridError(f"--loads: {v:g} is not a share of capacity in (0, 1.5); 0.7 "
                            "is 70% of a worker's estimated capacity")
    bw = _numbers("--restore-gbps", restore_gbps, DEFAULT_AXES["restore_gbps"])
    for v in bw:
        if v <= 0:
            raise GridError(f"--restore-gbps: {v:g} GB/s must be positive")
    reloads: list[float | None] = []
    items = [s.strip() for s in reload_s.split(",")]
    rest = [s for s in items if s.lower() != NVME]
    if len(rest) < len(items) - 1:
        raise GridError(f"--reload-s: {NVME!r} is repeated in {reload_s!r}; give it once")
    numbers = _numbers("--reload-s", ",".join(rest), "nvme,120") if rest else []
    for v in numbers:
        if v < 0:
            raise GridError(f"--reload-s: {v:g} s must be >= 0 (or 'nvme': weights / "
                            "reload bandwidth + init)")
    it = iter(numbers)
    reloads = [None if s.lower() == NVME else next(it) for s in items]
    scales = _numbers("--prompt-scales", prompt_scales, DEFAULT_AXES["prompt_scales"])
    for v in scales:
        if v <= 0:
            raise GridError(f"--prompt-scales: {v:g} must be positive (1: the trace's prompts)")
    size_values = _numbers("--sizes", sizes, DEFAULT_AXES["sizes"])
    ints = []
    for v in size_values:
        if v != int(v) or v < 2:
            raise GridError(f"--sizes: {v:g} is not a whole number of workers >= 2 (a "
                            "failure needs a survivor)")
        ints.append(int(v))
    return Grid(tuple(load), tuple(bw), tuple(reloads), tuple(scales), tuple(ints))


def request_seconds(cost: CostModel, prompt: float, output: float, chunk: int) -> float:
    """One worker's seconds for a mean request: its prefill at a full chunk's per-token cost
    plus each output token at the marginal cost of one more sequence in a 64-sequence batch."""
    per_prefill_token = cost.step_time(chunk, 0, 0) / chunk
    context = prompt + output / 2
    decode = cost.step_time(0, 65, 65 * context) - cost.step_time(0, 64, 64 * context)
    return prompt * per_prefill_token + output * decode


def rate_per_worker(cfg: SimConfig, cell: Cell) -> float:
    cost = load_cost_model(cfg.model, cfg.gpu)
    return cell.load / request_seconds(cost, MEAN_PROMPT * cell.prompt_scale, MEAN_OUTPUT,
                                       cfg.chunk_tokens)


def cell_config(base: SimConfig, cell: Cell) -> SimConfig:
    return replace(base, workers=cell.workers, restore_bytes_per_s=cell.restore_gbps * 1e9,
                   reload_s=cell.reload_s, mean_prompt_tokens=MEAN_PROMPT * cell.prompt_scale)


def cell_workload(cfg: SimConfig, cell: Cell, duration_s: float, seed: int) -> Workload:
    rate = rate_per_worker(cfg, cell) * cell.workers
    w = synthetic(rate, duration_s, seed)
    if cell.prompt_scale == 1:
        return w
    return Workload(w.arrivals, [max(1, round(p * cell.prompt_scale)) for p in w.prompts],
                    w.outputs)


def run_cell(base: SimConfig, cell: Cell, seeds: Sequence[int], duration_s: float
             ) -> dict[str, list[dict[str, Any]]]:
    """Every sweep policy on each seed: per policy, one metrics document per seed."""
    per_seed: dict[str, list[dict[str, Any]]] = {n: [] for n in SWEEP_POLICIES}
    for seed in seeds:
        cfg = replace(cell_config(base, cell), seed=seed)
        for run in run_policies(cell_workload(cfg, cell, duration_s, seed), cfg,
                                SWEEP_POLICIES):
            doc = metrics_document(run.metrics)
            per_seed[run.metrics.policy].append({k: doc[k] for k in KEYS})
    return per_seed


def _summary(values: list[Any]) -> dict[str, float] | None:
    nums = [float(v) for v in values if isinstance(v, (int, float))]
    if not nums:
        return None
    m, half = interval(nums)
    return {"mean": m, "ci95": half, "missing": len(values) - len(nums)}


def paired(a: list[dict[str, Any]], b: list[dict[str, Any]], key: str
           ) -> dict[str, float] | None:
    """The mean of the per-seed ratios a/b of `key` with its 95% interval, over the seeds
    where both are numbers and b is not 0 (`pairs` of them); None without any."""
    pairs = [(float(x), float(y)) for da, db in zip(a, b, strict=True)
             if isinstance(x := da.get(key), (int, float))
             and isinstance(y := db.get(key), (int, float)) and y]
    if not pairs:
        return None
    m, half = paired_ratio([x for x, _ in pairs], [y for _, y in pairs])
    return {"mean": m, "ci95": half, "pairs": len(pairs)}


def verdict(ratio: dict[str, float] | None) -> str:
    """'better' / 'worse' when the ratio's 95% interval lies below / above 1, else 'same'."""
    if ratio is None:
        return "n/a"
    if ratio["mean"] + ratio["ci95"] < 1:
        return "better"
    if ratio["mean"] - ratio["ci95"] > 1:
        return "worse"
    return "same"


def summarise_cell(per_seed: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """Means with intervals per policy; the best baseline (lower mean TTFT over the seeds);
    each LUMEN policy's TTFT and recovery ratio to it, paired by seed, with a verdict."""
    policies = {name: {key: _summary([d.get(key) for d in docs]) for key in KEYS}
                for name, docs in per_seed.items()}

    def mean_ttft(name: str) -> float:
        s = policies[name]["mean_ttft_s"]
        return math.inf if s is None else s["mean"]

    best = min((b for b in BASELINES if b in per_seed), key=mean_ttft)
    out: dict[str, Any] = {"best_baseline": best, "policies": policies}
    for name in LUMENS:
        if name not in per_seed:
            continue
        ttft = paired(per_seed[name], per_seed[best], "mean_ttft_s")
        recovery = paired(per_seed[name], per_seed[best], "recovery_time_s")
        out[f"{name}_vs_best"] = {"ttft_ratio": ttft, "recovery_ratio": recovery,
                                  "ttft": verdict(ttft), "recovery": verdict(recovery)}
    return out


def against_baselines(per_seed: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """Each policy's means with intervals and each LUMEN policy's TTFT and recovery ratio to
    each baseline, paired by seed (the demo's closing table)."""
    policies = {name: {key: _summary([d.get(key) for d in docs]) for key in KEYS}
                for name, docs in per_seed.items()}
    ratios = {f"{name}_vs_{base}": {
        "ttft_ratio": (t := paired(per_seed[name], per_seed[base], "mean_ttft_s")),
        "recovery_ratio": (r := paired(per_seed[name], per_seed[base], "recovery_time_s")),
        "ttft": verdict(t), "recovery": verdict(r)}
        for name in LUMENS if name in per_seed for base in BASELINES if base in per_seed}
    return {"policies": policies, "ratios": ratios}


def run_sweep(base: SimConfig, grid: Grid, seeds: Sequence[int], duration_s: float,
              on_cell: Callable[[int, Cell], None] | None = None) -> dict[str, Any]:
    """Every cell of `grid`: its axes, rate, and `summarise_cell`. `on_cell(i, cell)` after
    each."""
    cells = []
    for i, cell in enumerate(grid.cells()):
        per_seed = run_cell(base, cell, seeds, duration_s)
        cells.append({**cell.label(), "rate_per_worker": rate_per_worker(base, cell),
                      **summarise_cell(per_seed)})
        if on_cell is not None:
            on_cell(i, cell)
    return {"grid": grid.document(), "model": base.model, "gpu": base.gpu,
            "fault": base.fault.kind.value, "fault_at_s": base.fault.at_s,
            "duration_s": duration_s, "seeds": list(seeds), "reload_gbps": base.reload_gbps,
            "init_s": base.init_s, "policies": list(SWEEP_POLICIES), "cells": cells}

"""`lumenctl sim`: the cluster simulator (lumend/sim) from the command line.

The simulator is imported inside the command so `lumenctl --help` stays fast.
"""

from __future__ import annotations

import sys
from dataclasses import replace
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

import typer

if TYPE_CHECKING:
    from lumend.sim.config import SimConfig
    from lumend.sim.runner import PolicyRun
    from lumend.sim.sweep import Grid
    from lumend.sim.workload import Workload

DEFAULT_RATE = 4.4  # req/s per worker without --rate or --scenario: paper-4w's load
SWEEP_DURATION = 600.0  # s of arrivals per sweep run: 200 s before the fault, 400 after
SWEEP_FAULT_AT = 200.0
EXIT_FAILED = 1
EXIT_USAGE = 2


class FailMode(StrEnum):
    none = "none"
    worker = "worker"
    node = "node"
    correlated = "correlated"
    gray = "gray"
    hang = "hang"


class Fmt(StrEnum):
    table = "table"
    json = "json"
    yaml = "yaml"


def _fail(code: int, message: str) -> NoReturn:
    typer.echo(f"lumenctl sim: {message}", err=True)
    raise typer.Exit(code)


HELP = (
    "Simulate a failure on a cluster under each policy and compare them.\n\n"
    "Per policy, over the failure-impact window: mean and p99 TTFT and TPOT (beside the "
    "failure-free run's), recovery time, interrupted and resumed requests, their replay "
    "TTFT, checkpoint coverage, holder balance (max/mean checkpoint bytes held) and assist "
    "acceptance (accepted/drafted tokens; '-' or null without draft assist). "
    "See docs/simulator.md."
)


def register(app: typer.Typer) -> None:
    """Add the `sim` command to `app`."""
    app.command(name="sim", help=HELP)(sim)


def sim(
    ctx: typer.Context,
    trace: Path | None = typer.Option(
        None, "--trace", help="Replay a CSV trace: the Azure LLM inference trace as published "
        "(TIMESTAMP, ContextTokens, GeneratedTokens) or Vidur's form of it (arrived_at, "
        "num_prefill_tokens, num_decode_tokens)."),
    synthetic: bool = typer.Option(
        False, "--synthetic", help="Generate a conversation-like trace (the default)."),
    scenario: str | None = typer.Option(
        None, "--scenario", help="paper-4w, paper-8w or paper-scale: the paper's setups."),
    workers: int | None = typer.Option(None, "--workers", min=1, help="Workers (default 4)."),
    model: str | None = typer.Option(None, "--model", help="Model preset (default qwen3-32b)."),
    gpu: str | None = typer.Option(None, "--gpu", help="GPU preset (default a100-tp4)."),
    fail: FailMode | None = typer.Option(None, "--fail", help="What fails (default worker)."),
    fail_fraction: float | None = typer.Option(
        None, "--fail-fraction", help="Fail this fraction of the workers at once."),
    slowdown: float = typer.Option(3.0, "--slowdown", help="Gray failure slowdown factor."),
    fail_at: float | None = typer.Option(None, "--fail-at", help="Fault time, s (default 300)."),
    policy: str = typer.Option(
        "all", "--policy", help="A policy, a comma-separated list, 'all' (the three main "
        "ones), 'ablation' (LUMEN's mechanisms alone and in pairs) or 'extended' (with "
        "shadow engines and dual-replica checkpoints)."),
    shadows: bool = typer.Option(
        False, "--shadows", help="Every worker has a shadow engine: a crashed engine is "
        "replaced in 0.5 s (not a lost node)."),
    replicas: int = typer.Option(1, "--replicas", min=1, max=2,
                                 help="Checkpoint copies per request (2: dual replica)."),
    eviction: str = typer.Option(
        "lru", "--eviction", help="A full holder's eviction: lru, shortest_prefix, "
        "longest_prefix_protected or refuse (lumend's [checkpoint] eviction)."),
    detect: float | None = typer.Option(
        None, "--detect", help="Seconds until a failure is noticed (default: 0.1 for an "
        "engine crash, the supervisor's tick; 10 for a lost host, the lease TTL; 6.25 for a "
        "hung engine, three probes; about 20.3 models a vLLM engine core hung behind its "
        "live API server, LUMEN_CORE_HANG_S)."),
    stall: float | None = typer.Option(
        None, "--stall", help="Seconds from a hang until its worker is taken as stalled and "
        "admitted to no more (default 3: a missed probe; about 7 for a vLLM engine core "
        "hung behind its API server)."),
    theta: float | None = typer.Option(None, "--theta", help="Algorithm 2 load threshold."),
    tau: int | None = typer.Option(None, "--tau", help="Algorithm 2 prefix threshold, blocks."),
    budget: float | None = typer.Option(
        None, "--budget", help="Host memory per worker for checkpoints, GiB (default 64)."),
    rate: float | None = typer.Option(
        None, "--rate", help="Requests/s per worker; a trace is time-scaled to it."),
    duration: float | None = typer.Option(
        None, "--duration", help="Seconds of arrivals (default 900; a trace: all of it)."),
    seed: int = typer.Option(0, "--seed", help="Seed of the synthetic trace and fault choice."),
    seeds: int | None = typer.Option(
        None, "--seeds", min=1, help="Run seeds SEED..SEED+N-1 and report means with 95% "
        "intervals and LUMEN's ratios paired by seed (a trace is replayed per seed; the "
        "seed moves the fault choice and draft sampling). Default 1, 3 with --sweep."),
    reload_gbps: float | None = typer.Option(
        None, "--reload-gbps", help="A reload reads the weights at this many GB/s (default "
        "3, a PCIe 4.0 NVMe drive), plus 20 s of engine init."),
    sweep: bool = typer.Option(
        False, "--sweep", help="Run the baselines, LUMEN and LUMEN with shadows over a grid "
        "(--loads x --restore-gbps x --reload-s x --prompt-scales x --sizes) and compare "
        "LUMEN with each cell's best baseline, paired by seed."),
    loads: str | None = typer.Option(
        None, "--loads", help="Sweep axis: load as a share of a worker's estimated capacity "
        "(default 0.5,0.7)."),
    restore_gbps: str | None = typer.Option(
        None, "--restore-gbps", help="Sweep axis: checkpoint restore bandwidth, GB/s "
        "(default 25,1)."),
    reload_s: str | None = typer.Option(
        None, "--reload-s", help="Sweep axis: seconds until a crashed worker serves again; "
        "'nvme' is weights / --reload-gbps + 20 s init (default nvme,120)."),
    prompt_scales: str | None = typer.Option(
        None, "--prompt-scales", help="Sweep axis: prompt lengths times this (default 1,4); "
        "the rate drops so the load stays the same share of capacity."),
    sizes: str | None = typer.Option(
        None, "--sizes", help="Sweep axis: workers in the cluster (default 4,8)."),
    output: Fmt | None = typer.Option(
        None, "--output", "-o", help="table, json or yaml (default: lumenctl's -o)."),
    plot: Path | None = typer.Option(
        None, "--plot", help="Write a PNG: the timeline of TTFT and queue depth, or with "
        "--sweep the heatmap of LUMEN / best baseline TTFT per cell."),
) -> None:
    """Simulate a failure on a cluster under each policy and compare them (--help: HELP)."""
    from lumend.coordinator.policy import GIB
    from lumend.engine.costmodel import PresetError
    from lumend.sim.config import SCENARIOS, FaultKind, FaultSpec, SimConfig, expand_policies
    from lumend.sim.engine import SimError
    from lumend.sim.workload import TraceError

    fmt = output or Fmt(str(getattr(ctx.obj, "output", "table")))
    if plot is not None:
        from lumend.sim.plot import MISSING, plotting_available

        if not plotting_available():
            _fail(EXIT_USAGE, MISSING)
    axes = {"--loads": loads, "--restore-gbps": restore_gbps, "--reload-s": reload_s,
            "--prompt-scales": prompt_scales, "--sizes": sizes}
    if not sweep:
        given = [name for name, value in axes.items() if value is not None]
        if given:
            _fail(EXIT_USAGE, f"{', '.join(given)} {'is a' if len(given) == 1 else 'are'} "
                  "--sweep axis option; add --sweep, or drop it for one run")
    else:
        clash = [name for name, value in (("--trace", trace), ("--scenario", scenario),
                                          ("--workers", workers), ("--rate", rate),
                                          ("--fail-fraction", fail_fraction))
                 if value is not None]
        if clash or policy != "all":
            clash += [] if policy == "all" else ["--policy"]
            _fail(EXIT_USAGE, f"--sweep sets {', '.join(clash)} itself (synthetic trace, "
                  "--sizes for workers, --loads for the rate, its four policies); drop it")
    if trace is not None and synthetic:
        _fail(EXIT_USAGE, "--trace and --synthetic exclude each other")
    if fail is not None and fail_fraction is not None:
        _fail(EXIT_USAGE, "--fail and --fail-fraction exclude each other")
    if scenario is not None and scenario not in SCENARIOS:
        _fail(EXIT_USAGE, f"unknown scenario {scenario!r}; known: {', '.join(SCENARIOS)}")
    sc = SCENARIOS.get(scenario or "")
    if fail_fraction is not None:
        kind = FaultKind.fraction
    elif fail is not None:
        kind = FaultKind(fail.value)
    else:
        kind = sc.fault if sc else FaultKind.worker
    try:
        names = expand_policies(policy)
        fault = FaultSpec(
            kind=kind,
            at_s=fail_at if fail_at is not None else (sc.fault_at_s if sc else 300.0),
            fraction=fail_fraction if fail_fraction is not None else (
                sc.fail_fraction if sc else 0.25),
            slowdown=slowdown,
        )
        base = SimConfig()
        pol = base.policy
        if theta is not None or tau is not None:
            pol = replace(pol, theta=pol.theta if theta is None else theta,
                          tau=pol.tau if tau is None else tau)
        cfg = SimConfig(
            workers=workers or (sc.workers if sc else base.workers),
            model=model or (sc.model if sc else base.model),
            gpu=gpu or (sc.gpu if sc else base.gpu),
            policy=pol, fault=fault, seed=seed,
            budget_bytes=budget * GIB if budget is not None else base.budget_bytes,
            shadows=shadows, replicas=replicas, eviction=eviction,
            crash_detect_s=detect if detect is not None else base.crash_detect_s,
            host_detect_s=detect if detect is not None else base.host_detect_s,
            hang_detect_s=detect if detect is not None else base.hang_detect_s,
            hang_stall_s=stall if stall is not None else base.hang_stall_s,
            reload_gbps=reload_gbps if reload_gbps is not None else base.reload_gbps,
        )
        if budget is not None and budget < 0:
            raise ValueError(f"--budget must be >= 0 GiB, got {budget}")
        from lumend.engine.costmodel import load_cost_model

        load_cost_model(cfg.model, cfg.gpu)
        per_worker = rate if rate is not None else (sc.rate_per_worker if sc else None)
        if sweep:
            from lumend.sim.sweep import DEFAULT_AXES, parse_grid

            grid = parse_grid(*(value if value is not None else DEFAULT_AXES[key]
                                for key, value in zip(DEFAULT_AXES, axes.values(),
                                                      strict=True)))
            if fail_at is None:
                cfg = replace(cfg, fault=replace(cfg.fault, at_s=SWEEP_FAULT_AT))
        duration = duration if duration is not None else (
            sc.duration_s if sc else (SWEEP_DURATION if sweep else None))
        if not sweep:
            workload = _workload(trace, cfg, per_worker, duration)
    except TraceError as exc:
        _fail(EXIT_USAGE, str(exc))
    except (ValueError, PresetError) as exc:
        _fail(EXIT_USAGE, str(exc))

    if sweep:
        assert duration is not None
        _sweep(cfg, grid, seeds or 3, duration, fmt, plot)
        return
    seeds = seeds or 1
    if seeds > 1:
        _over_seeds(trace, cfg, names, fmt, scenario, per_worker, duration, sc, seeds)
        return
    try:
        runs = _run(workload, cfg, names, fmt)
    except SimError as exc:
        _fail(EXIT_FAILED, str(exc))
    doc = _document(scenario, cfg, workload, runs)
    if fmt is Fmt.json:
        from lumenctl.render import as_json

        typer.echo(as_json(doc))
    elif fmt is Fmt.yaml:
        from lumenctl.render import as_yaml

        typer.echo(as_yaml(doc))
    else:
        _print_table(doc)
    if plot is not None:
        from lumend.sim.plot import plot_timelines

        title = f"{scenario or 'custom'}: {cfg.workers} x {cfg.model} on {cfg.gpu}, " \
                f"fault {cfg.fault.kind.value}"
        try:
            plot_timelines(runs, fault.at_s if kind is not FaultKind.none else None, plot, title)
        except OSError as exc:
            _fail(EXIT_FAILED, f"cannot write {plot}: {exc.strerror}")


def _over_seeds(trace: Path | None, cfg: SimConfig, names: list[str], fmt: Fmt,
                scenario: str | None, per_worker: float | None, duration: float | None,
                sc: Any, seeds: int) -> None:
    """`--seeds N`: every policy on each seed, then means with intervals and paired ratios."""
    from lumend.sim.engine import SimError
    from lumend.sim.runner import metrics_document, run_policies
    from lumend.sim.stats import over_seeds
    from lumend.sim.workload import TraceError

    per_seed: dict[str, list[dict[str, object]]] = {n: [] for n in names}
    used = list(range(cfg.seed, cfg.seed + seeds))
    requests = 0
    for s in used:
        seeded = replace(cfg, seed=s)
        try:
            workload = _workload(trace, seeded, per_worker, duration)
            runs = run_policies(workload, seeded, names)
        except TraceError as exc:
            _fail(EXIT_USAGE, str(exc))
        except SimError as exc:
            _fail(EXIT_FAILED, str(exc))
        requests += len(workload)
        for r in runs:
            per_seed[r.metrics.policy].append(metrics_document(r.metrics))
    doc: dict[str, Any] = {
        "scenario": scenario, "workers": cfg.workers, "model": cfg.model, "gpu": cfg.gpu,
        "fault": cfg.fault.kind.value, "fault_at_s": cfg.fault.at_s,
        "mean_requests": requests / seeds, **over_seeds(per_seed, used)}
    if fmt is Fmt.json:
        from lumenctl.render import as_json

        typer.echo(as_json(doc))
    elif fmt is Fmt.yaml:
        from lumenctl.render import as_yaml

        typer.echo(as_yaml(doc))
    else:
        _print_seeds_table(doc)


def _sweep(cfg: SimConfig, grid: Grid, seeds: int, duration: float, fmt: Fmt,
           plot: Path | None) -> None:
    """`--sweep`: every cell on seeds SEED..SEED+N-1, a table or document, the heatmap."""
    from lumend.sim.engine import SimError
    from lumend.sim.sweep import run_sweep

    used = list(range(cfg.seed, cfg.seed + seeds))
    cells = grid.cells()
    tty = sys.stderr.isatty()
    if tty:
        typer.echo(f"sweep: {grid.describe()}, {seeds} seeds each", err=True)

    def progress(i: int, _cell: object) -> None:
        if tty:
            typer.echo(f"  cell {i + 1}/{len(cells)} done", err=True)

    try:
        doc = run_sweep(cfg, grid, used, duration, progress)
    except SimError as exc:
        _fail(EXIT_FAILED, str(exc))
    if fmt is Fmt.json:
        from lumenctl.render import as_json

        typer.echo(as_json(doc))
    elif fmt is Fmt.yaml:
        from lumenctl.render import as_yaml

        typer.echo(as_yaml(doc))
    else:
        _print_sweep_table(doc, grid)
    if plot is not None:
        from lumend.sim.plot import plot_sweep

        try:
            plot_sweep(doc, plot)
        except OSError as exc:
            _fail(EXIT_FAILED, f"cannot write {plot}: {exc.strerror}")


def _print_sweep_table(doc: dict[str, Any], grid: Grid) -> None:
    from rich.console import Console
    from rich.table import Table

    tty = sys.stdout.isatty()
    console = Console(no_color=not tty, width=None if tty else 220)
    seeds = doc["seeds"]
    head = (f"sweep, {doc['model']} on {doc['gpu']}, fault {doc['fault']} at "
            f"{doc['fault_at_s']:g} s of {doc['duration_s']:g} s, seeds {seeds[0]}..{seeds[-1]}"
            f"; grid {grid.describe()}\nmean ± 95% interval; ratios to the cell's best baseline "
            "(lower mean TTFT) paired by seed; 'nvme' reload = weights / "
            f"{doc['reload_gbps']:g} GB/s + {doc['init_s']:g} s")
    table = Table(title=head, title_justify="left")
    for col in ("LOAD", "RESTORE", "RELOAD", "PROMPT", "WORKERS", "REQ/S/W", "BEST BASELINE",
                "ITS TTFT", "ITS RECOVERY", "LUMEN TTFT", "LUMEN/BEST TTFT",
                "LUMEN/BEST RECOVERY", "+SHADOWS/BEST TTFT", "+SHADOWS/BEST RECOVERY"):
        table.add_column(col, no_wrap=True)
    for c in doc["cells"]:
        best = c["policies"][c["best_baseline"]]
        lumen = c["lumen_vs_best"]
        shadow = c["lumen_shadow_vs_best"]
        reload = c["reload_s"] if c["reload_s"] == "nvme" else f"{c['reload_s']:g} s"
        table.add_row(
            f"{c['load']:g}", f"{c['restore_gbps']:g} GB/s", reload, f"x{c['prompt_scale']:g}",
            str(c["workers"]), f"{c['rate_per_worker']:.2f}", c["best_baseline"],
            _interval(best["mean_ttft_s"], 1.0, "s"),
            _interval(best["recovery_time_s"], 1.0, "s", True),
            _interval(c["policies"]["lumen"]["mean_ttft_s"], 1.0, "s"),
            _verdict(lumen, "ttft"), _verdict(lumen, "recovery"),
            _verdict(shadow, "ttft"), _verdict(shadow, "recovery"))
    console.print(table)
    worse = [c for c in doc["cells"] if "worse" in (c["lumen_vs_best"]["ttft"],
                                                     c["lumen_vs_best"]["recovery"])]
    console.print(f"LUMEN no worse than the best baseline (TTFT and recovery, within the "
                  f"interval) in {len(doc['cells']) - len(worse)} of {len(doc['cells'])} cells")


def _verdict(entry: dict[str, Any], what: str) -> str:
    ratio = entry[f"{what}_ratio"]
    if ratio is None:
        return "-"
    mark = {"better": " better", "worse": " WORSE"}.get(entry[what], "")
    return f"{ratio['mean']:.2f} ± {ratio['ci95']:.2f}x{mark}"


def _print_seeds_table(doc: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    tty = sys.stdout.isatty()
    console = Console(no_color=not tty, width=None if tty else 220)
    head = (f"{doc['scenario'] or 'custom'}: {doc['workers']} workers, {doc['model']} on "
            f"{doc['gpu']}, fault {doc['fault']} at {doc['fault_at_s']:g} s, seeds "
            f"{doc['seeds'][0]}..{doc['seeds'][-1]} (mean ± 95% interval)")
    table = Table(title=head, title_justify="left")
    cols = (("TTFT", "mean_ttft_s", 1.0, "s"), ("TPOT", "mean_tpot_s", 1000.0, "ms"),
            ("RECOVERY", "recovery_time_s", 1.0, "s"),
            ("FAILURE-FREE TTFT", "baseline_mean_ttft_s", 1.0, "s"),
            ("UNINTERRUPTED TTFT", "uninterrupted_mean_ttft_s", 1.0, "s"),
            ("REPLAY TTFT", "replay_ttft_mean_s", 1.0, "s"))
    table.add_column("POLICY", no_wrap=True)
    for title, *_ in cols:
        table.add_column(title)
    for p in doc["policies"]:
        table.add_row(p["policy"], *(_interval(p[key], scale, unit, key == "recovery_time_s")
                                     for _, key, scale, unit in cols))
    console.print(table)
    for c in doc["comparisons"]:
        parts = [f"{k.removesuffix('_ratio')} {_interval(v, 1.0, 'x')}"
                 for k, v in c.items() if k.endswith("_ratio")]
        console.print(f"lumen / {c['versus']} (paired by seed): " + ", ".join(parts))


def _interval(v: dict[str, Any] | None, scale: float, unit: str, never: bool = False) -> str:
    """`never`: a null is a run that never recovered (else: no data)."""
    if v is None:
        return "never" if never else "-"
    text = f"{v['mean'] * scale:.3g} ± {v['ci95'] * scale:.2g} {unit}".replace(" x", "x")
    missing = v.get("missing", 0)
    if missing:
        text += f" ({missing} never)" if never else f" ({missing} n/a)"
    return text


def _workload(trace: Path | None, cfg: SimConfig, per_worker: float | None,
              duration: float | None) -> Workload:
    from lumend.sim.workload import read_trace, synthetic

    if trace is None:
        total = (per_worker if per_worker is not None else DEFAULT_RATE) * cfg.workers
        return synthetic(total, duration if duration is not None else 900.0, cfg.seed)
    workload = read_trace(trace)
    if per_worker is not None:
        workload = workload.scaled_to_rate(per_worker * cfg.workers)
    if duration is not None:
        workload = workload.truncated(duration)
    return workload


def _run(workload: Workload, cfg: SimConfig, names: list[str], fmt: Fmt) -> list[PolicyRun]:
    from lumend.sim.runner import run_policies

    if fmt is not Fmt.table or not sys.stderr.isatty() or len(workload) < 50_000:
        return run_policies(workload, cfg, names)
    from rich.console import Console
    from rich.progress import Progress

    with Progress(console=Console(stderr=True), transient=True) as progress:
        task = progress.add_task("simulating", total=len(names))
        return run_policies(workload, cfg, names, on_done=lambda _: progress.advance(task))


def _document(scenario: str | None, cfg: SimConfig, workload: Workload,
              runs: list[PolicyRun]) -> dict[str, Any]:
    from lumend.sim.runner import metrics_document

    policies = [metrics_document(r.metrics) for r in runs]
    for p, r in zip(policies, runs, strict=True):
        p["wall_s"] = round(r.wall_s, 3)
    by_name = {p["policy"]: p for p in policies}
    comparisons = []
    for other in ("stop_and_restart", "fixed_checkpoint"):
        if "lumen" in by_name and other in by_name:
            comparisons.append({"policy": "lumen", "versus": other,
                                **_relative(by_name["lumen"], by_name[other])})
    return {
        "scenario": scenario,
        "workers": cfg.workers, "model": cfg.model, "gpu": cfg.gpu,
        "fault": cfg.fault.kind.value, "fault_at_s": cfg.fault.at_s,
        "requests": len(workload), "rate_rps": round(workload.rate(), 3),
        "theta": cfg.policy.theta, "tau": cfg.policy.tau,
        "budget_gib": cfg.budget_bytes / (1 << 30), "seed": cfg.seed,
        "eviction": cfg.eviction, "crash_detect_s": cfg.crash_detect_s,
        "host_detect_s": cfg.host_detect_s, "hang_detect_s": cfg.hang_detect_s,
        "hang_stall_s": cfg.hang_stall_s,
        "policies": policies, "comparisons": comparisons,
    }


def _relative(a: dict[str, Any], b: dict[str, Any]) -> dict[str, float | None]:
    out: dict[str, float | None] = {}
    for key in ("mean_ttft_s", "mean_tpot_s", "recovery_time_s"):
        x, y = a[key], b[key]
        out[f"{key.removesuffix('_s')}_change_pct"] = (
            round(100 * (x - y) / y, 1) if x is not None and y else None)
    return out


def _print_table(doc: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    tty = sys.stdout.isatty()
    console = Console(no_color=not tty, width=None if tty else 220)
    head = (f"{doc['scenario'] or 'custom'}: {doc['workers']} workers, {doc['model']} on "
            f"{doc['gpu']}, {doc['requests']} requests at {doc['rate_rps']} req/s, fault "
            f"{doc['fault']} at {doc['fault_at_s']:g} s")
    table = Table(title=head, title_justify="left")
    for col in ("POLICY", "TTFT ref -> fault", "TTFT P99", "TPOT ref -> fault", "TPOT P99",
                "RECOVERY", "INTERRUPTED", "RESUMED", "REPLAY TTFT", "CKPT COVERAGE",
                "HOLDER BALANCE", "ASSIST ACCEPT"):
        table.add_column(col, no_wrap=col == "POLICY")
    for p in doc["policies"]:
        table.add_row(
            p["policy"],
            f"{_s(p['baseline_mean_ttft_s'])} -> {_s(p['mean_ttft_s'])}",
            _s(p["p99_ttft_s"]),
            f"{_ms(p['baseline_mean_tpot_s'])} -> {_ms(p['mean_tpot_s'])}",
            _ms(p["p99_tpot_s"]),
            "never" if p["recovery_time_s"] is None else _s(p["recovery_time_s"]),
            str(p["interrupted"]), str(p["resumed"]),
            _s(p["replay_ttft_mean_s"]),
            _share(p["checkpoint_coverage"]),
            "-" if p["holder_balance"] is None else f"{p['holder_balance']:.2f}",
            _share(p["assist_acceptance"]),
        )
    console.print(table)
    for c in doc["comparisons"]:
        parts = [f"{k.removesuffix('_change_pct')} {_pct(v)}" for k, v in c.items()
                 if k.endswith("_pct")]
        console.print(f"lumen vs {c['versus']}: " + ", ".join(parts))


def _s(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f} s"


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{1000 * v:.1f} ms"


def _share(v: float | None) -> str:
    return "-" if v is None else f"{100 * v:.0f}%"


def _pct(v: float | None) -> str:
    return "n/a" if v is None else f"{v:+.1f}%"

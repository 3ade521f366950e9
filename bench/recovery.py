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
import sys
import tempfile
import time
from pathlib import Path

from lumenctl.localcluster import LocalCluster
from lumenctl.recovery import (
    PAPER,
    Request,
    Result,
    lumenctl,
    ratio,
    replay,
    restored_by_engine,
    restored_since,
    summarise,
    trace,
    wait_whole,
)

VICTIM = "node-2-w0"
CONFIGS = ("stop_and_restart", "fixed_checkpoint", "lumen", "lumen+shadows")


def run_config(cluster: LocalCluster, config: str, requests: list[Request],
               args: argparse.Namespace) -> Result:
    shadows = 1 if config.endswith("+shadows") else 0
    mode = config.removesuffix("+shadows")
    wait_whole(cluster, shadows)
    lumenctl(cluster, "config", "set", "mode", mode, "--yes")  # it asks without --yes
    time.sleep(1.0)
    restored_before = restored_by_engine(cluster)
    print(f"  {config}: {len(requests)} requests over {args.duration:g} s, fault on "
          f"{VICTIM} at {args.fault_at:g} s ...", file=sys.stderr, flush=True)
    outcomes, fault = asyncio.run(replay(cluster, requests, args.fault_at, VICTIM))
    restored = restored_since(cluster, restored_before)
    return summarise(config, outcomes, fault, args.warmup, restored)


# -- output -----------------------------------------------------------------------------


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

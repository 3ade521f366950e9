"""What the gateway adds to a stream: the same streaming requests sent directly to an engine
and through the gateway, interleaved in one run (issue 12's benchmark).

One sim engine (a real process under a real supervisor) and one gateway in a process of its
own; this process is the client. For each concurrency level, rounds alternate direct and
gateway batches of the same requests. Prints added TTFT p50/p99 and streamed tokens/s
through the gateway against direct (per gateway core: the gateway runs on one core).

    .venv/bin/python bench/gateway.py [--concurrency 1 64 512] [--tokens 64] [--rounds 3]

Goal: <= 2 ms added TTFT p50, >= 0.95x direct tokens/s. Asserts nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lumenctl.localcluster import free_ports


def serve(engine_port: int, gateway_port: int, workdir: str, time_scale: float,
          profile: str | None, pin: bool) -> None:
    """The other process: a supervisor with one sim engine, and a gateway over it."""
    if profile:  # the gateway's own time, for finding where a chunk's cost goes
        import cProfile
        import signal

        profiler = cProfile.Profile()
        profiler.enable()

        def dump(*_: object) -> None:
            profiler.disable()
            profiler.dump_stats(profile)
            os._exit(0)

        signal.signal(signal.SIGTERM, dump)
    from lumend.cluster.view import ClusterView
    from lumend.config import WorkerConfig
    from lumend.engine.adapter import SimAdapter
    from lumend.failover.supervisor import SupervisorTiming, WorkerSupervisor
    from lumend.gateway.server import Gateway

    async def main() -> None:
        worker = WorkerConfig(name="w0", gpus=[0], engine="sim", shadows=0, model="sim-small",
                              port=engine_port, args=["--time-scale", str(time_scale)])
        sup = WorkerSupervisor("n", worker, SimAdapter(), runtime_dir=Path(workdir) / "run",
                               log_dir=Path(workdir) / "logs",
                               timing=SupervisorTiming(tick_s=0.05))
        stop = asyncio.Event()
        task = asyncio.create_task(sup.run(stop))
        gateway = Gateway(lambda: ClusterView(cluster="b", revision=0,
                                              workers={"w0": sup.record()}))
        await gateway.start(f"127.0.0.1:{gateway_port}")
        while not (sup.worker_state() == "serving" and sup.ready()):
            await asyncio.sleep(0.05)
        if pin:  # the gateway on the last core; the engine (and the client) on the others
            cores = sorted(os.sched_getaffinity(0))
            engine = next(s for s in sup.slots if s.proc is not None).proc
            assert engine is not None
            os.sched_setaffinity(engine.pid, set(cores[:-1]))
            os.sched_setaffinity(0, {cores[-1]})
        print(json.dumps({"engine": sup.record().engines[0].url}), flush=True)
        await asyncio.Event().wait()
        await task

    asyncio.run(main())


async def one(session: aiohttp.ClientSession, url: str, prompt: str,
              tokens: int) -> tuple[float, float, int]:
    """(ttft s, total s, tokens) of one streamed completion."""
    body = {"prompt": prompt, "max_tokens": tokens, "stream": True}
    start = time.perf_counter()
    first = None
    count = 0
    async with session.post(url + "/v1/completions", json=body) as r:
        assert r.status == 200, await r.text()
        async for raw in r.content:
            line = raw.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[5:])
            if chunk.get("choices") and chunk["choices"][0].get("text"):
                count += 1
                if first is None:
                    first = time.perf_counter()
    end = time.perf_counter()
    return (first or end) - start, end - start, count


async def batch(session: aiohttp.ClientSession, url: str, n: int,
                tokens: int) -> tuple[list[float], float]:
    """TTFTs and the batch's streamed tokens/s."""
    start = time.perf_counter()
    results = await asyncio.gather(*(one(session, url, f"request {i} of the benchmark says",
                                         tokens) for i in range(n)))
    wall = time.perf_counter() - start
    return [r[0] for r in results], sum(r[2] for r in results) / wall


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def measure(engine: str, gateway: str, levels: list[int], tokens: int,
                  rounds: int) -> None:
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector,
                                     timeout=aiohttp.ClientTimeout(total=600)) as session:
        await batch(session, gateway, 4, 8)  # warm both paths
        await batch(session, engine, 4, 8)
        print("| streams | direct TTFT p50 / p99 ms | gateway TTFT p50 / p99 ms | "
              "added p50 / p99 ms | direct tok/s | gateway tok/s | ratio |")
        print("|---|---|---|---|---|---|---|")
        for n in levels:
            direct_ttft: list[float] = []
            gw_ttft: list[float] = []
            direct_rate: list[float] = []
            gw_rate: list[float] = []
            for _ in range(rounds):
                ttft, rate = await batch(session, engine, n, tokens)
                direct_ttft += ttft
                direct_rate.append(rate)
                ttft, rate = await batch(session, gateway, n, tokens)
                gw_ttft += ttft
                gw_rate.append(rate)
            d50, d99 = pct(direct_ttft, 0.5) * 1e3, pct(direct_ttft, 0.99) * 1e3
            g50, g99 = pct(gw_ttft, 0.5) * 1e3, pct(gw_ttft, 0.99) * 1e3
            dr, gr = statistics.median(direct_rate), statistics.median(gw_rate)
            print(f"| {n} | {d50:.1f} / {d99:.1f} | {g50:.1f} / {g99:.1f} | "
                  f"{g50 - d50:+.1f} / {g99 - d99:+.1f} | {dr:.0f} | {gr:.0f} | "
                  f"{gr / dr:.2f}x |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 64, 512])
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--time-scale", type=float, default=0.05,
                        help="the sim engine's time scale (smaller: faster engine)")
    parser.add_argument("--profile", metavar="PATH",
                        help="profile the gateway's process (cProfile stats written to PATH)")
    parser.add_argument("--pin", action="store_true",
                        help="the gateway alone on the last core, engine and client on the "
                        "others (as on a node whose gateway has a core of its own)")
    parser.add_argument("--serve", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        engine_port, gateway_port, workdir = args.serve
        serve(int(engine_port), int(gateway_port), workdir, args.time_scale, args.profile,
              args.pin)
        return
    engine_port, gateway_port = free_ports(2)
    with tempfile.TemporaryDirectory() as workdir:
        proc = subprocess.Popen([sys.executable, __file__, "--time-scale", str(args.time_scale),
                                 *(["--profile", args.profile] if args.profile else []),
                                 *(["--pin"] if args.pin else []),
                                 "--serve", str(engine_port), str(gateway_port), workdir],
                                stdout=subprocess.PIPE, text=True)
        try:
            assert proc.stdout is not None
            ready = json.loads(proc.stdout.readline())
            if args.pin:
                os.sched_setaffinity(0, set(sorted(os.sched_getaffinity(0))[:-1]))
            print(f"sim engine {ready['engine']} (time scale {args.time_scale}), gateway on "
                  f"127.0.0.1:{gateway_port}, {args.tokens} tokens per stream, {args.rounds} "
                  f"rounds per level, " + (
                      "the gateway pinned to a core of its own, engine and client on the "
                      f"other {os.cpu_count() - 1}" if args.pin else
                      f"{os.cpu_count()} cores shared by client, gateway and engine"))
            asyncio.run(measure(ready["engine"], f"http://127.0.0.1:{gateway_port}",
                                args.concurrency, args.tokens, args.rounds))
        finally:
            proc.terminate()
            proc.wait(10)


if __name__ == "__main__":
    main()

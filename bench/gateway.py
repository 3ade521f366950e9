"""What the gateway adds to a stream: the same streaming requests sent directly to an engine
and through the gateway, interleaved in one run (issue 12's benchmark).

One sim engine (a real process under a real supervisor, in a process of its own) and one
gateway process per event loop asked for (`--loops`: asyncio and, when installed, uvloop),
each over that engine; this process is the client. For each concurrency level, rounds
alternate the same batch of requests direct and through each gateway. Prints, per path,
TTFT p50/p99, the TTFT added against direct, streamed tokens/s and its ratio to direct, and
the gateway process's CPU time per stream and per token (from /proc: robust to other load on
the machine, unlike the wall-clock columns). `--baseline DIR` adds a gateway per loop from
another checkout, in the same rounds: on a machine whose load changes from minute to minute,
a before/after comparison measured in two runs says little.

A round is a burst by default: all N requests sent at once, so TTFT includes the queue of N
request set-ups in one gateway process (about half a millisecond each). `--steady SECONDS`
runs a closed loop instead (N clients, each sending its next request when its last one
ended): N streams in flight with their starts spread, the steady state of a serving
benchmark's max-concurrency mode.

    .venv/bin/python bench/gateway.py [--concurrency 1 64 512] [--tokens 64] [--rounds 3]
                                      [--steady SECONDS] [--loops asyncio uvloop] [--pin]
                                      [--profile PATH] [--baseline DIR]
    git worktree add --detach /tmp/gw-before <commit>  # a baseline to compare against

Goal: <= 2 ms added TTFT p50, >= 0.95x direct tokens/s. Asserts nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import msgspec

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
if "--tree" in sys.argv:  # a gateway from another checkout (--baseline): its lumend, not ours
    sys.path.insert(0, sys.argv[sys.argv.index("--tree") + 1])


def uvloop_installed() -> bool:
    return importlib.util.find_spec("uvloop") is not None


def run_on(main: Coroutine[Any, Any, None], loop: str) -> None:
    """`main` on event loop `loop` (the bench's own choice, so a baseline checkout from
    before lumend chose its loop runs on the same ones)."""
    if loop == "uvloop":
        import uvloop

        factory: Callable[[], asyncio.AbstractEventLoop] = uvloop.new_event_loop
    else:
        factory = asyncio.new_event_loop
    with asyncio.Runner(loop_factory=factory) as runner:
        runner.run(main)


def serve_engine(engine_port: int, workdir: str, time_scale: float) -> None:
    """A supervisor with one sim engine; prints the worker's record once it serves."""
    from lumend.config import WorkerConfig
    from lumend.engine.adapter import SimAdapter
    from lumend.failover.supervisor import SupervisorTiming, WorkerSupervisor

    async def main() -> None:
        worker = WorkerConfig(name="w0", gpus=[0], engine="sim", shadows=0, model="sim-small",
                              port=engine_port, args=["--time-scale", str(time_scale)])
        sup = WorkerSupervisor("n", worker, SimAdapter(), runtime_dir=Path(workdir) / "run",
                               log_dir=Path(workdir) / "logs",
                               timing=SupervisorTiming(tick_s=0.05))
        stop = asyncio.Event()
        task = asyncio.create_task(sup.run(stop))
        while not (sup.worker_state() == "serving" and sup.ready()):
            await asyncio.sleep(0.05)
        engine = next(s for s in sup.slots if s.proc is not None).proc
        assert engine is not None
        print(json.dumps({"record": msgspec.json.encode(sup.record()).decode(),
                          "pid": engine.pid}), flush=True)
        await asyncio.Event().wait()
        await task

    asyncio.run(main())


def serve_gateway(gateway_port: int, record: str, loop: str, profile: str | None) -> None:
    """A gateway over the engine's worker record, on event loop `loop`."""
    if profile:  # the gateway's own time, for finding where a chunk's cost goes
        import cProfile
        import signal

        # CPU time, not wall time: on a shared machine a wall-clock profile charges the
        # waits for a core to whatever code was running when the gateway was descheduled.
        profiler = cProfile.Profile(time.thread_time)
        profiler.enable()

        def dump(*_: object) -> None:
            profiler.disable()
            profiler.dump_stats(profile)
            os._exit(0)

        signal.signal(signal.SIGTERM, dump)
    from lumend.cluster.models import WorkerRecord
    from lumend.cluster.view import ClusterView
    from lumend.gateway.server import Gateway

    worker = msgspec.json.decode(record, type=WorkerRecord)
    view = ClusterView(cluster="b", revision=0, workers={worker.name: worker})

    async def main() -> None:
        gateway = Gateway(lambda: view)
        await gateway.start(f"127.0.0.1:{gateway_port}")
        print(json.dumps({"loop": type(asyncio.get_running_loop()).__module__}), flush=True)
        await asyncio.Event().wait()

    run_on(main(), loop)


class _Choice(msgspec.Struct):
    text: str = ""


class _Chunk(msgspec.Struct):
    choices: list[_Choice] = []


# The client shares its cores with the engine (and, unpinned, the gateway): it decodes only
# the field it counts, so its own cost weighs as little as it can on the paths it compares.
_CHUNK = msgspec.json.Decoder(_Chunk)


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
            chunk = _CHUNK.decode(line[5:])
            if chunk.choices and chunk.choices[0].text:
                count += 1
                if first is None:
                    first = time.perf_counter()
    end = time.perf_counter()
    return (first or end) - start, end - start, count


async def batch(session: aiohttp.ClientSession, url: str, n: int,
                tokens: int) -> tuple[list[float], float, int]:
    """TTFTs, the batch's streamed tokens/s and its token count."""
    start = time.perf_counter()
    results = await asyncio.gather(*(one(session, url, f"request {i} of the benchmark says",
                                         tokens) for i in range(n)))
    wall = time.perf_counter() - start
    count = sum(r[2] for r in results)
    return [r[0] for r in results], count / wall, count


def cpu_s(pid: int) -> float:
    """CPU seconds a process's threads have run so far (the scheduler's count, in ns)."""
    total = 0
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{task}/schedstat") as f:
                total += int(f.read().split()[0])
        except (FileNotFoundError, ProcessLookupError):  # a thread that ended meanwhile
            continue
    return total / 1e9


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


@dataclass
class Path_:
    name: str
    url: str
    pid: int | None  # the gateway's process (None: direct)
    ttft: list[float] = field(default_factory=list)
    rate: list[float] = field(default_factory=list)
    cpu: float = 0.0
    streams: int = 0
    tokens: int = 0


async def steady(session: aiohttp.ClientSession, url: str, n: int, tokens: int,
                 seconds: float) -> tuple[list[float], float, int]:
    """`n` clients, each sending its next request as soon as its last one ended, for
    `seconds` (closed loop: `n` streams in flight, their starts spread as streams end, as
    in a serving benchmark's max-concurrency mode): TTFTs, streamed tokens/s, tokens."""
    ttfts: list[float] = []
    count = 0
    start = time.perf_counter()
    stop_at = start + seconds

    async def client(i: int) -> None:
        nonlocal count
        k = 0
        while time.perf_counter() < stop_at:
            ttft, _, got = await one(session, url, f"client {i} request {k} says", tokens)
            ttfts.append(ttft)
            count += got
            k += 1

    await asyncio.gather(*(client(i) for i in range(n)))
    return ttfts, count / (time.perf_counter() - start), count


async def measure(paths: list[Path_], levels: list[int], tokens: int, rounds: int,
                  steady_s: float = 0.0) -> None:
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector,
                                     timeout=aiohttp.ClientTimeout(total=600)) as session:
        for path in paths:  # warm every path
            await batch(session, path.url, 4, 8)
        print("| streams | path | TTFT p50 / p99 ms | added p50 / p99 ms | tok/s | ratio | "
              "gateway CPU ms/stream | gateway CPU us/token |")
        print("|---|---|---|---|---|---|---|---|")
        for n in levels:
            for path in paths:
                path.ttft, path.rate, path.cpu, path.streams, path.tokens = [], [], 0.0, 0, 0
            for r in range(rounds):
                # Each round in another order: a load that comes and goes on the machine
                # hits every path alike.
                for path in paths[r % len(paths):] + paths[:r % len(paths)]:
                    before = cpu_s(path.pid) if path.pid else 0.0
                    if steady_s:
                        ttft, rate, count = await steady(session, path.url, n, tokens,
                                                         steady_s)
                    else:
                        ttft, rate, count = await batch(session, path.url, n, tokens)
                    if path.pid:
                        path.cpu += cpu_s(path.pid) - before
                    path.ttft += ttft
                    path.rate.append(rate)
                    path.streams += len(ttft)
                    path.tokens += count
            direct = paths[0]
            d50, d99 = pct(direct.ttft, 0.5) * 1e3, pct(direct.ttft, 0.99) * 1e3
            dr = statistics.median(direct.rate)
            for path in paths:
                p50, p99 = pct(path.ttft, 0.5) * 1e3, pct(path.ttft, 0.99) * 1e3
                rate = statistics.median(path.rate)
                if path is direct:
                    print(f"| {n} | direct | {p50:.1f} / {p99:.1f} | | {rate:.0f} | | | |")
                    continue
                print(f"| {n} | {path.name} | {p50:.1f} / {p99:.1f} | "
                      f"{p50 - d50:+.1f} / {p99 - d99:+.1f} | {rate:.0f} | {rate / dr:.2f}x | "
                      f"{path.cpu / path.streams * 1e3:.2f} | "
                      f"{path.cpu / max(1, path.tokens) * 1e6:.0f} |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 64, 512])
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steady", type=float, default=0.0, metavar="SECONDS",
                        help="closed loop: each of the N clients sends its next request as "
                        "soon as its last one ended, for SECONDS per round (N streams in "
                        "flight, starts spread as streams end); default: bursts, all N "
                        "requests of a round sent at once")
    parser.add_argument("--time-scale", type=float, default=0.05,
                        help="the sim engine's time scale (smaller: faster engine)")
    parser.add_argument("--loops", nargs="+", choices=("asyncio", "uvloop"),
                        default=["asyncio", "uvloop"] if uvloop_installed()
                        else ["asyncio"],
                        help="a gateway process per event loop, measured side by side")
    parser.add_argument("--profile", metavar="PATH",
                        help="profile the gateway processes (cProfile stats written to "
                        "PATH.<loop>)")
    parser.add_argument("--pin", action="store_true",
                        help="the gateways alone on the last core, engine and client on the "
                        "others (as on a node whose gateway has a core of its own)")
    parser.add_argument("--baseline", metavar="DIR",
                        help="also a gateway per loop from the checkout in DIR (say, a git "
                        "worktree of an older commit), measured in the same rounds")
    parser.add_argument("--tree", help=argparse.SUPPRESS)
    parser.add_argument("--serve-engine", nargs=2, help=argparse.SUPPRESS)
    parser.add_argument("--serve-gateway", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve_engine:
        serve_engine(int(args.serve_engine[0]), args.serve_engine[1], args.time_scale)
        return
    if args.serve_gateway:
        port, record, loop = args.serve_gateway
        serve_gateway(int(port), record, loop, args.profile)
        return
    from lumenctl.localcluster import free_ports

    cores = sorted(os.sched_getaffinity(0))
    trees: list[tuple[str, str | None]] = [("gateway", None)]
    if args.baseline:
        trees.insert(0, ("baseline", str(Path(args.baseline).resolve())))
    gateways = [(name, tree, loop) for name, tree in trees for loop in args.loops]
    ports = free_ports(1 + len(gateways))
    procs: list[subprocess.Popen[str]] = []
    with tempfile.TemporaryDirectory() as workdir:
        try:
            engine = subprocess.Popen([sys.executable, __file__, "--time-scale",
                                       str(args.time_scale), "--serve-engine", str(ports[0]),
                                       workdir], stdout=subprocess.PIPE, text=True)
            procs.append(engine)
            assert engine.stdout is not None
            ready = json.loads(engine.stdout.readline())
            record = ready["record"]
            url = json.loads(record)["engines"][0]["url"]
            paths = [Path_("direct", url, None)]
            for (name, tree, loop), port in zip(gateways, ports[1:], strict=True):
                profile = (["--profile", f"{args.profile}.{name}.{loop}"] if args.profile
                           else [])
                gw = subprocess.Popen([sys.executable, __file__, *profile,
                                       *(["--tree", tree] if tree else []), "--serve-gateway",
                                       str(port), record, loop], stdout=subprocess.PIPE,
                                      text=True)
                procs.append(gw)
                assert gw.stdout is not None
                json.loads(gw.stdout.readline())
                paths.append(Path_(f"{name} {loop}", f"http://127.0.0.1:{port}", gw.pid))
                if args.pin:
                    os.sched_setaffinity(gw.pid, {cores[-1]})
            if args.pin:  # the gateways on the last core; engine and client on the others
                os.sched_setaffinity(ready["pid"], set(cores[:-1]))
                os.sched_setaffinity(0, set(cores[:-1]))
            print(f"sim engine {url} (time scale {args.time_scale}); gateways on event loops "
                  f"{', '.join(args.loops)}" + (f", and from {args.baseline} (baseline)"
                                               if args.baseline else "") +
                  f"; {args.tokens} tokens per stream, {args.rounds} "
                  f"rounds per level, " + (
                      f"closed loop for {args.steady:g} s a round" if args.steady else
                      "each a burst (all streams sent at once)") + "; " + (
                      "the gateways pinned to a core of their own, engine and client on the "
                      f"other {len(cores) - 1}" if args.pin else
                      f"{len(cores)} cores shared by client, gateways and engine"), flush=True)
            asyncio.run(measure(paths, args.concurrency, args.tokens, args.rounds,
                                args.steady))
        finally:
            for proc in reversed(procs):
                proc.terminate()
                proc.wait(10)


if __name__ == "__main__":
    main()

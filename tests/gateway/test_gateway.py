"""The gateway in front of real sim engines under real supervisors: streams survive the loss
of the engine serving them, token for token."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from lumenctl.localcluster import free_port_run, free_ports
from lumend.cluster.view import ClusterView
from lumend.config import WorkerConfig
from lumend.engine.adapter import SimAdapter
from lumend.engine.sim_core import decode, encode, reference_completion
from lumend.failover.supervisor import SupervisorTiming, WorkerSupervisor
from lumend.gateway.server import Gateway, GatewayTiming

from ..streamread import read_stream

MAX_TOKENS = 120


def chat_prompt(text: str) -> str:
    return f"user: {text}\nassistant: "


def expected(prompt: str) -> str:
    return decode(reference_completion(0, encode(prompt), MAX_TOKENS))


@asynccontextmanager
async def cluster(tmp_path: Path, shadows: int, args: tuple[str, ...] = ("--time-scale", "2.0"),
                  workers: int = 2, timing: GatewayTiming | None = None
                  ) -> AsyncIterator[tuple[Gateway, str, list[WorkerSupervisor]]]:
    """Sim workers under real supervisors and a gateway over them; the default time scale
    is slow enough to kill an engine mid-stream."""
    sups = []
    for i in range(workers):
        worker = WorkerConfig(name=f"w{i}", gpus=[i], engine="sim", shadows=shadows,
                              model="sim-small", port=free_port_run(shadows + 1), args=list(args))
        sups.append(WorkerSupervisor("n", worker, SimAdapter(), runtime_dir=tmp_path / "run",
                                     log_dir=tmp_path / "logs",
                                     timing=SupervisorTiming(tick_s=0.05)))

    def view() -> ClusterView:
        return ClusterView(cluster="t", revision=0, workers={s.worker.name: s.record()
                                                             for s in sups})

    stop = asyncio.Event()
    tasks = [asyncio.create_task(s.run(stop)) for s in sups]
    gateway = Gateway(view, timing)
    listen = f"127.0.0.1:{free_ports(1)[0]}"
    await gateway.start(listen)
    try:
        deadline = time.monotonic() + 60
        while not all(s.worker_state() == "serving" and s.ready()
                      and sum(x.state == "standby" for x in s.slots) == shadows for s in sups):
            assert time.monotonic() < deadline, "workers did not come up"
            await asyncio.sleep(0.05)
        yield gateway, f"http://{listen}", sups
    finally:
        await gateway.stop()
        stop.set()
        await asyncio.gather(*tasks)


async def stream(session: aiohttp.ClientSession, base: str, chat: bool,
                 text: str, received: list[int] | None = None) -> tuple[set[str], str, list[str]]:
    """(ids seen, text received, errors) of one streamed completion; `received` counts the
    pieces as they arrive."""
    body: dict[str, Any] = {"max_tokens": MAX_TOKENS, "stream": True}
    if chat:
        body["messages"] = [{"role": "user", "content": text}]
    else:
        body["prompt"] = text
    async with session.post(base + ("/v1/chat/completions" if chat else "/v1/completions"),
                            json=body) as r:
        assert r.status == 200
        return await read_stream(r, chat, received)


class Streams:
    """Eight concurrent streams through a gateway (even: completions, odd: chat)."""

    def __init__(self, prompts: list[str], received: list[list[int]],
                 tasks: list[asyncio.Task[tuple[set[str], str, list[str]]]]) -> None:
        self.prompts, self.received, self.tasks = prompts, received, tasks

    @classmethod
    async def start(cls, session: aiohttp.ClientSession, base: str, pattern: str) -> Streams:
        """Start them and return once every one has received 10 pieces (so a kill now
        interrupts them mid-stream)."""
        prompts = [pattern.format(i) for i in range(8)]
        received = [[0] for _ in prompts]
        tasks = [asyncio.create_task(stream(session, base, i % 2 == 1, p, received[i]))
                 for i, p in enumerate(prompts)]
        deadline = time.monotonic() + 30
        while min(r[0] for r in received) < 10:
            assert time.monotonic() < deadline, "the streams never got going"
            await asyncio.sleep(0.01)
        return cls(prompts, received, tasks)

    async def check_against_failure_free(self) -> None:
        """Every stream completes, under one id, equal to the failure-free stream."""
        results = await asyncio.gather(*self.tasks)
        for i, (prompt, (ids, text, errors)) in enumerate(zip(self.prompts, results,
                                                               strict=True)):
            assert errors == []
            assert len(ids) == 1, "one id for the whole stream"
            reference = expected(chat_prompt(prompt) if i % 2 == 1 else prompt)
            assert text == reference, f"request {i} differs from the failure-free stream"


def busiest(sups: list[WorkerSupervisor]) -> WorkerSupervisor:
    return max(sups, key=lambda s: s.load.running)


@pytest.mark.parametrize("shadows", [0, 1], ids=["no-shadow", "shadow"])
def test_streams_survive_the_loss_of_their_engine(tmp_path: Path, shadows: int) -> None:
    async def scenario() -> None:
        async with cluster(tmp_path, shadows) as (gateway, base, sups), \
                aiohttp.ClientSession() as session:
            streams = await Streams.start(session, base, "request number {} says hello")
            victim = next(s for s in busiest(sups).slots if s.state == "active")
            assert victim.proc is not None
            os.kill(victim.proc.pid, signal.SIGKILL)
            await streams.check_against_failure_free()
            assert gateway.counters.resumes >= 1, "no stream was interrupted: the test is void"
            # Latency histograms: every stream had a first token and a token rate; every
            # interrupted one a recovery (break -> next token out).
            latency = gateway.latency
            served = gateway.counters.requests["ok"] + gateway.counters.requests["resumed"]
            assert latency.ttft.count == latency.tpot.count == served
            assert 1 <= latency.recovery.count <= gateway.counters.resumes
            assert latency.recovery.cumulative()[-1] == ("+Inf", float(latency.recovery.count))

    asyncio.run(scenario())


def test_bad_requests_get_openai_errors(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with cluster(tmp_path, 0) as (_, base, _sups), aiohttp.ClientSession() as s:
            cases = [
                ("/v1/completions", {"max_tokens": 4}, 400, "prompt"),
                ("/v1/completions", {"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
                ("/v1/chat/completions", {"messages": "hi"}, 400, "messages"),
                ("/v1/completions", {"prompt": "x", "model": "gpt-9"}, 404, "model"),
            ]
            for path, body, status, param in cases:
                async with s.post(base + path, json=body) as r:
                    assert r.status == status
                    error = (await r.json())["error"]
                    assert error["param"] == param and error["message"]
            async with s.post(base + "/v1/completions", data=b"{nope") as r:
                assert r.status == 400
            async with s.post(base + "/v1/completions",
                              json={"prompt": "hello", "max_tokens": 5}) as r:
                body = await r.json()
                assert body["choices"][0]["text"] == decode(
                    reference_completion(0, encode("hello"), 5))
            async with s.get(base + "/v1/models") as r:
                assert [m["id"] for m in (await r.json())["data"]] == ["sim-small"]

    asyncio.run(scenario())


def test_admissions_are_logged_when_asked_and_name_the_request_the_client_saw(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """`[gateway] log_admissions` (live on reload): one line per placement, naming the id the
    client's response carries and the worker that served it; none while it is off."""
    async def scenario() -> None:
        async with cluster(tmp_path, 0) as (gateway, base, sups), aiohttp.ClientSession() as s:
            async def one() -> str:
                async with s.post(base + "/v1/completions",
                                  json={"prompt": "hello", "max_tokens": 3}) as r:
                    assert r.status == 200
                    return str((await r.json())["id"])

            caplog.set_level(logging.INFO, logger="lumend.gateway")
            unlogged = await one()
            gateway.log_admissions = True
            logged = [await one() for _ in range(3)]
            gateway.log_admissions = False
            await one()
            lines = [r.getMessage() for r in caplog.records
                     if r.getMessage().startswith("admission:")]
            assert len(lines) == 3, lines
            workers = {s.worker.name for s in sups}
            for rid, line in zip(logged, lines, strict=True):
                assert line.startswith(f"admission: request {rid} to "), line
                assert line.split(" to ")[1].split(",")[0] in workers, line
                assert line.endswith("(this gateway's own view)"), line
            assert not any(unlogged in line for line in lines)

    asyncio.run(scenario())


def test_a_client_that_leaves_cancels_the_upstream(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with cluster(tmp_path, 0) as (_, base, sups), aiohttp.ClientSession() as s:
            body = {"prompt": "a long answer please", "max_tokens": 2000, "stream": True}
            async with s.post(base + "/v1/completions", json=body) as r:
                async for _ in r.content:
                    break  # one chunk, then the client goes away
            # The engine stops generating: nothing left running on any engine.
            deadline = time.monotonic() + 10
            while True:
                running = 0
                for sup in sups:
                    engine = next(x for x in sup.slots if x.state == "active")
                    async with s.get(engine.spec.url + "/lumen/engine") as r:
                        running += (await r.json())["running"]
                if running == 0:
                    break
                assert time.monotonic() < deadline, "an engine kept generating for nobody"
                await asyncio.sleep(0.05)

    asyncio.run(scenario())


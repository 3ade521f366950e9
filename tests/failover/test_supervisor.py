"""A worker supervisor with real sim engines, a real GMS server and the real failover lock."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import subprocess
import time
from collections.abc import AsyncIterator, Callable, Coroutine
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from lumenctl.localcluster import free_port_run, free_ports
from lumend.config import WorkerConfig
from lumend.engine.adapter import EngineLoad, EngineSpec, SimAdapter, VllmAdapter
from lumend.engine.sim_core import decode, encode, reference_completion
from lumend.engine.vllm_version import vllm_problem
from lumend.failover.supervisor import EngineSlot, SupervisorTiming, WorkerSupervisor
from lumend.gms.client import GmsClient

PROMPT = "the quick brown fox"


def make_supervisor(tmp_path: Path, shadows: int = 1,
                    cls: type[WorkerSupervisor] = WorkerSupervisor,
                    adapter: SimAdapter | None = None) -> WorkerSupervisor:
    # Consecutive ports, all free, below the ephemeral range (the shadow's is port + 1; a
    # port there can be taken by any outgoing connection meanwhile: CI once saw the
    # shadow fail to bind, "address already in use", until the test gave up).
    port = free_port_run(shadows + 1)
    worker = WorkerConfig(name="w0", gpus=[0], engine="sim", shadows=shadows,
                          model="sim-small", port=port)
    return cls(
        "node-1", worker, adapter or SimAdapter(), runtime_dir=tmp_path / "run",
        log_dir=tmp_path / "logs",
        timing=SupervisorTiming(tick_s=0.05, probe_deadline_s=0.5, hung_after_failures=3),
        time_scale=0.2,
    )


@asynccontextmanager
async def running(sup: WorkerSupervisor) -> AsyncIterator[aiohttp.ClientSession]:
    stop = asyncio.Event()
    task = asyncio.create_task(sup.run(stop))
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session:
            yield session
    finally:
        stop.set()
        await task


async def wait_for(check: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.02)


def slot_in(sup: WorkerSupervisor, state: str) -> EngineSlot | None:
    return next((s for s in sup.slots if s.state == state), None)


def live_pids(sup: WorkerSupervisor, *states: str) -> set[int]:
    return {s.proc.pid for s in sup.slots if s.state in states and s.proc is not None}


async def complete(session: aiohttp.ClientSession, sup: WorkerSupervisor) -> str | None:
    """One completion on the worker: try each engine; standbys refuse at once (503)."""
    for slot in sup.slots:
        try:
            async with session.post(slot.spec.url + "/v1/completions",
                                    json={"prompt": PROMPT, "max_tokens": 12}) as r:
                if r.status == 200:
                    return str((await r.json())["choices"][0]["text"])
        except aiohttp.ClientConnectionError:
            continue
    return None


async def engine_info(session: aiohttp.ClientSession, slot: EngineSlot) -> dict[str, Any]:
    async with session.get(slot.spec.url + "/lumen/engine") as r:
        return dict(await r.json())


async def digest(session: aiohttp.ClientSession, slot: EngineSlot) -> str:
    async with session.get(slot.spec.url + "/lumen/weights_digest") as r:
        return str((await r.json())["digest"])


def run(coro: Coroutine[Any, Any, None]) -> None:
    asyncio.run(coro)


def test_twenty_sigkills_the_shadow_serves_and_weights_are_never_reloaded(
    tmp_path: Path,
) -> None:
    expected = decode(reference_completion(0, encode(PROMPT), 12))

    async def scenario() -> None:
        sup = make_supervisor(tmp_path)
        async with running(sup) as session:
            await wait_for(lambda: slot_in(sup, "active") is not None
                           and slot_in(sup, "standby") is not None, 30, "active + standby")
            first = slot_in(sup, "active")
            assert first is not None
            original_digest = await digest(session, first)
            for kill in range(20):
                active, shadow = slot_in(sup, "active"), slot_in(sup, "standby")
                assert active is not None and active.proc is not None and shadow is not None
                victim_pid = active.proc.pid
                os.kill(victim_pid, signal.SIGKILL)
                # Requests during the switch either succeed or fail fast; none hangs
                # (the session's 10 s timeout would raise).
                text = None
                while text is None:
                    text = await complete(session, sup)
                assert text == expected, f"kill {kill}: the shadow answered differently"
                await wait_for(lambda v=victim_pid: bool(live_pids(sup, "active"))  # type: ignore[misc]
                               and v not in live_pids(sup, "active", "standby")
                               and slot_in(sup, "standby") is not None, 30,
                               f"a new active and a new shadow after kill {kill}")
                restarted = slot_in(sup, "standby")
                assert restarted is not None
                info = await engine_info(session, restarted)
                assert info["weights_source"] == "gms", "a restarted engine loaded from disk"
            assert await digest(session, slot_in(sup, "active")) == original_digest  # type: ignore[arg-type]
            assert sup.counters.failovers == 20
            assert len(sup.counters.failover_seconds) == 20
            with GmsClient(sup.gms_socket) as gms:  # type: ignore[arg-type]
                stats = gms.stats()
            assert stats["commits"] == 1, "the weights were loaded more than once"
            assert stats["writer_sessions"] == 1
            record = sup.record()
            assert record.state == "serving"
            assert sorted(e.state for e in record.engines) == ["active", "standby"]
            assert all(e.pid is not None and e.url.startswith("http://") for e in record.engines)

    run(scenario())


class LoadAsked(SimAdapter):
    """The sim adapter, recording which engine URL each load scrape went to."""

    def __init__(self) -> None:
        self.asked: list[str] = []

    async def load(self, session: aiohttp.ClientSession, spec: EngineSpec) -> EngineLoad:
        self.asked.append(spec.url)
        return await super().load(session, spec)


def test_a_hung_active_engine_is_killed_and_the_shadow_takes_over(tmp_path: Path) -> None:
    async def scenario() -> None:
        adapter = LoadAsked()
        sup = make_supervisor(tmp_path, adapter=adapter)
        async with running(sup) as session:
            await wait_for(lambda: slot_in(sup, "active") is not None
                           and slot_in(sup, "standby") is not None, 30, "active + standby")
            active = slot_in(sup, "active")
            assert active is not None and active.proc is not None
            hung_pid, hung_url = active.proc.pid, active.spec.url
            asked_before = len(adapter.asked)
            assert sup.record().stalled == ""
            os.kill(hung_pid, signal.SIGSTOP)  # alive, holding the lock, answering nothing
            # Stalled from its first missed probe (new requests go elsewhere meanwhile),
            # seconds before the kill.
            await wait_for(lambda: sup.record().stalled != "", 10, "the worker stalled")
            assert "missed 1 probe(s)" in sup.record().stalled, sup.record().stalled
            assert sup.counters.hung_kills == 0
            await wait_for(lambda: (s := slot_in(sup, "active")) is not None
                           and s.proc is not None and s.proc.pid != hung_pid, 30,
                           "the shadow to take over from the hung engine")
            assert sup.counters.hung_kills == 1
            await wait_for(lambda: sup.record().stalled == "", 10, "the shadow answering")
            # Its load is not scraped once it missed a probe: each scrape would wait out a
            # second deadline per tick and double the time to the kill. (A tick already
            # past its probe when the signal came may still ask once.)
            scraped_hung = adapter.asked[asked_before:].count(hung_url)
            assert scraped_hung <= 1, (
                f"the hung engine's load was scraped {scraped_hung} times after it stopped "
                f"answering (hung_after_failures = {sup.timing.hung_after_failures})")
            assert await complete(session, sup) is not None
            # The killed engine is gone for good, not merely stopped.
            try:
                os.kill(hung_pid, 0)
                still_there = True
            except ProcessLookupError:
                still_there = False
            assert not still_there

    run(scenario())


def test_an_engine_that_exited_is_not_called_stalled(tmp_path: Path) -> None:
    """A killed engine's last probe fails (connection refused) a tick before its exit is
    seen; that is an exit, handled as one, not a stall to log and export."""
    sup = make_supervisor(tmp_path, shadows=0)
    slot = sup.slots[0]
    slot.probe_failures = 1
    slot.proc = subprocess.Popen(["true"])
    slot.proc.wait()
    sup._note_stalled(slot)
    assert sup.stalled == ""
    # Negative control: the same missed probe from a process still running is a stall.
    slot.proc = subprocess.Popen(["sleep", "30"])
    try:
        sup._note_stalled(slot)
        assert "missed 1 probe(s)" in sup.stalled, sup.stalled
    finally:
        slot.proc.kill()
        slot.proc.wait()


def test_gms_death_is_survived(tmp_path: Path) -> None:
    async def scenario() -> None:
        sup = make_supervisor(tmp_path)
        async with running(sup) as session:
            await wait_for(lambda: slot_in(sup, "active") is not None
                           and slot_in(sup, "standby") is not None, 30, "active + standby")
            assert sup.gms_proc is not None
            sup.gms_proc.send_signal(signal.SIGKILL)
            await wait_for(lambda: sup.counters.gms_restarts == 1, 10, "a new GMS server")
            assert await complete(session, sup) is not None, "engines stopped serving"
            # A failover now: the restarted engine finds an empty GMS and reloads it.
            active = slot_in(sup, "active")
            assert active is not None and active.proc is not None
            victim = active.proc.pid
            os.kill(victim, signal.SIGKILL)
            await wait_for(lambda: len(live_pids(sup, "standby", "active")) == 2
                           and victim not in live_pids(sup, "standby", "active"), 30,
                           "an active engine and a new shadow after GMS loss")
            with GmsClient(sup.gms_socket) as gms:  # type: ignore[arg-type]
                assert gms.stats()["commits"] == 1

    run(scenario())


def test_an_engine_that_never_starts_backs_off_and_the_worker_is_failed(
    tmp_path: Path, caplog: pytest.LogCaptureFixture,
) -> None:
    sup = make_supervisor(tmp_path)
    # A model the sim engine does not know: every start exits at once with a clear error.
    bad = WorkerConfig(name="w0", gpus=[0], engine="sim", shadows=1, model="sim-small",
                       args=["--model", "no-such-model"], port=sup.worker.port)
    sup = WorkerSupervisor("node-1", bad, SimAdapter(), runtime_dir=tmp_path / "run",
                           log_dir=tmp_path / "logs",
                           timing=SupervisorTiming(tick_s=0.05, backoff_first_s=0.1,
                                                   backoff_max_s=0.4))

    async def scenario() -> None:
        async with running(sup):
            await wait_for(lambda: sup.worker_state() == "failed", 60,
                           "the worker to be marked failed")
            assert all(s.failed_starts >= 3 for s in sup.slots)
            assert all(s.backoff_s > 0 for s in sup.slots), "no backoff between crashes"
            assert not sup.ready()
        log = (tmp_path / "logs" / "w0.0.log").read_text()
        assert "unknown sim model 'no-such-model'" in log

    with caplog.at_level(logging.WARNING, logger="lumend.failover"):
        run(scenario())
    # lumend's own log says why, not only the engine's
    assert "engine w0/0 exited with 2 while starting: sim_server.py: error: unknown sim " \
        "model 'no-such-model'" in caplog.text


class EveryStartAtOnce(WorkerSupervisor):
    """The negative control: a supervisor that starts every engine as soon as it can."""

    def _may_start(self, slot: EngineSlot) -> bool:
        return True


def most_starting_at_once(sup: WorkerSupervisor) -> int:
    """Run the worker until every engine is ready; the most engines seen starting at once
    (alive, not yet ready), sampled between the supervisor's own steps."""
    worst = 0

    async def scenario() -> None:
        nonlocal worst
        async with running(sup):
            deadline = time.monotonic() + 60
            while not all(s.became_ready for s in sup.slots):
                worst = max(worst, sum(1 for s in sup.slots if s.alive and not s.became_ready))
                assert time.monotonic() < deadline, [s.state for s in sup.slots]
                await asyncio.sleep(0.005)

    run(scenario())
    return worst


def test_engines_of_a_worker_start_one_at_a_time(tmp_path: Path) -> None:
    assert most_starting_at_once(make_supervisor(tmp_path / "one", shadows=2)) == 1
    control = make_supervisor(tmp_path / "all", shadows=2, cls=EveryStartAtOnce)
    assert most_starting_at_once(control) > 1, "the check cannot see engines start together"


def test_a_vllm_outside_the_supported_range_is_refused(
    tmp_path: Path, caplog: pytest.LogCaptureFixture,
) -> None:
    class InstalledIsTooNew(VllmAdapter):
        def unsupported(self) -> str | None:
            return vllm_problem(("vllm", "0.34.0"))

    worker = WorkerConfig(name="v0", gpus=[0], engine="vllm", shadows=1, model="/m",
                          port=free_ports(1)[0])
    sup = WorkerSupervisor("node-1", worker, InstalledIsTooNew(cuda=False),
                           runtime_dir=tmp_path / "run", log_dir=tmp_path / "logs",
                           timing=SupervisorTiming(tick_s=0.05))

    async def scenario() -> None:
        async with running(sup):
            await wait_for(lambda: sup.refused is not None, 10, "the refusal")
            await asyncio.sleep(0.3)  # several ticks: still nothing may start
            assert all(s.proc is None and s.restarts == 0 for s in sup.slots)
            assert sup.worker_state() == "failed"

    with caplog.at_level(logging.ERROR, logger="lumend.failover"):
        run(scenario())
    assert "worker v0 cannot start its vllm engines: vllm 0.34.0 is installed, but LUMEN " \
        "supports vLLM >=0.32,<0.34" in caplog.text


def test_a_gms_server_that_cannot_run_backs_off_and_lumend_says_why(
    tmp_path: Path, caplog: pytest.LogCaptureFixture,
) -> None:
    # A runtime directory whose socket path AF_UNIX cannot bind: every GMS start fails.
    runtime = tmp_path / ("r" * 110)
    worker = WorkerConfig(name="w0", gpus=[0], engine="sim", shadows=0, model="sim-small",
                          port=free_ports(1)[0])
    sup = WorkerSupervisor("node-1", worker, SimAdapter(), runtime_dir=runtime,
                           log_dir=tmp_path / "logs",
                           timing=SupervisorTiming(tick_s=0.02, backoff_first_s=0.1,
                                                   backoff_max_s=0.4))
    backoffs: list[float] = []

    async def scenario() -> None:
        async with running(sup):
            deadline = time.monotonic() + 60
            while len(backoffs) < 4:
                if sup.counters.gms_restarts > len(backoffs):
                    backoffs.append(sup._gms_backoff_s)
                assert time.monotonic() < deadline, f"GMS restarts: {backoffs}"
                await asyncio.sleep(0.005)

    with caplog.at_level(logging.WARNING, logger="lumend.failover"):
        run(scenario())
    assert backoffs == [0.1, 0.2, 0.4, 0.4], "a GMS server that cannot run is restarted at once"
    assert "GMS server of w0 exited (1: OSError: AF_UNIX path too long); restarting it in " \
        "0.1 s" in caplog.text

"""The worker supervisor: one GMS server and 1 + shadows engines per worker, kept alive.

Each tick it probes every engine (with a deadline), restarts what died (a restarted engine
finds the failover lock taken and becomes a shadow), SIGKILLs what hangs, and restarts the
GMS server if it dies (engines keep serving from their mappings; the next engine to start
loads the weights into the new server). It decides from what it observes this tick and
publishes the worker's record for the node's heartbeat.

Engines start one at a time: the next once every other engine of the worker is ready (or
gone), and not while a shadow is taking over. vLLM sizes its memory from what is free while
it loads and profiles; a second engine starting meanwhile, or a shadow waking, changes that.
The moment an engine's process exits, its whole process group is killed (a pidfd wakes the
supervisor): vLLM's engine core and workers hold its GPU memory until they die, and the
shadow that takes over needs that memory for its KV cache.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

from lumend.assist.processes import draft_command
from lumend.checkpoint.security import ENV_VAR as CKPT_KEYS_ENV
from lumend.cluster.models import EngineInfo, WorkerRecord, WorkerState
from lumend.config import VLLM_DEFAULT_UTILIZATION, WorkerConfig, computes_memory_split
from lumend.engine.adapter import EngineAdapter, EngineLoad, EngineSpec
from lumend.engine.vllm_memory import (
    default_kv_cache_bytes,
    describe_kv_choice,
    gpu_total_bytes,
    memory_utilization,
    weights_on_disk,
)
from lumend.failover.lifeline import kill_group, reap_orphans, supervisor_env

log = logging.getLogger("lumend.failover")

# Below this free on the engines' log dir (lumend's state_dir/logs) what they write is lost:
# their startup, their errors, the reason they exit (which lumend's own log quotes).
LOG_DISK_FULL_BYTES = 1 << 20


@dataclass(frozen=True)
class SupervisorTiming:
    tick_s: float = 0.1
    # A live engine that has not answered hung_after_failures probes in a row, one a tick,
    # each given probe_deadline_s, is hung: killed about hung_after_failures x
    # (probe_deadline_s + tick_s) after it stopped answering; generous enough that a busy
    # CPU does not get a healthy engine killed.
    probe_deadline_s: float = 2.0
    hung_after_failures: int = 3  # consecutive probe failures of a live process
    start_timeout_s: float = 600.0  # an engine not past initialising by then is killed
    backoff_first_s: float = 0.5
    backoff_max_s: float = 30.0
    failed_after_starts: int = 3  # a worker whose every engine failed this often is failed
    # An engine (or GMS server) that exits with an error sooner than this after it was
    # ready is failing too (a wake that cannot get memory, weights that changed): back off.
    stable_s: float = 60.0
    takeover_wait_s: float = 120.0  # engines wait this long for a shadow to take over
    stop_grace_s: float = 10.0
    # A worker whose active engine missed a probe, or whose engine core has left a question
    # unanswered this long (vLLM: LUMEN_CORE_HANG_S kills it later), is stalled: admitted
    # to only when no other worker can take a request. A busy CPU engine's step can take
    # seconds; being passed over for a few seconds costs it little.
    stalled_after_s: float = 5.0

    @property
    def hung_kill_after_s(self) -> float:
        """Expected seconds from an engine's last answer to its kill as hung: the next
        tick's probe starts within a tick (half of one on average), then
        hung_after_failures probes each wait out the deadline, a tick apart."""
        failures = self.hung_after_failures
        return failures * self.probe_deadline_s + (failures - 1) * self.tick_s + self.tick_s / 2


@dataclass
class EngineSlot:
    spec: EngineSpec
    log_path: Path
    proc: subprocess.Popen[bytes] | None = None
    state: str = "stopped"  # stopped | starting | initialising | standby | active | releasing
    started_at: float = 0.0
    probe_failures: int = 0
    became_ready: bool = False  # reached standby or active since it was started
    ready_at: float = 0.0
    failed_starts: int = 0  # consecutive runs that died before becoming ready
    restarts: int = 0
    backoff_s: float = 0.0
    restart_at: float = 0.0
    exit_watch: int | None = None  # a pidfd of proc, readable once it has exited

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


@dataclass
class FailoverRecord:
    engine_id: str
    reason: str
    detected_at: float
    completed_at: float | None = None

    @property
    def seconds(self) -> float | None:
        return None if self.completed_at is None else self.completed_at - self.detected_at


@dataclass
class WorkerCounters:
    failovers: int = 0
    engine_restarts: int = 0
    hung_kills: int = 0
    gms_restarts: int = 0
    failover_seconds: list[float] = field(default_factory=list)


class WorkerSupervisor:
    def __init__(
        self,
        node: str,
        worker: WorkerConfig,
        adapter: EngineAdapter,
        *,
        runtime_dir: Path,
        log_dir: Path,
        host: str = "127.0.0.1",
        timing: SupervisorTiming | None = None,
        use_gms: bool = True,
        time_scale: float = 1.0,
        on_failover: Callable[[FailoverRecord], None] | None = None,
        checkpoint_keys: str | None = None,
    ) -> None:
        """`checkpoint_keys`: the cluster's CURVE key file, passed to every engine as
        LUMEN_CKPT_KEYS (None: engines stream checkpoints without CURVE)."""
        self.node = node
        self.worker = worker
        self.adapter = adapter
        self.timing = timing or SupervisorTiming()
        self.dir = runtime_dir / worker.name
        self.log_dir = log_dir
        self.gms_socket = (self.dir / "gms.sock"
                           if use_gms and adapter.uses_gms and _gms_fits(adapter, worker)
                           else None)
        self.counters = WorkerCounters()
        self.on_failover = on_failover
        self.checkpoint_keys = checkpoint_keys
        self.load = EngineLoad(0, 0, 0.0)
        self.stalled = ""  # why the active engine is taken as stalled (_note_stalled)
        self.gms_proc: subprocess.Popen[bytes] | None = None
        self.pending_failover: FailoverRecord | None = None
        self.ever_active = False
        self.time_scale = time_scale
        self.host = host
        # Draft-assist: the draft server runs while no engine serves or stands by.
        self.draft_proc: subprocess.Popen[bytes] | None = None
        self.draft_endpoint = ""
        self.draft_starts = 0
        self._draft_restart_at = 0.0
        self.slots = [
            EngineSlot(
                spec=EngineSpec(
                    engine_id=f"{worker.name}/{i}", host=host, port=worker.port + i,
                    model=worker.model, args=tuple(worker.args),
                    gms_socket=str(self.gms_socket) if self.gms_socket else None,
                    failover_lock=str(self.dir / "failover.lock"), time_scale=time_scale,
                    gpus=tuple(worker.gpus), assist=worker.assist,
                    kv_cache_bytes=worker.kv_cache_bytes,
                ),
                log_path=log_dir / f"{worker.name}.{i}.log",
            )
            for i in range(1 + worker.shadows)
        ]
        self._started = time.monotonic()
        # Why engines of this kind cannot run here (a vLLM outside the supported range):
        # then the worker is failed and nothing is started.
        self.refused: str | None = None
        self._gpu_total: int | None = None
        self._gms_started = self._gms_restart_at = self._gms_backoff_s = 0.0
        self._waiting_logged: str | None = None
        # Bytes free where the engines' logs go (read each second; None: unreadable).
        self.log_dir_free: int | None = None
        self._log_disk_at = 0.0
        self._log_disk_full = False

    # -- the loop -------------------------------------------------------------------------

    async def run(self, stop: asyncio.Event) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        await asyncio.to_thread(reap_orphans, self.dir)
        self.refused = await asyncio.to_thread(self.adapter.unsupported)
        if self.refused is not None:
            log.error("worker %s cannot start its %s engines: %s", self.worker.name,
                      self.adapter.kind, self.refused)
            await stop.wait()
            return
        if self.adapter.gms_backend == "cuda":
            await asyncio.to_thread(self.plan_memory)
        timeout = aiohttp.ClientTimeout(total=self.timing.probe_deadline_s)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            try:
                while not stop.is_set():
                    await self.tick(session)
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(stop.wait(), self.timing.tick_s)
            finally:
                await asyncio.to_thread(self.stop_all)

    async def tick(self, session: aiohttp.ClientSession) -> None:
        now = time.monotonic()
        self._watch_log_disk(now)
        self._keep_gms()
        for slot in self.slots:
            if slot.proc is not None and not slot.alive:
                self._engine_died(slot, now)
        for slot in self.slots:
            if slot.proc is None and now >= slot.restart_at and self._may_start(slot):
                self._start_engine(slot, now)
        await asyncio.gather(*(self._probe(session, s, now) for s in self.slots if s.alive))
        self._keep_draft(now)
        active = [s for s in self.slots if s.state == "active"]
        if active:
            self.ever_active = True
            if self.pending_failover is not None:
                self._failover_done(active[0])
            # On failure keep the last load; the probe decides about health. An engine that
            # just missed its probe is not asked: a hung one would hold the tick for a
            # second deadline, and hung_after_failures ticks would take twice as long.
            if active[0].probe_failures == 0:
                with contextlib.suppress(aiohttp.ClientError, TimeoutError, ValueError):
                    self.load = await self.adapter.load(session, active[0].spec)
        self._note_stalled(active[0] if active else None)

    def _note_stalled(self, active: EngineSlot | None) -> None:
        """Why the active engine is taken as stalled now ("" if it is not), logged when
        that starts and ends."""
        if active is not None and not active.alive:
            return  # it exited: the next tick handles that ("stalled" would be noise)
        why = ""
        if active is not None and active.probe_failures:
            why = (f"engine {active.spec.engine_id} missed {active.probe_failures} "
                   "probe(s) in a row")
        elif active is not None and self.load.core_silent_s >= self.timing.stalled_after_s:
            why = (f"engine {active.spec.engine_id}'s core has answered nothing for over "
                   f"{self.timing.stalled_after_s:g} s")
        if why and not self.stalled:
            log.warning("worker %s stalled: %s; new requests go to other workers while one "
                        "can take them", self.worker.name, why)
        elif self.stalled and not why and active is not None:
            log.info("worker %s answers again (was: %s)", self.worker.name, self.stalled)
        self.stalled = why

    # -- engines --------------------------------------------------------------------------

    def engine_environment(self, spec: EngineSpec) -> dict[str, str]:
        env = {**os.environ, **self._child_env(), **self.adapter.environment(spec)}
        for name in self.adapter.overridden_environment(spec):
            env.pop(name, None)
        # The node config decides, never a variable lumend itself inherited.
        env.pop(CKPT_KEYS_ENV, None)
        if self.checkpoint_keys:
            env[CKPT_KEYS_ENV] = self.checkpoint_keys
        return env

    def _child_env(self) -> dict[str, str]:
        """What every process of this worker gets: lifeline variables and its GPUs."""
        env = supervisor_env(self.dir)
        if self.worker.gpus:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(str(g) for g in self.worker.gpus)
        return env

    def _may_start(self, slot: EngineSlot) -> bool:
        """One engine starts at a time, and none while a shadow takes over."""
        busy = next((s for s in self.slots
                     if s is not slot and s.alive and not s.became_ready), None)
        # Bounded: a shadow that has not taken over by then (its wake retries for 60 s) is
        # not worth keeping the lost engine's replacement waiting for.
        taking_over = (self.pending_failover is not None
                       and time.monotonic() - self.pending_failover.detected_at
                       < self.timing.takeover_wait_s
                       and any(s.alive and s.state == "standby" for s in self.slots))
        if busy is None and not taking_over:
            self._waiting_logged = None
            return True
        why = (f"{busy.spec.engine_id} is still starting" if busy is not None
               else "a shadow is taking over")
        if self._waiting_logged != why:
            self._waiting_logged = why
            log.info("engine %s waits: %s (engines of a worker start one at a time)",
                     slot.spec.engine_id, why)
        return False

    def plan_memory(self) -> None:
        """On CUDA, before any engine starts: the GPUs' memory for _memory_plan, and for a
        worker with shadows and no memory split the kv_cache_bytes lumend chooses, used
        exactly as if configured. nvidia-smi only: lumend itself never initialises CUDA."""
        computes = computes_memory_split(self.worker)
        if not self.worker.kv_cache_bytes and not computes:
            return
        self._gpu_total = gpu_total_bytes(list(self.worker.gpus))
        if not computes:
            return
        name, gpus, shadows = self.worker.name, len(self.worker.gpus), self.worker.shadows
        default = (f"its {shadows + 1} engines start with vLLM's default "
                   f"--gpu-memory-utilization {VLLM_DEFAULT_UTILIZATION:g}")
        weights = weights_on_disk(self.worker.model)
        if self._gpu_total is None or weights is None:
            unknown = ("nvidia-smi reports no memory for its GPUs" if self._gpu_total is None
                       else f"the size of model {self.worker.model!r} is unknown (not a local "
                       "directory of weight files)")
            log.warning("worker %s: no kv_cache_bytes set and lumend cannot choose one (%s): "
                        "%s, which leaves a shadow no room; set kv_cache_bytes "
                        "(examples/lumend.toml)", name, unknown, default)
            return
        shared = self.gms_socket is not None
        try:
            kv = default_kv_cache_bytes(self._gpu_total, weights, gpus, shadows,
                                        weights_shared=shared)
        except ValueError as exc:
            log.error("worker %s: no kv_cache_bytes set, and none fits: %s; %s", name, exc,
                      default)
            return
        log.info("worker %s: no kv_cache_bytes set: %s", name,
                 describe_kv_choice(kv, self._gpu_total, weights, gpus, shadows, shared))
        for slot in self.slots:
            slot.spec = dataclasses.replace(slot.spec, kv_cache_bytes=kv)

    def _memory_plan(self, spec: EngineSpec) -> EngineSpec:
        """On a GPU with an explicit KV budget: the --gpu-memory-utilization that covers
        what this engine needs (lumend.engine.vllm_memory), weights in GMS counted once."""
        if self._gpu_total is None or not spec.kv_cache_bytes:
            return spec
        mapped = self._gms_committed_bytes()
        try:
            fraction = memory_utilization(self._gpu_total, mapped, spec.kv_cache_bytes)
        except ValueError as exc:
            log.error("worker %s: %s", self.worker.name, exc)
            return spec
        return dataclasses.replace(spec, gpu_memory_utilization=fraction)

    def _gms_committed_bytes(self) -> int:
        """The weights a starting engine will map from GMS (0: it will load and write)."""
        if self.gms_socket is None:
            return 0
        from lumend.gms.client import GmsClient, GmsError

        try:
            with GmsClient(str(self.gms_socket)) as client:
                stats = client.stats()
        except (GmsError, OSError):
            return 0
        return int(stats["bytes"]) if stats.get("state") in ("committed", "ro") else 0

    def _watch_log_disk(self, now: float) -> None:
        """Each second, the space free where the engines' logs go: a warning when it runs
        out (engines go on serving; what they write is lost) and a line when it is back."""
        if now < self._log_disk_at:
            return
        self._log_disk_at = now + 1.0
        try:
            st = os.statvfs(self.log_dir)
        except OSError:
            self.log_dir_free = None
            return
        self.log_dir_free = st.f_bavail * st.f_frsize
        full = self.log_dir_free < LOG_DISK_FULL_BYTES
        if full and not self._log_disk_full:
            log.warning("worker %s: the disk of its engines' logs (%s) is full, %d bytes "
                        "free: engines go on serving, but what they write is lost, the "
                        "reason they exit included; free space there (lumend's state_dir)",
                        self.worker.name, self.log_dir, self.log_dir_free)
        elif self._log_disk_full and not full:
            log.info("worker %s: the disk of its engines' logs (%s) has space again "
                     "(%d bytes free)", self.worker.name, self.log_dir, self.log_dir_free)
        self._log_disk_full = full

    def _start_engine(self, slot: EngineSlot, now: float) -> None:
        spec = self._memory_plan(slot.spec)
        with slot.log_path.open("ab") as out:
            slot.proc = subprocess.Popen(
                self.adapter.command(spec), stdout=out, stderr=subprocess.STDOUT,
                start_new_session=True, env=self.engine_environment(spec),
            )
        self._watch_exit(slot)
        slot.state = "starting"
        slot.started_at = now
        slot.probe_failures = 0
        slot.became_ready = False
        log.info("engine %s started (pid %d, port %d)", slot.spec.engine_id, slot.proc.pid,
                 slot.spec.port)

    def _watch_exit(self, slot: EngineSlot) -> None:
        """Kill the engine's process group the moment its leader exits, not a tick later."""
        assert slot.proc is not None
        try:
            loop = asyncio.get_running_loop()
            fd = os.pidfd_open(slot.proc.pid)
        except (RuntimeError, OSError, AttributeError):
            return  # no loop (a direct call) or no pidfd: the tick notices the exit
        pid = slot.proc.pid

        def exited() -> None:
            loop.remove_reader(fd)
            kill_group(pid)

        loop.add_reader(fd, exited)
        slot.exit_watch = fd

    def _unwatch(self, slot: EngineSlot) -> None:
        fd, slot.exit_watch = slot.exit_watch, None
        if fd is None:
            return
        with contextlib.suppress(RuntimeError, ValueError):
            asyncio.get_running_loop().remove_reader(fd)
        os.close(fd)

    def _engine_died(self, slot: EngineSlot, now: float) -> None:
        assert slot.proc is not None
        code = slot.proc.returncode
        was = slot.state
        # What the engine started (vLLM's engine core and GPU workers) dies with it.
        kill_group(slot.proc.pid)
        self._unwatch(slot)
        slot.proc = None
        slot.state = "stopped"
        if was == "active" and self.pending_failover is None:
            self.pending_failover = FailoverRecord(slot.spec.engine_id,
                                                   f"active engine exited ({code})", now)
        # An engine that dies before it ever initialises is crash-looping: back off. So is
        # one that exits with an error soon after it was ready (it could not wake, its
        # weights changed). One killed (a signal), or that served a while, is replaced at
        # once, so the worker regains its shadow quickly.
        slot.failed_starts = 0 if slot.became_ready else slot.failed_starts + 1
        failing = not slot.became_ready or (
            code is not None and code > 0 and now - slot.ready_at < self.timing.stable_s)
        slot.backoff_s = (min(max(slot.backoff_s * 2, self.timing.backoff_first_s),
                              self.timing.backoff_max_s) if failing else 0.0)
        slot.restart_at = now + slot.backoff_s
        slot.restarts += 1
        self.counters.engine_restarts += 1
        why = last_error(slot.log_path)
        log.warning("engine %s exited with %s while %s%s; restarting in %.1f s (log: %s)",
                    slot.spec.engine_id, code, was, f": {why}" if why else "",
                    slot.backoff_s, slot.log_path)

    async def _probe(self, session: aiohttp.ClientSession, slot: EngineSlot,
                     now: float) -> None:
        try:
            slot.state = await self.adapter.probe(session, slot.spec)
            slot.probe_failures = 0
            if not slot.became_ready and slot.state in ("standby", "active"):
                slot.became_ready, slot.ready_at = True, now
        except (aiohttp.ClientError, TimeoutError, ValueError, KeyError) as exc:
            if slot.state == "starting":
                if now - slot.started_at > self.timing.start_timeout_s:
                    self._kill(slot, f"not serving its API after {self.timing.start_timeout_s} s")
                return  # still coming up
            slot.probe_failures += 1
            if slot.probe_failures >= self.timing.hung_after_failures:
                self._kill(slot, f"{slot.probe_failures} probes failed ({exc!r}): hung")
                self.counters.hung_kills += 1
            return
        if (slot.state == "initialising"
                and now - slot.started_at > self.timing.start_timeout_s):
            self._kill(slot, f"still initialising after {self.timing.start_timeout_s} s")

    def _kill(self, slot: EngineSlot, why: str) -> None:
        if slot.proc is None:
            return
        log.warning("killing engine %s (pid %d): %s", slot.spec.engine_id, slot.proc.pid, why)
        if slot.state == "active" and self.pending_failover is None:
            self.pending_failover = FailoverRecord(slot.spec.engine_id, why, time.monotonic())
        kill_group(slot.proc.pid)  # the engine and every process it started

    def _failover_done(self, slot: EngineSlot) -> None:
        record = self.pending_failover
        assert record is not None
        record.completed_at = time.monotonic()
        self.pending_failover = None
        self.counters.failovers += 1
        seconds = record.seconds or 0.0
        self.counters.failover_seconds.append(seconds)
        log.info("failover of %s: %s serves %.3f s after %s was lost (%s)",
                 self.worker.name, slot.spec.engine_id, seconds, record.engine_id,
                 record.reason)
        if self.on_failover is not None:
            self.on_failover(record)

    # -- draft-assist ---------------------------------------------------------------------

    @property
    def _draft_file(self) -> Path:
        return self.dir / "draft.endpoint"

    def _keep_draft(self, now: float) -> None:
        """Run the draft server while the worker must reload (nothing serves or stands by),
        stop it once an engine is ready; learn its endpoint from the file it writes."""
        alive = self.draft_proc is not None and self.draft_proc.poll() is None
        if self.ready():
            if self.draft_proc is not None:
                self._stop_draft("an engine is ready")
            return
        if self.draft_proc is not None and not alive:
            log.warning("draft server of %s exited (%s); restarting it", self.worker.name,
                        self.draft_proc.returncode)
            kill_group(self.draft_proc.pid)
            self.draft_proc = None
            self.draft_endpoint = ""
            self._draft_restart_at = now + min(30.0, 0.5 * 2 ** min(self.draft_starts, 6))
        if self.draft_proc is None and now >= self._draft_restart_at:
            self._start_draft()
        if self.draft_proc is not None and not self.draft_endpoint:
            with contextlib.suppress(OSError):
                self.draft_endpoint = self._draft_file.read_text().strip()
                if self.draft_endpoint:
                    log.info("%s assisting: draft server at %s", self.worker.name,
                             self.draft_endpoint)

    def _start_draft(self) -> None:
        cmd = draft_command(self.worker, self.host, self._draft_file,
                            time_scale=self.time_scale)
        if cmd is None:
            return
        self._draft_file.unlink(missing_ok=True)
        env = {**os.environ, **self._child_env()}
        env.pop(CKPT_KEYS_ENV, None)
        if self.checkpoint_keys:
            env[CKPT_KEYS_ENV] = self.checkpoint_keys  # the drafter's CURVE server keys
        with (self.log_dir / f"{self.worker.name}.draft.log").open("ab") as out:
            self.draft_proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT,
                                               start_new_session=True, env=env)
        self.draft_starts += 1
        log.info("%s must reload its engine: draft server (%s) started (pid %d)",
                 self.worker.name, self.worker.draft_model, self.draft_proc.pid)

    def _stop_draft(self, why: str) -> None:
        proc, self.draft_proc = self.draft_proc, None
        self.draft_endpoint = ""
        if proc is None:
            return
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=2.0)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        kill_group(proc.pid)
        log.info("%s stopped assisting (%s): draft server stopped", self.worker.name, why)

    # -- GMS ------------------------------------------------------------------------------

    def _keep_gms(self) -> None:
        if self.gms_socket is None:
            return
        if self.gms_proc is not None and self.gms_proc.poll() is None:
            return
        now = time.monotonic()
        gms_log = self.log_dir / f"{self.worker.name}.gms.log"
        if self.gms_proc is not None:
            # A server that cannot run (no driver, a bad device) must not be restarted
            # every tick: back off as for engines, and say why.
            lived = now - self._gms_started
            self._gms_backoff_s = (0.0 if lived >= self.timing.stable_s else
                                   min(max(self._gms_backoff_s * 2, self.timing.backoff_first_s),
                                       self.timing.backoff_max_s))
            why = last_error(gms_log)
            log.warning("GMS server of %s exited (%s%s); restarting it in %.1f s: engines keep "
                        "serving, the next engine to start reloads the weights (log: %s)",
                        self.worker.name, self.gms_proc.returncode, f": {why}" if why else "",
                        self._gms_backoff_s, gms_log)
            self.counters.gms_restarts += 1
            self.gms_proc = None
            self._gms_restart_at = now + self._gms_backoff_s
        if now < self._gms_restart_at:
            return
        self._gms_started = now
        with gms_log.open("ab") as out:
            # On CUDA the server sees only this worker's GPU, as device 0.
            self.gms_proc = subprocess.Popen(
                [sys.executable, "-m", "lumend.gms.server", "--socket", str(self.gms_socket),
                 "--backend", self.adapter.gms_backend, "--device", "0"],
                stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                env={**os.environ, **self._child_env()},
            )

    # -- planned switchover ---------------------------------------------------------------

    async def switchover(self, session: aiohttp.ClientSession,
                         drain_timeout_s: float = 30.0) -> tuple[str, float]:
        """Hand the active role to a shadow; returns the engine that took over and the
        seconds until it was active."""
        active = [s for s in self.slots if s.state == "active"]
        if not active:
            raise RuntimeError(f"worker {self.worker.name} has no active engine to hand over")
        if not any(s.state == "standby" for s in self.slots):
            raise RuntimeError(f"worker {self.worker.name} has no standby shadow to take over")
        started = time.monotonic()
        old = active[0]
        await self.adapter.release(session, old.spec, drain_timeout_s)
        others = [s for s in self.slots if s is not old and s.alive]
        deadline = started + drain_timeout_s + 30.0
        while time.monotonic() < deadline:
            states = await asyncio.gather(
                *(self.adapter.probe(session, s.spec) for s in others), return_exceptions=True)
            for slot, state in zip(others, states, strict=True):
                if state == "active":
                    return slot.spec.engine_id, time.monotonic() - started
            await asyncio.sleep(0.01)
        raise TimeoutError(f"no shadow of {self.worker.name} became active within "
                           f"{deadline - started:.0f} s of the release")

    # -- reporting ------------------------------------------------------------------------

    def record(self) -> WorkerRecord:
        return WorkerRecord(
            name=self.worker.name, node=self.node, gpus=list(self.worker.gpus),
            engine=self.worker.engine, model=self.worker.served_name,
            aliases=list(self.worker.served_names[1:]), state=self.worker_state(),
            engines=[
                EngineInfo(id=s.spec.engine_id, role="active" if s.state == "active"
                           else "shadow", state=s.state, pid=s.proc.pid if s.alive and s.proc
                           else None, url=s.spec.url)
                for s in self.slots
            ],
            load=self.load.report(),
            updated_at=time.time(),
            draft=self.draft_endpoint if self.draft_proc is not None else "",
            stalled=self.stalled,
        )

    def worker_state(self) -> WorkerState:
        if self.refused is not None:
            return "failed"
        states = {s.state for s in self.slots}
        if "active" in states:
            return "serving"
        if all(s.failed_starts >= self.timing.failed_after_starts for s in self.slots):
            return "failed"  # every engine keeps dying before it is ready: needs an operator
        if self.draft_proc is not None and self.draft_endpoint:
            return "assisting"  # reloading, and drafting for a survivor meanwhile
        if self.ever_active:
            return "recovering"
        if time.monotonic() - self._started > self.timing.start_timeout_s:
            return "failed"
        return "starting"

    def ready(self) -> bool:
        """Serving, or at least one engine initialised and standing by."""
        return bool({s.state for s in self.slots} & {"active", "standby"})

    def stop_all(self) -> None:
        self._stop_draft("lumend stops")
        procs = [s.proc for s in self.slots if s.proc is not None] + (
            [self.gms_proc] if self.gms_proc is not None else [])
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + self.timing.stop_grace_s
        for p in procs:
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
            kill_group(p.pid)  # anything the process started that did not stop with it
        for s in self.slots:
            self._unwatch(s)
            s.proc = None
            s.state = "stopped"


_ERROR_LINE = re.compile(
    r"(\(\S+ pid=\d+\) )?("  # vLLM prefixes its engine core's lines so
    r"[\w.]*(Error|Exception|Mismatch): .+"  # a Python exception's last line
    r"|ERROR \d\d-\d\d .+"  # vLLM's own error lines
    r"|lumend [\w-]+: .+"  # lumend's commands (gms-server) on a bad start
    r"|\S+: error: .+)")  # argparse
_LOG_TAIL_BYTES = 64 * 1024


def last_error(log_path: Path) -> str | None:
    """The last line of an engine's log that states an error (a Python exception's
    message, vLLM's ERROR lines), for lumend's own log; None when there is none."""
    try:
        with log_path.open("rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - _LOG_TAIL_BYTES))
            tail = f.read().decode(errors="replace").splitlines()
    except OSError:
        return None
    for line in reversed(tail):
        line = line.strip()
        if _ERROR_LINE.fullmatch(line) and "See root cause above" not in line:
            return line if len(line) <= 400 else line[:397] + "..."
    return None


def _gms_fits(adapter: EngineAdapter, worker: WorkerConfig) -> bool:
    """GMS on CUDA holds one GPU's weights (WorkerConfig.fits_cuda_gms)."""
    if adapter.gms_backend == "cuda" and not worker.fits_cuda_gms:
        log.warning("worker %s spans %d GPUs: GMS serves one GPU per worker so far, so its "
                    "shadows keep their own weights (sleep mode offloads them)", worker.name,
                    len(worker.gpus))
        return False
    return True

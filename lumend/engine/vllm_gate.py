"""LUMEN's gate inside a real vLLM API server (loaded with `--middleware`).

vLLM builds its HTTP app only after the engine has initialised, so importing this module
is the moment the engine is ready. From then on a thread waits on the worker's failover
lock (flock); the engine stays a hot standby, refusing completions with 503 at once, until
the lock is its own. The lock lives in this process, so the kernel releases it when the
API server dies, however it dies. Configured by the environment the adapter sets:
LUMEN_ENGINE_ID and LUMEN_FAILOVER_LOCK.

Endpoints added: GET /lumen/engine (state), POST /lumen/release (planned switchover).
While active, GET /lumen/engine answers 503 with the reason once the engine core (another
process) has answered nothing and moved no stream for LUMEN_CORE_HANG_S (20 s): the hang a
GPU engine has, which this server would otherwise never show (lumend.engine.core_watch).
The supervisor kills the engine as hung after that probe fails three times.

Control paths (everything but inference and read-only probes: vLLM's dev endpoints and
LUMEN's release/assist) are refused with 403 unless the request comes from this machine and
carries the token lumend gave this engine (LUMEN_ENGINE_TOKEN; lumend.engine.engine_auth):
the port stays open to other nodes' gateways for /v1/*, and only to them.

On a GPU (LUMEN_SLEEP_MODE=1, vLLM in sleep mode with its dev endpoints) two engines share
the worker's GPUs: an engine that is not active sleeps (level 1: no KV cache, weights
unmapped from GMS or offloaded) and wakes when it takes the lock; the active one sleeps
before it hands the lock over. The gate calls its own server's /sleep and /wake_up.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
import urllib.request
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from lumend.engine.core_watch import CoreWatch, hang_after_s_from
from lumend.engine.engine_auth import TOKEN_ENV, TOKEN_HEADER, Refusal, control_refusal
from lumend.engine.metric_names import ENGINE_CONTROL_REFUSED, ENGINE_CORE_SILENT, deprecated
from lumend.failover.lifeline import die_with_supervisor
from lumend.failover.lock import FailoverLock

GATED_PATHS = ("/v1/completions", "/v1/chat/completions")
SERVER_UP_TIMEOUT_S = 300.0
REFUSAL_LOG_INTERVAL_S = 10.0

log = logging.getLogger("vllm.lumen_gate")  # under vllm.: vLLM's log configuration applies


class _Gate:
    def __init__(self) -> None:
        self.engine_id = os.environ.get("LUMEN_ENGINE_ID", f"vllm-{os.getpid()}")
        path = os.environ.get("LUMEN_FAILOVER_LOCK")
        self.lock = FailoverLock(path, f"{self.engine_id} pid {os.getpid()}") if path else None
        self.sleep_mode = os.environ.get("LUMEN_SLEEP_MODE") == "1"
        self.url = os.environ.get("LUMEN_ENGINE_URL", "")
        # Asleep before it counts as a standby: the supervisor registers nothing sooner.
        self.state = "initialising" if self.sleep_mode else "standby"
        self.activated_at: float | None = None
        self.activated_mono = 0.0  # monotonic: when the core's silence starts to count
        self.in_flight = 0
        self.token = os.environ.get(TOKEN_ENV) or None
        if self.token is None:
            log.warning("engine %s: no %s in the environment (not started by lumend): control "
                        "paths are served to local callers without a token", self.engine_id,
                        TOKEN_ENV)
        self._wake = threading.Event()
        threading.Thread(target=self._hold_lock, name="lumen-failover-lock", daemon=True).start()

    def _hold_lock(self) -> None:
        if self.sleep_mode:
            self._call_engine("/sleep?level=1", wait_for_server=True)
            self.state = "standby"
        while True:
            if self.lock is not None:
                while not self.lock.try_acquire():
                    time.sleep(0.02)
            if self.sleep_mode:
                self._call_engine("/wake_up")
            self.activated_mono = time.monotonic()
            self.state = "active"
            self.activated_at = time.time()
            self._wake.wait()  # set by a release; then queue for the lock again
            self._wake.clear()

    def _call_engine(self, path: str, wait_for_server: bool = False) -> None:
        """POST to this engine's own sleep endpoints (from a thread: never from the event
        loop that must serve the call). At start the server may not listen yet."""
        deadline = time.monotonic() + (SERVER_UP_TIMEOUT_S if wait_for_server else 60.0)
        failures = 0
        while True:
            try:
                request = urllib.request.Request(
                    self.url + path, method="POST",
                    headers={TOKEN_HEADER: self.token} if self.token else {})
                with urllib.request.urlopen(request, timeout=120):
                    return
            except OSError as exc:
                failures += 1
                # A wake right after a failover can fail while the driver still frees the
                # dead engine's memory: retried (bounded), and said so every ~5 s.
                if not wait_for_server and failures % 25 == 1:
                    log.warning("engine %s: POST %s failed (%s), attempt %d; retrying for "
                                "%.0f s more", self.engine_id, path, exc, failures,
                                max(0.0, deadline - time.monotonic()))
                if time.monotonic() > deadline:
                    # An engine that cannot sleep or wake must not serve: exit, the
                    # supervisor restarts it and the worker's other engines carry on.
                    log.error("engine %s: POST %s failed (%s); exiting", self.engine_id,
                              path, exc)
                    os._exit(1)
                time.sleep(0.2)

    async def release(self, drain_timeout_s: float) -> None:
        if self.state != "active":
            raise RuntimeError(f"engine {self.engine_id} is {self.state}")
        self.state = "releasing"
        deadline = time.monotonic() + drain_timeout_s
        while self.in_flight and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        if self.sleep_mode:  # free the GPU for the shadow before it takes over
            await asyncio.to_thread(self._call_engine, "/sleep?level=1")
        self.state = "standby"
        if self.lock is not None:
            await self.lock.hand_over()
        self._wake.set()

    def info(self) -> dict[str, Any]:
        return {"id": self.engine_id, "state": self.state, "pid": os.getpid(),
                "activated_at": self.activated_at, "in_flight": self.in_flight,
                "weights_source": "disk", "control_refused": _refusals.counts()}


class _Refusals:
    """Refused control requests: counted by reason (here and in vLLM's /metrics as
    `lumen_engine_control_refused_total`, and under the 0.1 name
    `lumen:engine_control_refused_total` until the next release), logged at most once per
    reason per interval."""

    def __init__(self) -> None:
        self._counts: dict[str, int] = {}
        self._last_logged: dict[str, float] = {}
        self._unlogged: dict[str, int] = {}
        self._metrics: list[Any] = []
        try:
            from prometheus_client import Counter

            self._metrics = [
                Counter(ENGINE_CONTROL_REFUSED, "Control requests this engine's gate "
                        "refused.", ["reason"]),
                Counter(deprecated(ENGINE_CONTROL_REFUSED),
                        f"Deprecated: use {ENGINE_CONTROL_REFUSED}_total.", ["reason"])]
        except (ImportError, ValueError):  # no client, or registered twice in one process
            self._metrics = []

    def counts(self) -> dict[str, int]:
        return dict(self._counts)

    def record(self, refusal: Refusal, client: str) -> None:
        reason = refusal.reason
        self._counts[reason] = self._counts.get(reason, 0) + 1
        for metric in self._metrics:
            metric.labels(reason).inc()
        now = time.monotonic()
        if now - self._last_logged.get(reason, -REFUSAL_LOG_INTERVAL_S) < \
                REFUSAL_LOG_INTERVAL_S:
            self._unlogged[reason] = self._unlogged.get(reason, 0) + 1
            return
        self._last_logged[reason] = now
        more = self._unlogged.pop(reason, 0)
        log.warning("engine %s refused a control request from %s: %s%s", _gate.engine_id,
                    client, refusal.message,
                    f" (and {more} more like it since the last report)" if more else "")


_refusals = _Refusals()


die_with_supervisor()
_gate = _Gate()
_HANG_AFTER_S = hang_after_s_from(os.environ)  # a bad value stops the start, says why
_watch: CoreWatch | None = None


def _core_watch(request: Any) -> CoreWatch | None:
    """The watch on this server's engine core (vLLM's engine client), made on first use."""
    global _watch
    if _watch is None:
        client = getattr(request.app.state, "engine_client", None)
        if client is not None:
            _watch = CoreWatch(client.is_sleeping, _HANG_AFTER_S)
    return _watch


def _core_silent_s() -> float:
    """Seconds the active engine's core has left the watch's question unanswered."""
    if _watch is None or _gate.state != "active":
        return 0.0
    return _watch.silent_s(_gate.activated_mono)


def _export_core_silence() -> None:
    """`lumen_engine_core_silent_seconds` in this server's /metrics, read at each scrape:
    lumend admits elsewhere while it is high, long before the hang window is up."""
    try:
        from prometheus_client import Gauge

        Gauge(ENGINE_CORE_SILENT, "Seconds this engine's core has left a question "
              "unanswered while active (0: it answers).").set_function(_core_silent_s)
    except (ImportError, ValueError):  # no client, or registered twice in one process
        pass


_export_core_silence()


def _core_stuck(request: Any) -> str | None:
    """Why an active engine's core does not serve, or None; asks the core again. Only
    while active: a standby's core sleeps or wakes, which is not a hang."""
    watch = _core_watch(request)
    if watch is None or _gate.state != "active":
        return None
    watch.poke()
    why = watch.verdict(_gate.activated_mono)
    return None if why is None else f"engine {_gate.engine_id}: {why}"


async def gate(request: Any, call_next: Callable[[Any], Awaitable[Any]]) -> Any:
    """Starlette HTTP middleware (vLLM's `--middleware lumend.engine.vllm_gate.gate`)."""
    from starlette.responses import JSONResponse

    path = request.url.path
    client = request.client.host if request.client is not None else None
    server = request.scope.get("server")
    refusal = control_refusal(request.method, path, client, server[0] if server else None,
                              request.headers.get(TOKEN_HEADER), _gate.token)
    if refusal is not None:
        _refusals.record(refusal, client or "an unknown peer")
        return JSONResponse({"error": {"message": refusal.message, "type": "forbidden",
                                       "param": None, "code": 403}}, status_code=403)
    if path == "/lumen/engine":
        stuck = _core_stuck(request)
        if stuck is not None:
            return JSONResponse({**_gate.info(), "error": stuck}, status_code=503)
        return JSONResponse(_gate.info())
    if path == "/lumen/release" and request.method == "POST":
        try:
            await _gate.release(float(request.query_params.get("drain_timeout_s", "30")))
        except RuntimeError as exc:
            return JSONResponse({"error": str(exc)}, status_code=409)
        return JSONResponse({"released": True})
    if path == "/lumen/assist":
        return await _assist(request)
    if path in GATED_PATHS:
        if _gate.state != "active":
            return JSONResponse(
                {"error": {"message": f"engine {_gate.engine_id} is {_gate.state}, not active; "
                           "send the request to the worker's active engine",
                           "type": "unavailable", "code": 503}},
                status_code=503)
        _gate.in_flight += 1
        try:
            response = await call_next(request)
        except BaseException:
            _gate.in_flight -= 1
            raise
        body = response.body_iterator

        async def counted() -> Any:  # a stream is in flight until its last chunk is sent
            try:
                async for chunk in body:
                    if _watch is not None:
                        _watch.progress()
                    yield chunk
            finally:
                _gate.in_flight -= 1

        response.body_iterator = counted()
        return response
    return await call_next(request)


class _AssistLedger:
    """Which draft-assist assignment this engine serves, and the drafted and accepted
    tokens of each (from vLLM's own spec-decode counters, taken at attach and detach)."""

    def __init__(self) -> None:
        self.assignment: str | None = None
        self.base = (0.0, 0.0)
        self.done: dict[str, dict[str, int]] = {}

    @staticmethod
    def totals() -> tuple[float, float]:
        from prometheus_client import REGISTRY

        drafted = accepted = 0.0
        for family in REGISTRY.collect():
            for sample in family.samples:
                if sample.name == "vllm:spec_decode_num_draft_tokens_total":
                    drafted += sample.value
                elif sample.name == "vllm:spec_decode_num_accepted_tokens_total":
                    accepted += sample.value
        return drafted, accepted

    def current(self) -> dict[str, int]:
        drafted, accepted = self.totals()
        return {"drafted_tokens": int(drafted - self.base[0]),
                "accepted_tokens": int(accepted - self.base[1])}

    def attach(self, assignment: str) -> None:
        self.detach()
        self.assignment, self.base = assignment, self.totals()

    def detach(self) -> None:
        if self.assignment is not None:
            self.done[self.assignment] = self.current()
            self.assignment = None

    def report(self) -> dict[str, Any]:
        assignments = dict(self.done)
        if self.assignment is not None:
            assignments[self.assignment] = self.current()
        return {"assignment": self.assignment, "assignments": assignments}


_ledger = _AssistLedger()


async def _assist(request: Any) -> Any:
    """Draft-assist for this engine (lumend.engine.vllm_assist): POST {"endpoint": ...,
    "assignment": id, "k": 3, "deadline_ms": 20, "max_batch": 8} attaches a draft server,
    DELETE detaches, GET reports (the same surface as the sim engine's, so lumend's node
    link drives both). The proposer follows the file LUMEN_ASSIST_FILE."""
    from starlette.responses import JSONResponse

    from lumend.engine.vllm_assist import Attachment, read_stats, write_assist_file

    if _ASSIST_FILE is None:
        return JSONResponse({"error": "draft-assist is not available on this engine: it was "
                             "not started by lumend (LUMEN_ASSIST_FILE is unset)"}, 409)
    try:
        if request.method == "POST":
            attachment = Attachment.parse(await request.json())
            if attachment is None:
                raise ValueError("endpoint must be tcp://host:port")
            await asyncio.to_thread(write_assist_file, _ASSIST_FILE, attachment)
            _ledger.attach(attachment.assignment)
            return JSONResponse({"attached": True, **_ledger.report()})
        if request.method == "DELETE":
            await asyncio.to_thread(write_assist_file, _ASSIST_FILE, None)
            _ledger.detach()
            return JSONResponse({"attached": False, **_ledger.report()})
        stats = await asyncio.to_thread(read_stats, _ASSIST_FILE)
        return JSONResponse({**stats, "attached": _ledger.assignment is not None,
                             **_ledger.report()})
    except (ValueError, TypeError) as exc:
        return JSONResponse({"error": f"bad request: {exc}"}, 400)


def _reset_assist_file() -> Path | None:
    """An engine starts detached, whatever a previous engine of this slot left."""
    path = os.environ.get("LUMEN_ASSIST_FILE")
    if not path:
        return None
    from lumend.engine.vllm_assist import write_assist_file

    write_assist_file(Path(path), None)
    return Path(path)


_ASSIST_FILE = _reset_assist_file()

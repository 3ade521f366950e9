"""LUMEN's gate inside a real vLLM API server (loaded with `--middleware`).

vLLM builds its HTTP app only after the engine has initialised, so importing this module
is the moment the engine is ready. From then on a thread waits on the worker's failover
lock (flock); the engine stays a hot standby, refusing completions with 503 at once, until
the lock is its own. The lock lives in this process, so the kernel releases it when the
API server dies, however it dies. Configured by the environment the adapter sets:
LUMEN_ENGINE_ID and LUMEN_FAILOVER_LOCK.

Endpoints added: GET /lumen/engine (state), POST /lumen/release (planned switchover).
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Any

from lumend.failover.lifeline import die_with_supervisor
from lumend.failover.lock import FailoverLock

GATED_PATHS = ("/v1/completions", "/v1/chat/completions")


class _Gate:
    def __init__(self) -> None:
        self.engine_id = os.environ.get("LUMEN_ENGINE_ID", f"vllm-{os.getpid()}")
        path = os.environ.get("LUMEN_FAILOVER_LOCK")
        self.lock = FailoverLock(path, f"{self.engine_id} pid {os.getpid()}") if path else None
        self.state = "standby"
        self.activated_at: float | None = None
        self.in_flight = 0
        self._wake = threading.Event()
        threading.Thread(target=self._hold_lock, name="lumen-failover-lock", daemon=True).start()

    def _hold_lock(self) -> None:
        while True:
            if self.lock is not None:
                while not self.lock.try_acquire():
                    time.sleep(0.02)
            self.state = "active"
            self.activated_at = time.time()
            self._wake.wait()  # set by a release; then queue for the lock again
            self._wake.clear()

    async def release(self, drain_timeout_s: float) -> None:
        if self.state != "active":
            raise RuntimeError(f"engine {self.engine_id} is {self.state}")
        self.state = "releasing"
        deadline = time.monotonic() + drain_timeout_s
        while self.in_flight and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        self.state = "standby"
        if self.lock is not None:
            await self.lock.hand_over()
        self._wake.set()

    def info(self) -> dict[str, Any]:
        return {"id": self.engine_id, "state": self.state, "pid": os.getpid(),
                "activated_at": self.activated_at, "in_flight": self.in_flight,
                "weights_source": "disk"}


die_with_supervisor()
_gate = _Gate()


async def gate(request: Any, call_next: Callable[[Any], Awaitable[Any]]) -> Any:
    """Starlette HTTP middleware (vLLM's `--middleware lumend.engine.vllm_gate.gate`)."""
    from starlette.responses import JSONResponse

    path = request.url.path
    if path == "/lumen/engine":
        return JSONResponse(_gate.info())
    if path == "/lumen/release" and request.method == "POST":
        try:
            await _gate.release(float(request.query_params.get("drain_timeout_s", "30")))
        except RuntimeError as exc:
            return JSONResponse({"error": str(exc)}, status_code=409)
        return JSONResponse({"released": True})
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
                    yield chunk
            finally:
                _gate.in_flight -= 1

        response.body_iterator = counted()
        return response
    return await call_next(request)

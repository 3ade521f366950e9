"""A real draft server on a loopback port (its own event loop in a thread)."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from typing import Any, TypeVar

import pytest
import zmq

from lumend.assist.server import DraftJob, DraftServer, DraftServerConfig, DraftServerStats
from lumend.checkpoint.security import CurveKeys

T = TypeVar("T")


class EchoDrafter:
    """Drafts `context[-1] + 1, + 2, ...`; records every job; optionally slow."""

    def __init__(self, delay_s: float = 0.0) -> None:
        self.delay_s = delay_s
        self.jobs: list[tuple[DraftJob, int]] = []
        self.released: list[str] = []
        self.gate: threading.Event | None = None  # set: drafting waits for it

    def draft(self, jobs: Sequence[DraftJob], k: int) -> list[list[int]]:
        if self.gate is not None:
            self.gate.wait(10)
        if self.delay_s:
            time.sleep(self.delay_s)
        self.jobs += [(DraftJob(j.request_id, list(j.context), j.reuse), k) for j in jobs]
        return [[(j.context[-1] if j.context else 0) + i + 1 for i in range(k)] for j in jobs]

    def release(self, request_id: str) -> None:
        self.released.append(request_id)


class RunningDrafter:
    def __init__(self, config: DraftServerConfig, function: Any) -> None:
        self.service = DraftServer(config, function)
        self.function = function
        self._loop = asyncio.new_event_loop()
        self._stop: asyncio.Event | None = None
        self._started: Future[None] = Future()
        self._thread = threading.Thread(target=self._run, name="drafter", daemon=True)

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)

        async def main() -> None:
            self._stop = asyncio.Event()
            try:
                self.service.bind()
            except Exception as exc:
                self._started.set_exception(exc)
                return
            self._started.set_result(None)
            await self.service.run(self._stop)

        self._loop.run_until_complete(main())
        self._loop.close()

    def start(self) -> RunningDrafter:
        self._thread.start()
        self._started.result(timeout=10)
        return self

    @property
    def endpoint(self) -> str:
        return self.service.endpoint

    def call(self, fn: Callable[[], T]) -> T:
        async def run() -> T:
            return fn()

        return asyncio.run_coroutine_threadsafe(run(), self._loop).result(timeout=10)

    def stats(self) -> DraftServerStats:
        return self.call(self.service.stats)

    def stop(self) -> None:
        if self._thread.is_alive() and self._stop is not None:
            stop = self._stop
            self._loop.call_soon_threadsafe(stop.set)
        self._thread.join(timeout=10)


MakeDrafter = Callable[..., RunningDrafter]


@pytest.fixture
def make_drafter() -> Iterator[MakeDrafter]:
    running: list[RunningDrafter] = []

    def make(function: Any = None, **kwargs: Any) -> RunningDrafter:
        d = RunningDrafter(DraftServerConfig(listen="127.0.0.1:0", **kwargs),
                           function if function is not None else EchoDrafter())
        running.append(d)
        return d.start()

    try:
        yield make
    finally:
        for d in running:
            d.stop()


class RawPeer:
    """A bare DEALER for sending what no client would."""

    def __init__(self, endpoint: str, curve: CurveKeys | None = None) -> None:
        self.sock: zmq.Socket[Any] = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        if curve is not None:
            curve.connect_as_client(self.sock)
        self.sock.connect(endpoint)

    def send(self, *frames: bytes) -> None:
        self.sock.send_multipart(list(frames))

    def recv(self, timeout_s: float = 5.0) -> bytes | None:
        if not self.sock.poll(int(timeout_s * 1000)):
            return None
        return self.sock.recv()

    def close(self) -> None:
        self.sock.close(0)


def wait_for(predicate: Callable[[], bool], what: str, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)

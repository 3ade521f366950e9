"""A real holder service on a loopback port (its own event loop in a thread), raw sockets."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from typing import Any, TypeVar

import msgspec
import pytest
import zmq

from lumend.checkpoint import wire
from lumend.checkpoint.holder import HolderConfig, HolderService, HolderStats
from lumend.checkpoint.security import CurveKeys
from lumend.checkpoint.store import CheckpointStore, Policy
from lumend.checkpoint.streamer import CheckpointStreamer, PageLayout

T = TypeVar("T")

LAYOUT = PageLayout(model="tiny", layout_fingerprint="fp-1", dtype="float16",
                    page_shape=(2, 4, 64))  # 1 KiB pages
PAGE = LAYOUT.page_nbytes


def block_hash(ckpt: str, index: int) -> bytes:
    return f"{ckpt}/{index}".encode().ljust(32, b"\0")


def page(fill: int) -> bytes:
    return bytes([fill % 256]) * PAGE


class RunningHolder:
    """A HolderService serving in a thread; `call` runs a function on its loop."""

    def __init__(self, config: HolderConfig, store: CheckpointStore | None = None) -> None:
        self.service = HolderService(config, store=store)
        self._loop = asyncio.new_event_loop()
        self._stop: asyncio.Event | None = None
        self._thread = threading.Thread(target=self._run, name="holder", daemon=True)
        started: Future[None] = Future()
        self._started = started

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

    def start(self) -> RunningHolder:
        self._thread.start()
        self._started.result(timeout=10)
        return self

    def service_loop(self) -> asyncio.AbstractEventLoop:
        return self._loop

    @property
    def endpoint(self) -> str:
        return self.service.endpoint

    def call(self, fn: Callable[[], T]) -> T:
        async def run() -> T:
            return fn()

        return asyncio.run_coroutine_threadsafe(run(), self._loop).result(timeout=10)

    def stats(self) -> HolderStats:
        return self.call(self.service.stats)

    def stop(self) -> None:
        if self._thread.is_alive() and self._stop is not None:
            stop = self._stop
            self._loop.call_soon_threadsafe(stop.set)
        self._thread.join(timeout=10)


MakeHolder = Callable[..., RunningHolder]


@pytest.fixture
def make_holder() -> Iterator[MakeHolder]:
    """`make_holder(budget_bytes=..., policy=..., workers=("w0",), ttl_s=...)`."""
    running: list[RunningHolder] = []

    def make(*, budget_bytes: int = 64 * PAGE, policy: Policy = "lru",
             workers: tuple[str, ...] = ("w0", "w1"), **kwargs: Any) -> RunningHolder:
        holder = RunningHolder(HolderConfig(listen="127.0.0.1:0", workers=workers,
                                            budget_bytes=budget_bytes, policy=policy,
                                            **kwargs))
        running.append(holder)
        return holder.start()

    try:
        yield make
    finally:
        for holder in running:
            holder.stop()


@pytest.fixture
def holder(make_holder: MakeHolder) -> RunningHolder:
    return make_holder()


@pytest.fixture
def make_streamer() -> Iterator[Callable[..., CheckpointStreamer]]:
    made: list[CheckpointStreamer] = []

    def make(endpoint: str, layout: PageLayout = LAYOUT, connect: bool = True,
             **kwargs: Any) -> CheckpointStreamer:
        streamer = CheckpointStreamer(endpoint, layout, **kwargs)
        made.append(streamer)
        if connect:
            assert streamer.wait_connected(10), f"no holder connected at {endpoint}"
        return streamer

    try:
        yield make
    finally:
        for s in made:
            s.close()


class RawPeer:
    """A bare DEALER for sending what no streamer would (malformed frames)."""

    def __init__(self, endpoint: str, curve: CurveKeys | None = None) -> None:
        self.sock: zmq.Socket[Any] = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        if curve is not None:
            curve.connect_as_client(self.sock)
        self.sock.connect(endpoint)

    def ask(self, parts: list[Any], timeout_s: float = 10.0) -> wire.Header:
        self.sock.send_multipart(parts, copy=False)
        assert self.sock.poll(int(timeout_s * 1000)), "the holder did not answer"
        reply = self.sock.recv_multipart()
        return wire.decode(reply).header

    def close(self) -> None:
        self.sock.close(0)


@pytest.fixture
def raw_peer(holder: RunningHolder) -> Iterator[RawPeer]:
    peer = RawPeer(holder.endpoint)
    try:
        yield peer
    finally:
        peer.close()


def put_header(**changes: Any) -> wire.Header:
    base = wire.request(
        wire.PUT, ckpt_id="c1", request_id="r1", worker="w0", model=LAYOUT.model,
        layout_fingerprint=LAYOUT.layout_fingerprint, block_index=0,
        block_hash=block_hash("c1", 0), token_count=16, dtype=LAYOUT.dtype,
        page_shape=list(LAYOUT.page_shape),
    )
    return msgspec.structs.replace(base, **changes)


def held_blocks(holder: RunningHolder, ckpt_id: str) -> int:
    """The checkpoint's consecutive blocks from block 0 that the holder has (what a resume
    can use)."""
    def count() -> int:
        ckpt = holder.service.store.checkpoints.get(ckpt_id)
        return 0 if ckpt is None else ckpt.reached.get(0, 0)

    return holder.call(count)


@pytest.fixture
def deaf_holder() -> Iterator[str]:
    """A ROUTER that accepts connections and never reads: a holder that cannot keep up."""
    sock: zmq.Socket[Any] = zmq.Context.instance().socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVHWM, 2)
    sock.setsockopt(zmq.RCVBUF, 64 * 1024)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    try:
        yield f"tcp://127.0.0.1:{port}"
    finally:
        sock.close(0)

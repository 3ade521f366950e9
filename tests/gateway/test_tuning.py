"""The gateway's cost-saving machinery keeps its behaviour: the event loop choice and its off
switch, the engine connection pool sized from max_streams with a counted, bounded wait when
full, connections of finished streams reused (and those of abandoned ones closed), and SSE
responses written whole. Against small aiohttp servers standing in for engines; no timing
assertions."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

from lumenctl.localcluster import free_ports
from lumend.cluster.view import ClusterView
from lumend.gateway import eventloop
from lumend.gateway.server import Gateway, GatewayTiming
from lumend.gateway.upstream import (
    PoolCounters,
    Upstream,
    ends_read,
    engine_session,
    pool_size,
)

# -- the event loop ------------------------------------------------------------------------


def test_the_loop_is_uvloop_when_installed_unless_switched_off() -> None:
    assert eventloop.choose({}, installed=True) == "uvloop"
    assert eventloop.choose({eventloop.ENV: "auto"}, installed=True) == "uvloop"
    assert eventloop.choose({}, installed=False) == "asyncio"
    assert eventloop.choose({eventloop.ENV: "asyncio"}, installed=True) == "asyncio"
    assert eventloop.choose({eventloop.ENV: " AsyncIO "}, installed=True) == "asyncio"
    assert eventloop.choose({eventloop.ENV: "uvloop"}, installed=True) == "uvloop"


def test_a_loop_that_cannot_run_is_refused_naming_the_fix() -> None:
    with pytest.raises(eventloop.LoopChoiceError, match=r"not installed.*LUMEN_EVENT_LOOP"):
        eventloop.choose({eventloop.ENV: "uvloop"}, installed=False)
    with pytest.raises(eventloop.LoopChoiceError, match="auto, uvloop, asyncio"):
        eventloop.choose({eventloop.ENV: "trio"}, installed=True)


async def _loop_module() -> str:
    return type(asyncio.get_running_loop()).__module__


def test_run_uses_the_loop_chosen() -> None:
    assert eventloop.run(_loop_module(), "asyncio").startswith("asyncio")
    if not eventloop.uvloop_installed():
        pytest.skip("uvloop is not installed")
    assert eventloop.run(_loop_module(), "uvloop").startswith("uvloop")


def test_lumend_run_refuses_an_unknown_loop(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                            ) -> None:
    from typer.testing import CliRunner

    from lumend.cli import app

    monkeypatch.setenv(eventloop.ENV, "trio")  # checked before the config is read
    result = CliRunner().invoke(app, ["run", "--config", str(tmp_path / "none.toml")])
    assert result.exit_code == 2, result.output
    assert "LUMEN_EVENT_LOOP='trio'" in result.output


# -- a stand-in engine -----------------------------------------------------------------------


class Engine:
    """Streams `pieces` chunks per request, then [DONE]; `hold` keeps streams open until
    released. Counts the TCP connections its requests came on."""

    def __init__(self, pieces: int = 3) -> None:
        self.pieces = pieces
        self.connections: set[tuple[str, int]] = set()
        self.requests = 0
        self.aborted = 0
        self.hold: asyncio.Event | None = None

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        assert body["stream"] is True
        assert request.headers["Content-Type"] == "application/json"
        assert "User-Agent" not in request.headers
        assert request.transport is not None
        self.connections.add(request.transport.get_extra_info("peername"))
        self.requests += 1
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        try:
            for i in range(self.pieces):
                last = i == self.pieces - 1
                if last and self.hold is not None:
                    await self.hold.wait()
                await response.write(
                    b'data: {"choices": [{"index": 0, "text": "t%d", "token_ids": [%d], '
                    b'"finish_reason": %s}]}\n\n' % (i, i, b'"length"' if last else b"null"))
                await asyncio.sleep(0.01)
            await response.write(b"data: [DONE]\n\n")
            await asyncio.sleep(0.01)  # the body's end in a packet of its own
            await response.write_eof()
        except (ConnectionResetError, asyncio.CancelledError):
            self.aborted += 1
            raise
        return response


@asynccontextmanager
async def engine(pieces: int = 3) -> AsyncIterator[tuple[Engine, str]]:
    fake = Engine(pieces)
    app = web.Application()
    app.router.add_post("/v1/completions", fake.completions)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_ports(1)[0]
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        yield fake, f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


async def drain(upstream: Upstream) -> list[str]:
    return [piece.text async for piece in upstream.pieces()]


# -- the connection pool ---------------------------------------------------------------------


def test_the_pool_is_sized_from_max_streams() -> None:
    assert pool_size(1024) == 2048
    assert pool_size(1) == 2


async def _test_the_gateway_pool_follows_its_config() -> None:
    gateway = Gateway(lambda: ClusterView(cluster="t", revision=0, workers={}),
                      GatewayTiming(max_streams=3, pool_wait_s=0.5))
    await gateway.start(f"127.0.0.1:{free_ports(1)[0]}")
    try:
        session = gateway._session
        assert session is not None
        connector = session.connector
        assert isinstance(connector, aiohttp.TCPConnector)
        assert connector.limit == pool_size(3) and connector.limit_per_host == 0
        assert session.timeout.connect == 0.5 and session.timeout.sock_read is None
        assert session.timeout.total is None
    finally:
        await gateway.stop()


def test_the_gateway_pool_follows_its_config() -> None:
    asyncio.run(_test_the_gateway_pool_follows_its_config())


async def _test_a_request_beyond_the_pool_waits_a_bounded_counted_time(
        caplog: pytest.LogCaptureFixture) -> None:
    counters = PoolCounters()
    async with engine() as (fake, url):
        fake.hold = asyncio.Event()
        session = engine_session(1, 0.3, counters)  # two connections
        try:
            held = [Upstream("w", session, (url,), "/v1/completions", {"stream": True})
                    for _ in range(2)]
            for upstream in held:
                assert await upstream.started() is None
            with (caplog.at_level(logging.WARNING, "lumend.gateway"),
                  pytest.raises(aiohttp.ConnectionTimeoutError)):
                await session.post(url + "/v1/completions", json={"stream": True})
            assert counters.waits == 1 and counters.timeouts == 1
            assert "no free connection" in caplog.text and "max_streams" in caplog.text

            # A waiting request that gets a connection in time is counted as a wait only.
            waiting = Upstream("w", session, (url,), "/v1/completions", {"stream": True})
            while counters.waits < 2:
                await asyncio.sleep(0.01)
            fake.hold.set()
            for upstream in held:
                assert await drain(upstream) == ["t0", "t1", "t2"]
            assert await drain(waiting) == ["t0", "t1", "t2"]
            assert counters.waits == 2 and counters.timeouts == 1
            for upstream in (*held, waiting):
                await upstream.close()
        finally:
            await session.close()


def test_a_request_beyond_the_pool_waits_a_bounded_counted_time(
        caplog: pytest.LogCaptureFixture) -> None:
    asyncio.run(_test_a_request_beyond_the_pool_waits_a_bounded_counted_time(caplog))


async def _test_a_finished_stream_gives_its_connection_back() -> None:
    async with engine() as (fake, url):
        session = engine_session(8, 1.0, PoolCounters())
        try:
            for _ in range(4):
                upstream = Upstream("w", session, (url,), "/v1/completions", {"stream": True})
                async for piece in upstream.pieces():
                    if piece.finish_reason is not None:
                        break  # as the gateway does: [DONE] and the end are still to come
                await upstream.close()
                await ends_read()  # in the background: the next stream does not wait for it
            assert fake.requests == 4
            assert len(fake.connections) == 1, "each stream paid for a new connection"
            assert fake.aborted == 0
        finally:
            await session.close()


def test_a_finished_stream_gives_its_connection_back() -> None:
    asyncio.run(_test_a_finished_stream_gives_its_connection_back())


async def _test_an_abandoned_stream_closes_its_connection() -> None:
    async with engine(pieces=50) as (fake, url):
        session = engine_session(8, 1.0, PoolCounters())
        try:
            upstream = Upstream("w", session, (url,), "/v1/completions", {"stream": True})
            assert await upstream.started() is None
            await upstream.close()  # mid-stream: the engine must see it and stop
            for _ in range(200):
                if fake.aborted:
                    break
                await asyncio.sleep(0.01)
            assert fake.aborted == 1
            again = Upstream("w", session, (url,), "/v1/completions", {"stream": True})
            assert len(await drain(again)) == 50
            await again.close()
            assert len(fake.connections) == 2
        finally:
            await session.close()


def test_an_abandoned_stream_closes_its_connection() -> None:
    asyncio.run(_test_an_abandoned_stream_closes_its_connection())


# -- the client's side -----------------------------------------------------------------------


async def _test_a_stream_through_the_gateway_is_whole_on_either_loop() -> None:
    async with engine() as (_, url):
        from lumend.cluster.models import EngineInfo, WorkerRecord

        worker = WorkerRecord(name="w0", node="n", gpus=[0], engine="sim", model="m",
                              state="serving", updated_at=0.0,
                              engines=[EngineInfo(id="e0", role="active", state="active",
                                                  pid=None, url=url)])
        view = ClusterView(cluster="t", revision=0, workers={"w0": worker})
        gateway = Gateway(lambda: view)
        listen = f"127.0.0.1:{free_ports(1)[0]}"
        await gateway.start(listen)
        try:
            async with aiohttp.ClientSession() as session:
                for _ in range(3):
                    async with session.post(f"http://{listen}/v1/completions",
                                            json={"prompt": "p", "stream": True}) as r:
                        assert r.status == 200
                        assert r.headers["Content-Type"] == "text/event-stream"
                        body = (await r.read()).decode()
            chunks = [line for line in body.split("\n\n") if line]
            assert chunks[-1] == "data: [DONE]"
            assert "".join(c for c in chunks if '"t' in c).count('"text"') == 3
            assert gateway.counters.requests["ok"] == 3
        finally:
            await gateway.stop()


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_a_stream_through_the_gateway_is_whole_on_either_loop(loop: str) -> None:
    if loop == "uvloop" and not eventloop.uvloop_installed():
        pytest.skip("uvloop is not installed")
    eventloop.run(_test_a_stream_through_the_gateway_is_whole_on_either_loop(), loop)

"""A proxy between a gateway and an engine that cuts one engine stream where a test needs
it: after the chunk that `cut_here` picks, the stream is closed as a lost engine closes it
(no [DONE]), so the break falls at a chosen place rather than where a kill lands."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import aiohttp
import msgspec
from aiohttp import web

from lumenctl.localcluster import free_ports

# (the chunk's first choice, ids the stream has had through this chunk) -> cut after it?
CutHere = Callable[[dict[str, Any], int], bool]


class CuttingProxy:
    """Forwards everything to `engine`. While `armed`, a stream opened then is cut after the
    first chunk `cut_here` picks; a cut disarms the proxy. `cuts` lists the ids each cut
    stream had."""

    def __init__(self, engine: str, cut_here: CutHere, armed: bool = True) -> None:
        self.engine, self.cut_here, self.armed = engine, cut_here, armed
        self.cuts: list[int] = []
        self.url = ""
        self._runner: web.AppRunner | None = None
        self._session: aiohttp.ClientSession | None = None

    async def start(self) -> None:
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self._forward)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        port = free_ports(1)[0]
        await web.TCPSite(self._runner, "127.0.0.1", port).start()
        self.url = f"http://127.0.0.1:{port}"
        self._session = aiohttp.ClientSession()

    async def stop(self) -> None:
        if self._session is not None:
            await self._session.close()
        if self._runner is not None:
            await self._runner.cleanup()

    async def _forward(self, request: web.Request) -> web.StreamResponse:
        assert self._session is not None
        body = await request.read()
        async with self._session.request(request.method, self.engine + request.path_qs,
                                         data=body, headers={"Content-Type":
                                                             "application/json"}) as up:
            if "text/event-stream" not in up.headers.get("Content-Type", ""):
                return web.Response(body=await up.read(), status=up.status,
                                    content_type=up.content_type)
            may_cut = self.armed
            response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await response.prepare(request)
            tokens = 0
            async for line in up.content:
                await response.write(line)
                if not (may_cut and self.armed) or not line.startswith(b"data: {"):
                    continue
                choice = (msgspec.json.decode(line[6:]).get("choices") or [{}])[0]
                tokens += len(choice.get("token_ids") or [])
                if self.cut_here(choice, tokens):
                    self.cuts.append(tokens)
                    self.armed = False
                    assert request.transport is not None
                    request.transport.close()  # as a lost engine: no [DONE]
                    return response
            await response.write_eof()
            return response

"""A sim request's steps as OpenAI output: vLLM's stop-string handling on the engine's
tokens (`sim_detokenizer`), then the SSE stream or the pieces of a whole response
(`sim_responses`)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from typing import Any

from aiohttp import web

from lumend.engine.sim_core import SimRequest, StepOutput, TokenModel
from lumend.engine.sim_detokenizer import OutputText
from lumend.engine.sim_openai import BadRequest, Generation
from lumend.engine.sim_responses import Position, Responses


def dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def bad_request(exc: BadRequest) -> web.Response:
    return web.json_response(exc.body(), status=400, dumps=dumps)


class RequestOutput:
    """A request's steps turned into output: stop strings applied (vLLM's output
    processor), tokens after the end dropped, the text held back as vLLM holds it."""

    def __init__(self, gen: Generation, model: TokenModel, request: SimRequest,
                 queue: asyncio.Queue[StepOutput | None],
                 on_first_token: Callable[[], None] | None = None) -> None:
        self.request = request
        self.queue = queue
        self._on_first_token = on_first_token  # called once, as the first token goes out
        self.per_token = model.tokens_per_chunk == 1
        self.text = OutputText(model.vocab, gen.prompt, gen.stop,
                               gen.include_stop_str_in_output)
        self.tokens: list[int] = []
        self.positions: list[Position] | None = [] if gen.logprobs is not None else None
        self.finish: str | None = None
        self.stop_reason: int | str | None = None

    async def steps(self) -> AsyncIterator[tuple[list[int], list[Position] | None, str]]:
        """(tokens, their distributions, new text) per chunk, until the request ends."""
        while self.finish is None and (step := await self.queue.get()) is not None:
            for part in self._parts(step):
                matched, kept = self.text.update(part.tokens, part.finish_reason == "stop")
                tokens = part.tokens[:kept]
                positions: list[Position] | None = (
                    None if part.ranked is None else list(part.ranked[:kept]))
                self.finish, self.stop_reason = part.finish_reason, part.stop_token
                if matched is not None:
                    self.finish, self.stop_reason = "stop", matched
                    self.request.cancelled = True  # the engine stops generating
                    self.request.finished = True
                if tokens and not self.tokens and self._on_first_token is not None:
                    self._on_first_token()
                self.tokens += tokens
                if self.positions is not None and positions is not None:
                    self.positions += positions
                yield tokens, positions, self.text.delta(self.finish is not None)
                if self.finish is not None:
                    break

    def _parts(self, step: StepOutput) -> list[StepOutput]:
        """One chunk per token unless the engine streams multi-token chunks: a step that
        verified drafted tokens then still streams them one by one."""
        if not self.per_token or len(step.tokens) == 1:
            return [step]
        last = len(step.tokens) - 1
        return [StepOutput([token], None if step.ranked is None else [step.ranked[i]],
                           step.finish_reason if i == last else None,
                           step.stop_token if i == last else None)
                for i, token in enumerate(step.tokens)]


async def stream(request: web.Request, responses: Responses, output: RequestOutput,
                  ) -> web.StreamResponse:
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                           "Cache-Control": "no-cache"})
    await response.prepare(request)

    async def send(chunk: dict[str, Any]) -> None:
        await response.write(f"data: {dumps(chunk)}\n\n".encode())

    chat = responses.gen.chat
    build = responses.chat_chunk if chat else responses.completion_chunk
    opened = False
    async for tokens, positions, text in output.steps():
        if chat and not opened:
            for chunk in responses.chat_opening():
                await send(chunk)
            opened = True
        await send(build(tokens, positions, text, output.finish, output.stop_reason))
    if responses.gen.include_usage:
        await send(responses.usage_chunk())
    await response.write(b"data: [DONE]\n\n")
    await response.write_eof()
    return response

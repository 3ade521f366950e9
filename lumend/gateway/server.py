"""The OpenAI-compatible gateway every lumend serves on `[gateway] listen`.

It proxies a completion to a serving worker and remembers the text it has passed on; when
the upstream breaks (connection lost, engine gone, no token within the deadline) it resumes
on a worker that serves (the same worker's shadow if it has taken over, else the least
loaded other one), sending the prompt plus that text, so the client receives one stream:
same `id`, no token twice, none missing. A stream on a worker under a `drain --migrate`
intent moves the same way, except that the old stream stays open until the new one has
produced a token. Where a request starts, where its checkpoint goes
and where an interrupted one continues are the coordinator's decisions (Admit, Recover);
when it cannot answer, this gateway decides locally and counts that as degraded.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from aiohttp import web

from lumend.cluster.view import ClusterView
from lumend.config import parse_listen
from lumend.gateway.auth import ApiKeys, Denied, RefusalLog
from lumend.gateway.checkpoints import Placement, place, route
from lumend.gateway.coordinator import CoordinatorLink
from lumend.gateway.latency import StreamLatency
from lumend.gateway.routing import Target, choose_worker, drained, models
from lumend.gateway.upstream import (
    EngineRefused,
    MigrateAway,
    StreamBroken,
    Upstream,
    resume_body,
)
from lumend.rpc.messages import CheckpointRef, RecoverAsk
from lumend.rpc.messages import Target as RpcTarget

log = logging.getLogger("lumend.gateway")

MAX_BODY_BYTES = 4 << 20


@dataclass
class GatewayCounters:
    requests: Counter[str] = field(default_factory=Counter)  # by outcome
    resumes: int = 0
    rejected: Counter[str] = field(default_factory=Counter)  # by reason
    routed: Counter[str] = field(default_factory=Counter)  # recovery decisions: resume/recompute
    migrations: int = 0  # streams moved off a worker under a drain --migrate intent


@dataclass(frozen=True)
class GatewayTiming:
    token_deadline_s: float = 30.0  # no token for this long: the upstream is broken
    recover_within_s: float = 120.0  # give up resuming a request after this long
    retry_pause_s: float = 0.05
    migrate_check_s: float = 0.1  # how often streams are checked against drain intents
    migrate_retry_s: float = 1.0  # a stream that could not move is asked again after this


class GatewayBindError(Exception):
    """The gateway's listen address cannot be bound; the message names the key and the fix."""


class ApiError(Exception):
    def __init__(self, status: int, message: str, kind: str, param: str | None = None):
        super().__init__(message)
        self.status, self.kind, self.param = status, kind, param

    def response(self) -> web.Response:
        return web.json_response({"error": {"message": str(self), "type": self.kind,
                                            "param": self.param, "code": self.status}},
                                 status=self.status)


@dataclass
class Progress:
    """What the client has received of one request."""

    text: str = ""
    tokens: int = 0
    finish_reason: str | None = None
    workers: list[str] = field(default_factory=list)
    broken_at: float | None = None  # when its upstream last broke, until the next token


class Gateway:
    def __init__(self, view: Callable[[], ClusterView | None],
                 timing: GatewayTiming | None = None,
                 coordinator: CoordinatorLink | None = None) -> None:
        self._view = view
        self.timing = timing or GatewayTiming()
        # Admission and recovery through the coordinator; None: always local (tests, and
        # nodes without a control plane).
        self.coordinator = coordinator
        self.counters = GatewayCounters()
        self.latency = StreamLatency()
        self.in_flight: Counter[str] = Counter()
        self._session: aiohttp.ClientSession | None = None
        self._runner: web.AppRunner | None = None
        self._upstreams: set[Upstream] = set()  # open engine streams, for migrations
        self._watcher: asyncio.Task[None] | None = None
        # None: no keys configured, anyone who reaches the gateway may use it. Replaced
        # whole on reload, so a request sees the old keys or the new ones.
        self.api_keys: ApiKeys | None = None
        self._auth_log = RefusalLog()

    # -- lifecycle ------------------------------------------------------------------------

    def app(self) -> web.Application:
        app = web.Application(client_max_size=MAX_BODY_BYTES, middlewares=[self._auth])
        app.router.add_get("/health", self._health)
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_post("/v1/chat/completions", self._chat)
        return app

    async def start(self, listen: str) -> None:
        host, port = parse_listen(listen)
        # Stopping waits up to shutdown_timeout for streams in flight to finish.
        runner = web.AppRunner(self.app(), access_log=None, shutdown_timeout=10.0)
        await runner.setup()
        try:
            await web.TCPSite(runner, host, port).start()
        except OSError as exc:
            await runner.cleanup()
            raise GatewayBindError(
                f'gateway.listen = "{listen}": cannot listen there ({exc.strerror or exc}); '
                "choose a free port or an address of this host") from exc
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=2.0,
                                        sock_read=self.timing.token_deadline_s)
        self._session = aiohttp.ClientSession(timeout=timeout)
        self._runner = runner
        self._watcher = asyncio.create_task(self._watch_migrations(), name="gateway-migrations")
        log.info("gateway serving the OpenAI API on http://%s", listen)
        if self.api_keys is None:
            log.warning("gateway: no [gateway] api_keys configured: the API on %s is open to "
                        "anyone who can reach it", listen)
        else:
            log.info("gateway: %d API keys from %s (every endpoint but /health needs one)",
                     len(self.api_keys), self.api_keys.path)


    async def stop(self) -> None:
        if self._watcher is not None:
            self._watcher.cancel()
            await asyncio.wait({self._watcher})
        if self._runner is not None:
            await self._runner.cleanup()
        if self._session is not None:
            await self._session.close()
        if self.coordinator is not None:
            await self.coordinator.close()

    # -- endpoints ------------------------------------------------------------------------

    @web.middleware
    async def _auth(self, request: web.Request,
                    handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
                    ) -> web.StreamResponse:
        keys = self.api_keys
        if keys is None or request.path == "/health":
            return await handler(request)
        outcome = keys.check(request.headers.get("Authorization"))
        if isinstance(outcome, Denied):
            self.counters.rejected[outcome.kind] += 1
            self._auth_log.refused(request.remote, outcome.message)
            return web.json_response(
                {"error": {"message": outcome.message, "type": outcome.kind, "param": None,
                           "code": "invalid_api_key"}},
                status=401, headers={"WWW-Authenticate": "Bearer"})
        return await handler(request)

    async def _health(self, _: web.Request) -> web.Response:
        view = self._view()
        serving = 0 if view is None else sum(w.state == "serving" for w in view.workers.values())
        return web.json_response({"status": "ok" if serving else "no serving worker",
                                  "serving_workers": serving}, status=200 if serving else 503)

    async def _models(self, _: web.Request) -> web.Response:
        view = self._view()
        names = [] if view is None else models(view)
        return web.json_response({"object": "list", "data": [
            {"id": m, "object": "model", "owned_by": "lumen"} for m in names]})

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, chat=False)

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, chat=True)

    async def _serve(self, request: web.Request, chat: bool) -> web.StreamResponse:
        try:
            body = _validate(await _json(request), chat)
            view = self._view()
            if view is None:
                raise ApiError(503, "the gateway has not read the cluster yet; retry shortly",
                               "unavailable")
            model = body.get("model")
            if model is not None and model not in models(view):
                raise ApiError(404, f"model {model!r} is not served by this cluster; "
                               f"GET /v1/models lists them", "not_found_error", "model")
        except ApiError as exc:
            self.counters.rejected[exc.kind] += 1
            return exc.response()
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        if body.get("stream"):
            return await self._stream(request, body, chat, rid)
        return await self._whole(body, chat, rid)

    # -- proxying with resume -------------------------------------------------------------

    async def _pieces(self, rid: str, body: dict[str, Any], chat: bool, progress: Progress,
                      on_piece: Callable[[str, str | None], Any]) -> None:
        """Drive the request to its end, resuming after upstream failures."""
        started = time.monotonic()
        first: float | None = None
        last = started

        async def timed(text: str, finish: str | None) -> Any:
            nonlocal first, last
            if text:
                last = time.monotonic()
                if first is None:
                    first = last
                    self.latency.ttft.observe(first - started)
                if progress.broken_at is not None:
                    self.latency.recovery.observe(last - progress.broken_at)
                    progress.broken_at = None
            return await on_piece(text, finish)

        try:
            await self._drive(rid, body, chat, progress, timed)
        finally:
            if first is not None and progress.tokens > 1:
                self.latency.tpot.observe((last - first) / (progress.tokens - 1))
            if self.coordinator is not None:
                self.coordinator.finish(rid)

    async def _drive(self, rid: str, body: dict[str, Any], chat: bool, progress: Progress,
                     on_piece: Callable[[str, str | None], Any]) -> None:
        assert self._session is not None
        path = path_of(chat)
        max_tokens = int(body.get("max_tokens", 16))
        model = body.get("model")
        give_up_at = time.monotonic() + self.timing.recover_within_s
        exclude: set[str] = set()
        broken_worker: str | None = None
        placement: Placement | None = None
        routed: Target | None = None  # where recovery routing sent the request, if anywhere
        while True:
            target: Target | None
            offered: Placement | None
            if routed is not None:
                target, offered = routed, None
            else:
                target, offered = await self._choose(rid, model, exclude, broken_worker,
                                                     want_placement=placement is None)
            if target is None:
                if time.monotonic() > give_up_at:
                    raise ApiError(503, "no worker could serve the request", "unavailable")
                exclude.clear()  # every worker failed once; they may be back: try again
                await asyncio.sleep(self.timing.retry_pause_s)
                continue
            if offered is not None and not progress.tokens:
                placement = offered  # nothing generated yet: the request starts afresh
            if progress.tokens:
                self.counters.resumes += 1
                log.info("resuming a request on %s after %d tokens", target.worker,
                         progress.tokens)
            progress.workers.append(target.worker)
            upstream_body = resume_body(body, chat, progress.text, max_tokens - progress.tokens)
            upstream_body.setdefault("model", target.model)
            if placement is not None:
                resuming = (routed is not None and routed.worker == target.worker
                            and placement.worker == target.worker)
                if resuming or not progress.tokens:
                    upstream_body["kv_transfer_params"] = placement.params(
                        "resume" if resuming else "save")
            routed = None
            upstream = self._open(target, path, upstream_body)
            try:
                while True:
                    try:
                        await self._forward(upstream, progress, on_piece)
                        return
                    except MigrateAway:
                        upstream, target, placement = await self._move(
                            rid, body, chat, progress, placement, upstream, target)
            except EngineRefused:
                exclude.add(target.worker)
                broken_worker = None
            except StreamBroken as exc:
                log.warning("stream from %s broke after %d tokens: %s", target.worker,
                            progress.tokens, exc)
                broken_worker = target.worker  # its shadow may already serve
                if progress.broken_at is None:
                    progress.broken_at = time.monotonic()
                prefix = len(progress.text) + self._prompt_chars(body, chat)
                routed = await self._recovery(rid, model, placement, target.worker, prefix)
            finally:
                await self._close(upstream)
            if time.monotonic() > give_up_at:
                raise ApiError(503, "the request could not be resumed in time", "unavailable")
            await asyncio.sleep(self.timing.retry_pause_s)

    def _open(self, target: Target, path: str, body: dict[str, Any]) -> Upstream:
        assert self._session is not None
        upstream = Upstream(target.worker, self._session, target.urls, path, body)
        self._upstreams.add(upstream)
        self.in_flight[target.worker] += 1
        return upstream

    async def _close(self, upstream: Upstream) -> None:
        if upstream in self._upstreams:
            self._upstreams.discard(upstream)
            self.in_flight[upstream.worker] -= 1
        await upstream.close()

    @staticmethod
    async def _forward(upstream: Upstream, progress: Progress,
                       on_piece: Callable[[str, str | None], Any]) -> None:
        async for piece in upstream.pieces():
            if piece.text:
                progress.text += piece.text
                progress.tokens += 1
            if piece.finish_reason:
                progress.finish_reason = piece.finish_reason
            await on_piece(piece.text, piece.finish_reason)

    async def _move(self, rid: str, body: dict[str, Any], chat: bool, progress: Progress,
                    placement: Placement | None, old: Upstream, old_target: Target
                    ) -> tuple[Upstream, Target, Placement | None]:
        """Migrate a request off a draining worker, as a recovery would move it (Recover:
        resume on its checkpoint holder, or recompute), but make-before-break: the old
        stream is closed only once the new one has produced a token. Returns the upstream
        to read on, its target and the request's checkpoint placement; when the move cannot
        happen, the old ones (the request finishes where it is)."""
        model = body.get("model")
        left = int(body.get("max_tokens", 16)) - progress.tokens
        if left < 1:  # the old stream is about to end anyway
            old.stay(self.timing.migrate_retry_s)
            return old, old_target, placement
        mode: str | None = None
        new_placement = placement
        new_target: Target | None = None
        if progress.tokens:
            prefix = len(progress.text) + self._prompt_chars(body, chat)
            new_target = await self._recovery(rid, model, placement, old.worker, prefix)
            if (new_target is not None and placement is not None
                    and placement.worker == new_target.worker):
                mode = "resume"
        if new_target is None:
            # Nothing generated yet (or nowhere to resume): start afresh elsewhere, with a
            # checkpoint of its own (the old stream frees its checkpoint when it closes).
            new_target, offered = await self._choose(rid, model, {old.worker}, None,
                                                     want_placement=True)
            if offered is not None and new_target is not None and not progress.tokens:
                new_placement, mode = offered, "save"
        if new_target is None or new_target.worker == old.worker:
            log.info("request %s stays on %s until it ends: no other worker serves it",
                     rid, old.worker)
            old.stay(self.timing.migrate_retry_s)
            return old, old_target, placement
        upstream_body = resume_body(body, chat, progress.text, left)
        upstream_body.setdefault("model", new_target.model)
        if mode is not None and new_placement is not None:
            upstream_body["kv_transfer_params"] = new_placement.params(mode)
        new = self._open(new_target, path_of(chat), upstream_body)
        try:
            problem = await new.started()
        except BaseException:
            await self._close(new)
            raise
        if problem is not None:
            await self._close(new)
            log.warning("request %s stays on %s: %s did not start it (%s)", rid, old.worker,
                        new_target.worker, problem)
            old.stay(self.timing.migrate_retry_s)
            return old, old_target, placement
        await self._close(old)
        self.counters.migrations += 1
        progress.workers.append(new_target.worker)
        log.info("migrated request %s from %s to %s after %d tokens (%s)", rid, old.worker,
                 new_target.worker, progress.tokens,
                 "resumed from its checkpoint" if mode == "resume" else "recomputed")
        return new, new_target, new_placement

    async def _watch_migrations(self) -> None:
        """Tell the streams on workers under a drain --migrate intent to move."""
        while True:
            await asyncio.sleep(self.timing.migrate_check_s)
            view = self._view()
            if view is None or not self._upstreams:
                continue
            leaving = migrating(view)
            if not leaving:
                continue
            now = time.monotonic()
            for upstream in list(self._upstreams):
                if upstream.worker in leaving and upstream.migrate_not_before <= now:
                    upstream.migrate()

    async def _choose(self, rid: str, model: str | None, exclude: set[str],
                      prefer: str | None, want_placement: bool
                      ) -> tuple[Target | None, Placement | None]:
        """Where the request (re)starts and, from the coordinator or local policy, where its
        checkpoint goes."""
        view = self._view()
        if view is None:
            return None, None
        if prefer is not None:  # first retry the same worker: a shadow may have taken over
            worker = view.workers.get(prefer)
            if worker is not None and worker.engines and not drained(view, worker):
                return Target.of(worker), None
        if self.coordinator is not None:
            admission = await self.coordinator.admit(rid, model, sorted(exclude))
            if admission is not None:
                if admission.target is None:
                    return None, None
                ckpt = admission.checkpoint
                return (_target(admission.target),
                        None if ckpt is None else Placement(ckpt.ckpt_id, ckpt.holder,
                                                            ckpt.endpoint))
            view = self._view() or view
        target = choose_worker(view, model, self.in_flight, frozenset(exclude))
        if target is None or not want_placement:
            return target, None
        return target, place(view, target.worker, uuid.uuid4().hex)

    async def _recovery(self, rid: str, model: str | None, placement: Placement | None,
                        broken: str, prefix: int) -> Target | None:
        """Algorithm 2 for an interrupted request, from the coordinator (or, when it cannot
        answer, locally): the worker to continue on, or None to retry the same worker."""
        if self.coordinator is not None:
            ask = RecoverAsk(rid, broken, prefix, model or "",
                             None if placement is None else
                             CheckpointRef(placement.ckpt_id, placement.worker,
                                           placement.endpoint), self.coordinator.node)
            recovery = await self.coordinator.recover(ask)
            if recovery is not None:
                log.info("recovery routing (coordinator epoch %d): %s", recovery.epoch,
                         recovery.reason)
                if recovery.target is None:
                    return None
                self.counters.routed["resume" if recovery.resume else "recompute"] += 1
                return _target(recovery.target)
        view = self._view()
        if placement is None or view is None:
            return None
        decision = route(view, placement, broken, prefix)
        log.info("recovery routing: checkpoint on %s, %s", placement.worker,
                 "no survivor" if decision is None else
                 f"{'resume' if decision[1] else 'recompute'} on {decision[0]}")
        if decision is None or decision[0] not in view.workers:
            return None
        self.counters.routed["resume" if decision[1] else "recompute"] += 1
        return Target.of(view.workers[decision[0]])

    @staticmethod
    def _prompt_chars(body: dict[str, Any], chat: bool) -> int:
        if chat:
            return sum(len(m["content"]) for m in body["messages"])
        return len(body["prompt"])

    async def _stream(self, request: web.Request, body: dict[str, Any], chat: bool,
                      rid: str) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                               "Cache-Control": "no-cache"})
        await response.prepare(request)
        created = int(time.time())
        model = body.get("model") or ""
        progress = Progress()

        async def send(text: str, finish: str | None) -> None:
            choice: dict[str, Any] = ({"index": 0, "delta": {"content": text},
                                       "finish_reason": finish} if chat else
                                      {"index": 0, "text": text, "finish_reason": finish})
            chunk = {"id": rid, "object": "chat.completion.chunk" if chat else
                     "text_completion", "created": created, "model": model,
                     "choices": [choice]}
            await response.write(f"data: {json.dumps(chunk)}\n\n".encode())

        try:
            try:
                await self._pieces(rid, body, chat, progress, send)
            except ApiError as exc:
                self.counters.requests["failed"] += 1
                error = {"error": {"message": str(exc), "type": exc.kind, "code": exc.status}}
                await response.write(f"data: {json.dumps(error)}\n\n".encode())
            else:
                self.counters.requests["resumed" if len(progress.workers) > 1 else "ok"] += 1
            await response.write(b"data: [DONE]\n\n")
            await response.write_eof()
        except ConnectionResetError:  # the client left; the upstream is already closed
            self.counters.requests["client_gone"] += 1
        return response

    async def _whole(self, body: dict[str, Any], chat: bool, rid: str) -> web.Response:
        progress = Progress()

        async def collect(text: str, finish: str | None) -> None:
            return None

        try:
            await self._pieces(rid, body, chat, progress, collect)
        except ApiError as exc:
            self.counters.requests["failed"] += 1
            return exc.response()
        self.counters.requests["resumed" if len(progress.workers) > 1 else "ok"] += 1
        finish = progress.finish_reason or "length"
        choice: dict[str, Any] = ({"index": 0, "message": {"role": "assistant",
                                                           "content": progress.text},
                                   "finish_reason": finish} if chat else
                                  {"index": 0, "text": progress.text, "finish_reason": finish})
        return web.json_response({
            "id": rid, "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()), "model": body.get("model") or "",
            "choices": [choice],
            "usage": {"completion_tokens": progress.tokens},
        })


async def _json(request: web.Request) -> Any:
    try:
        return await request.json()
    except json.JSONDecodeError as exc:
        raise ApiError(400, f"the body is not valid JSON: {exc}", "invalid_request_error"
                       ) from None
    except web.HTTPRequestEntityTooLarge:
        raise ApiError(413, f"the body exceeds {MAX_BODY_BYTES} bytes",
                       "invalid_request_error") from None


def path_of(chat: bool) -> str:
    return "/v1/chat/completions" if chat else "/v1/completions"


def migrating(view: ClusterView) -> set[str]:
    """Workers under a drain intent with --migrate (naming them or their node)."""
    return {w.name for w in view.workers.values()
            if any(i.kind == "drain" and i.migrate for i in view.intents_for(w))}


def _target(target: RpcTarget) -> Target:
    return Target(target.worker, target.model, target.urls)


def _validate(body: Any, chat: bool) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise ApiError(400, "the body must be a JSON object", "invalid_request_error")
    if chat:
        messages = body.get("messages")
        if (not isinstance(messages, list) or not messages or not all(
                isinstance(m, dict) and isinstance(m.get("role"), str)
                and isinstance(m.get("content"), str) for m in messages)):
            raise ApiError(400, "messages must be a non-empty list of {role, content} strings",
                           "invalid_request_error", "messages")
    else:
        prompt = body.get("prompt")
        if not isinstance(prompt, str) or not prompt:
            raise ApiError(400, "prompt must be a non-empty string (token-id prompts cannot "
                           "be resumed and are not accepted)", "invalid_request_error",
                           "prompt")
    max_tokens = body.get("max_tokens", 16)
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
        raise ApiError(400, "max_tokens must be a positive integer", "invalid_request_error",
                       "max_tokens")
    if body.get("n", 1) != 1:
        raise ApiError(400, "only n = 1 is supported", "invalid_request_error", "n")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise ApiError(400, "model must be a string", "invalid_request_error", "model")
    return body

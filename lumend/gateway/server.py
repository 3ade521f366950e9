"""The OpenAI-compatible gateway every lumend serves on `[gateway] listen`.

It proxies a completion to a serving worker and counts its progress in token ids (every
engine is asked for `return_token_ids`; clients see them only when they asked); when the
upstream breaks (connection lost, engine gone, no token within the deadline) it resumes on a
worker that serves (the same worker's shadow if it has taken over, else the least loaded
other one) with `/v1/completions` and the prompt's ids plus the ids generated so far, so the
client receives one stream: same `id`, no token twice, none missing (lumend/gateway/
request.py has the resume semantics per field, resume.py how a request continues). A
stream on a worker under a `drain --migrate` intent moves the same way, except that the old
stream stays open until the new one has produced a token. Where a request starts, where
its checkpoint goes and where an interrupted one continues are the coordinator's decisions
(Admit, Recover); when it cannot answer, this gateway decides locally and counts that as
degraded.
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
from functools import partial
from typing import Any

import aiohttp
import msgspec
from aiohttp import web

from lumend.cluster.view import ClusterView
from lumend.config import parse_listen
from lumend.gateway import readiness
from lumend.gateway.auth import ApiKeys, Denied, RefusalLog
from lumend.gateway.checkpoints import Placement, place, route
from lumend.gateway.coordinator import CoordinatorLink
from lumend.gateway.latency import StreamLatency
from lumend.gateway.render import Out, Renderer, token_logprobs
from lumend.gateway.request import ClientRequest, RequestError, parse_request
from lumend.gateway.resume import (
    Diverged,
    Progress,
    ResumePlan,
    ids_through_stop,
    pending_text,
)
from lumend.gateway.resume import plan as resume_plan
from lumend.gateway.routing import Target, choose_worker, drained, models, served_as
from lumend.gateway.stops import StopScan
from lumend.gateway.upstream import (
    EngineError,
    EngineRefused,
    MigrateAway,
    PoolCounters,
    ReadTimeouts,
    StreamBroken,
    Upstream,
    engine_session,
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
    engine_errors: Counter[int] = field(default_factory=Counter)  # engine 4xx, by status
    restarts: int = 0  # resumes recomputed from the start (guided decoding, or no clean cut)
    inside_character: int = 0  # resumes after ids that ended inside a character
    pool: PoolCounters = field(default_factory=PoolCounters)  # waits for an engine connection


@dataclass(frozen=True)
class GatewayTiming:
    first_token_s: float = 300.0  # no first token for this long: the upstream is broken
    token_deadline_s: float = 30.0  # no token for this long after the first: broken
    recover_within_s: float = 120.0  # give up resuming this long after the failure
    retry_pause_s: float = 0.05
    migrate_check_s: float = 0.1  # how often streams are checked against drain intents
    migrate_retry_s: float = 1.0  # a stream that could not move is asked again after this
    client_write_s: float = 30.0  # a client that reads nothing for this long is dropped
    max_streams: int = 1024  # engine streams open at once; more requests get 503
    pool_wait_s: float = 5.0  # the most a request waits for a free engine connection
    shadow_wait_s: float = 1.0  # how long a broken stream waits for its worker's shadow


class GatewayBindError(Exception):
    """The gateway's listen address cannot be bound; the message names the key and the fix."""


class ApiError(Exception):
    def __init__(self, status: int, message: str, kind: str, param: str | None = None,
                 body: dict[str, Any] | None = None, headers: dict[str, str] | None = None
                 ) -> None:
        super().__init__(message)
        self.status, self.kind, self.param = status, kind, param
        self.body, self.headers = body, headers

    def payload(self) -> dict[str, Any]:
        return self.body or {"error": {"message": str(self), "type": self.kind,
                                       "param": self.param, "code": self.status}}

    def response(self) -> web.Response:
        return web.json_response(self.payload(), status=self.status, headers=self.headers)


class ClientGone(Exception):
    """The client closed its connection or stopped reading."""


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
        self.opened: Counter[str] = Counter()  # engine streams ever opened, by worker
        self._session: aiohttp.ClientSession | None = None
        self._runner: web.AppRunner | None = None
        self._upstreams: set[Upstream] = set()  # open engine streams, for migrations
        self._context_of: dict[str, int] = {}  # worker -> its model's max_model_len
        self._watcher: asyncio.Task[None] | None = None
        # None: no keys configured, anyone who reaches the gateway may use it. Replaced
        # whole on reload, so a request sees the old keys or the new ones.
        self.api_keys: ApiKeys | None = None
        self._auth_log = RefusalLog()
        # `[gateway] log_admissions`: one log line per placement decision (live on reload).
        self.log_admissions = False

    # -- lifecycle ------------------------------------------------------------------------

    def app(self) -> web.Application:
        app = web.Application(client_max_size=MAX_BODY_BYTES, middlewares=[self._auth])
        app.router.add_get("/health", self._health)
        readiness.install(app, self)  # GET /ready; 503 to new requests while stopping
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
        # Streams are bounded by max_streams (503 beyond); the connection pool is sized
        # from it, and reads are timed per stream (lumend/gateway/upstream.py).
        self._session = engine_session(self.timing.max_streams, self.timing.pool_wait_s,
                                       self.counters.pool)
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
            try:
                req = parse_request(await _json(request), chat)
            except RequestError as exc:
                raise ApiError(exc.status, str(exc), exc.kind, exc.param) from None
            view = self._view()
            if view is None:
                raise ApiError(503, "the gateway has not read the cluster yet; retry shortly",
                               "unavailable")
            model = req.model
            if model is not None:
                served = served_as(view, model)
                if served is None:
                    raise ApiError(404, f"model {model!r} is not served by this cluster; "
                                   f"GET /v1/models lists them", "not_found_error", "model")
                if served != model:  # an alias: on under the name its workers go by
                    req.body["model"] = served
            if len(self._upstreams) >= self.timing.max_streams:
                raise ApiError(503, f"the gateway has {len(self._upstreams)} engine streams "
                               "open, its limit ([gateway] max_streams); retry shortly",
                               "pool_exhausted", headers={"Retry-After": "1"})
        except ApiError as exc:
            self.counters.rejected[exc.kind] += 1
            return exc.response()
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        if req.stream:
            return await self._stream(request, req, rid)
        return await self._whole(req, rid)

    # -- proxying with resume -------------------------------------------------------------

    async def _pieces(self, rid: str, req: ClientRequest, progress: Progress,
                      on_out: Callable[[Out], Awaitable[None]]) -> None:
        """Drive the request to its end, resuming after upstream failures."""
        started = time.monotonic()
        first: float | None = None
        last = started

        async def timed(out: Out) -> None:
            nonlocal first, last
            if out.text or out.token_ids:
                last = time.monotonic()
                if first is None:
                    first = last
                    self.latency.ttft.observe(first - started, progress.model)
                if progress.broken_at is not None:
                    self.latency.recovery.observe(last - progress.broken_at, progress.model)
                    progress.broken_at = None
            await on_out(out)

        try:
            await self._drive(rid, req, progress, timed)
        except Diverged as exc:
            raise ApiError(500, f"the request could not be continued after an engine failure "
                           f"without contradicting what was already sent ({exc})",
                           "resume_failed") from None
        finally:
            if first is not None and progress.tokens > 1:
                self.latency.tpot.observe((last - first) / (progress.tokens - 1),
                                          progress.model)
            if self.coordinator is not None:
                self.coordinator.finish(rid)

    async def _drive(self, rid: str, req: ClientRequest, progress: Progress,
                     on_out: Callable[[Out], Awaitable[None]]) -> None:
        assert self._session is not None
        model = req.model
        give_up_at = time.monotonic() + self.timing.recover_within_s
        exclude: set[str] = set()
        broken_worker: str | None = None
        placement: Placement | None = None
        routed: Target | None = None  # where recovery routing sent the request, if anywhere
        shadow = False  # routed to the broken worker's own shadow engine
        scan = StopScan(req.stops, req.include_stop)
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
            if offered is not None and not progress.ids:
                placement = offered  # nothing generated yet: the request starts afresh
            try:
                plan = await self._plan(req, progress, target)
            except EngineRefused as exc:  # not reachable: another worker, as for a start
                log.info("request %s: %s", rid, exc)
                exclude.add(target.worker)
                broken_worker = routed = None
                continue
            plan.apply(progress)
            if plan.resume:
                self.counters.resumes += 1
                log.info("resuming request %s on %s after %d tokens (%s)", rid, target.worker,
                         progress.tokens + len(progress.again_ids), plan.how)
            progress.workers.append(target.worker)
            progress.model = target.model
            upstream_body = plan.body
            upstream_body.setdefault("model", target.model)
            if placement is not None:
                # On the holder's worker (Algorithm 2's resume), or on the worker's own shadow
                # (which loads the checkpoint from the holder on the other node).
                resuming = (routed is not None and routed.worker == target.worker
                            and plan.by_ids and (placement.worker == target.worker
                                                 or shadow))
                if resuming or not progress.ids:
                    upstream_body["kv_transfer_params"] = placement.params(
                        "resume" if resuming else "save")
            routed, shadow = None, False
            upstream = self._open(target, plan.path, upstream_body)
            try:
                while True:
                    try:
                        await self._forward(upstream, target, req, progress, scan, on_out)
                        return
                    except MigrateAway:
                        upstream, target, placement = await self._move(
                            rid, req, progress, placement, upstream, target)
            except EngineRefused as exc:
                log.info("request %s: %s refused it: %s", rid, target.worker, exc)
                exclude.add(target.worker)
                broken_worker = None
            except EngineError as exc:
                self.counters.engine_errors[exc.status] += 1
                log.info("request %s: %s answered %d: %s", rid, target.worker, exc.status, exc)
                raise ApiError(exc.status, str(exc), "engine_error", body=exc.body) from None
            except StreamBroken as exc:
                if self._complete(req, progress):
                    await self._finish(progress, scan, on_out)
                    return
                log.warning("stream from %s broke after %d tokens: %s", target.worker,
                            progress.tokens, exc)
                broken_worker = target.worker  # its shadow may already serve
                if progress.broken_at is None:
                    progress.broken_at = time.monotonic()
                give_up_at = progress.broken_at + self.timing.recover_within_s
                routed = await self._shadow_of(target)
                shadow = routed is not None
                if shadow:
                    self.counters.routed["shadow"] += 1
                    log.info("request %s continues on %s: its shadow engine took over", rid,
                             target.worker)
                else:
                    routed = await self._recovery(rid, model, placement, target.worker,
                                                  self._prefix_tokens(req, progress))
            finally:
                await self._close(upstream)
            if time.monotonic() > give_up_at:
                raise ApiError(503, "the request could not be resumed in time", "unavailable")
            await asyncio.sleep(self.timing.retry_pause_s)

    async def _shadow_of(self, broken: Target) -> Target | None:
        """The broken stream's own worker, when another of its engines has become active
        within the shadow takeover time (well under a second): the stream continues there,
        as on any worker, after its token ids. None for a worker with one engine."""
        assert self._session is not None
        if len(broken.urls) < 2:
            return None
        deadline = time.monotonic() + self.timing.shadow_wait_s
        while True:
            for url in broken.urls:
                try:
                    async with self._session.get(
                            url + "/lumen/engine",
                            timeout=aiohttp.ClientTimeout(total=0.5)) as response:
                        state = (await response.json()).get("state")
                except (aiohttp.ClientError, TimeoutError, ValueError, AttributeError):
                    continue
                if state == "active":
                    # The active engine first: the gateway tries the urls in order.
                    return Target(broken.worker, broken.model,
                                  (url, *(u for u in broken.urls if u != url)))
            if time.monotonic() >= deadline:
                return None
            await asyncio.sleep(0.05)

    @staticmethod
    def _complete(req: ClientRequest, progress: Progress) -> bool:
        """A broken stream that had nothing left to send: its finish_reason was sent, or
        it produced its last token and broke before [DONE]."""
        produced = progress.tokens + len(progress.again_ids)
        return progress.finish_reason is not None or (
            req.limit is not None and produced >= req.limit)

    @staticmethod
    async def _finish(progress: Progress, scan: StopScan,
                      on_out: Callable[[Out], Awaitable[None]]) -> None:
        if progress.finish_reason is not None:
            return
        rest = scan.flush()
        progress.text += rest
        progress.finish_reason = "length"
        await on_out(Out(rest, finish_reason="length"))

    @staticmethod
    def _prefix_tokens(req: ClientRequest, progress: Progress) -> int:
        """The context an interrupted request would recompute, in tokens (tau's input)."""
        if progress.prompt_ids is None:
            return req.prompt_chars() // 4  # not started: an estimate is enough
        return progress.context

    async def _plan(self, req: ClientRequest, progress: Progress, target: Target) -> ResumePlan:
        """The engine request that (re)starts `req` on `target` given its progress."""
        plan = await resume_plan(req, progress, target.worker,
                                 partial(self._detokenize, target),
                                 partial(self._max_model_len, target))
        self.counters.inside_character += plan.pending is not None and not plan.pending.clean
        self.counters.restarts += plan.restarted
        return plan

    async def _max_model_len(self, target: Target) -> int | None:
        """The target model's context length (`/v1/models`), remembered per worker."""
        assert self._session is not None
        known = self._context_of.get(target.worker)
        if known is not None:
            return known
        for url in target.urls:
            try:
                async with self._session.get(
                        url + "/v1/models", timeout=aiohttp.ClientTimeout(total=5.0)) as r:
                    doc = await r.json()
                length = next((m.get("max_model_len") for m in doc.get("data", [])
                               if m.get("id") == target.model), None)
            except (aiohttp.ClientError, TimeoutError, ValueError, AttributeError):
                continue
            if isinstance(length, int) and length > 0:
                self._context_of[target.worker] = length
                return length
        return None

    async def _detokenize(self, target: Target, ids: list[int]) -> str | None:
        """The text of `ids` by the target's tokenizer; None when its engines have no
        /detokenize. Raises EngineRefused when none of them can be reached."""
        assert self._session is not None
        reached = False
        for url in target.urls:
            try:
                async with self._session.post(
                        url + "/detokenize", json={"model": target.model, "tokens": ids},
                        timeout=aiohttp.ClientTimeout(total=10.0)) as response:
                    reached = True
                    if response.status != 200:
                        continue
                    answer = await response.json()
            except (aiohttp.ClientError, TimeoutError, ValueError):
                continue
            text = answer.get("prompt") if isinstance(answer, dict) else None
            if isinstance(text, str):
                return text
        if not reached:
            raise EngineRefused(f"no engine of {target.worker} answered /detokenize")
        return None

    def _open(self, target: Target, path: str, body: dict[str, Any]) -> Upstream:
        assert self._session is not None
        upstream = Upstream(target.worker, self._session, target.urls, path, body,
                            ReadTimeouts(self.timing.first_token_s,
                                         self.timing.token_deadline_s))
        self._upstreams.add(upstream)
        self.in_flight[target.worker] += 1
        self.opened[target.worker] += 1
        return upstream

    async def _close(self, upstream: Upstream) -> None:
        if upstream in self._upstreams:
            self._upstreams.discard(upstream)
            self.in_flight[upstream.worker] -= 1
        await upstream.close()

    async def _forward(self, upstream: Upstream, target: Target, req: ClientRequest,
                       progress: Progress, scan: StopScan,
                       on_out: Callable[[Out], Awaitable[None]]) -> None:
        chat_upstream = upstream.path == "/v1/chat/completions"
        async for piece in upstream.pieces():
            if piece.prompt_token_ids is not None and progress.prompt_ids is None:
                progress.prompt_ids = list(piece.prompt_token_ids)
            if (piece.finish_reason is None and piece.logprobs is None and not scan.stops
                    and not progress.again_ids and progress.pending is None
                    and not progress.again_text):
                # Most chunks: text and ids to pass on as they are (what the general path
                # below does for them, without its checks and copies).
                progress.ids += piece.token_ids
                progress.raw_text += piece.text
                progress.text += piece.text
                await on_out(Out(piece.text, piece.token_ids, [], None, None,
                                 upstream.more_ready()))
                continue
            ids = list(piece.token_ids)
            entries = token_logprobs(piece.logprobs, chat_upstream)
            if progress.again_ids and ids:
                n = min(len(ids), len(progress.again_ids))
                if ids[:n] == progress.again_ids[:n]:
                    progress.ids += ids[:n]
                    del progress.again_ids[:n]
                    ids, entries = ids[n:], entries[n:]
                elif req.want_ids or progress.again_text:
                    raise Diverged(f"generated ids {ids[:n]} where the client has "
                                   f"{progress.again_ids[:n]}")
                else:  # sampled again differently, but the client never saw those ids
                    progress.again_ids.clear()
            progress.ids += ids
            text = piece.text
            if progress.pending is not None:
                text = await pending_text(partial(self._detokenize, target), target.worker,
                                          progress, ids, text, piece.finish_reason is not None)
            progress.raw_text += text
            emitted = text  # what this chunk's ids add to the text, engine or gateway rendered
            if progress.again_text and text:
                n = min(len(text), len(progress.again_text))
                if text[:n] != progress.again_text[:n]:
                    raise Diverged(f"generated {text[:n]!r} where the client has "
                                   f"{progress.again_text[:n]!r}")
                progress.again_text = progress.again_text[n:]
                text = text[n:]
            released = scan.feed(text, allow_stop=progress.tokens >= req.min_tokens)
            finish, stop_reason = piece.finish_reason, piece.stop_reason
            if scan.matched is not None:
                finish, stop_reason = "stop", scan.matched
                if len(ids) > 1 and scan.stop_end is not None and text == emitted:
                    keep = await ids_through_stop(partial(self._detokenize, target),
                                                  progress, ids, text, scan.stop_end)
                    if keep < len(ids):
                        del progress.ids[len(progress.ids) - len(ids) + keep:]
                        ids, entries = ids[:keep], entries[:keep]
            elif finish is not None:
                released += scan.flush()
            progress.text += released
            if finish is not None:
                progress.finish_reason, progress.stop_reason = finish, stop_reason
            await on_out(Out(released, tuple(ids), entries, finish, stop_reason,
                             more=finish is None and upstream.more_ready()))
            if finish is not None:
                return
        if progress.finish_reason is None:  # [DONE] without a finish_reason
            await Gateway._finish(progress, scan, on_out)

    async def _move(self, rid: str, req: ClientRequest, progress: Progress,
                    placement: Placement | None, old: Upstream, old_target: Target
                    ) -> tuple[Upstream, Target, Placement | None]:
        """Migrate a request off a draining worker, as a recovery would move it (Recover:
        resume on its checkpoint holder, or recompute), but make-before-break: the old
        stream is closed only once the new one has produced a token. Returns the upstream
        to read on, its target and the request's checkpoint placement; when the move cannot
        happen, the old ones (the request finishes where it is)."""
        model = req.model
        left = req.left(progress.tokens + len(progress.again_ids))
        if left is not None and left < 1:  # the old stream is about to end anyway
            old.stay(self.timing.migrate_retry_s)
            return old, old_target, placement
        mode: str | None = None
        new_placement = placement
        new_target: Target | None = None
        if progress.ids:
            new_target = await self._recovery(rid, model, placement, old.worker,
                                              self._prefix_tokens(req, progress))
            if (new_target is not None and placement is not None
                    and placement.worker == new_target.worker):
                mode = "resume"
        if new_target is None:
            # Nothing generated yet (or nowhere to resume): start afresh elsewhere, with a
            # checkpoint of its own (the old stream frees its checkpoint when it closes).
            new_target, offered = await self._choose(rid, model, {old.worker}, None,
                                                     want_placement=True)
            if offered is not None and new_target is not None and not progress.ids:
                new_placement, mode = offered, "save"
        if new_target is None or new_target.worker == old.worker:
            log.info("request %s stays on %s until it ends: no other worker serves it",
                     rid, old.worker)
            old.stay(self.timing.migrate_retry_s)
            return old, old_target, placement
        try:
            plan = await self._plan(req, progress, new_target)
        except EngineRefused as exc:
            log.warning("request %s stays on %s: %s", rid, old.worker, exc)
            old.stay(self.timing.migrate_retry_s)
            return old, old_target, placement
        upstream_body = plan.body
        upstream_body.setdefault("model", new_target.model)
        if mode is not None and new_placement is not None and (plan.by_ids or mode == "save"):
            upstream_body["kv_transfer_params"] = new_placement.params(mode)
        new = self._open(new_target, plan.path, upstream_body)
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
        plan.apply(progress)
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
                ckpt = admission.checkpoint
                if self.log_admissions:
                    log_admission(rid, exclude, None if admission.target is None
                                  else admission.target.worker,
                                  None if ckpt is None else ckpt.holder,
                                  f"coordinator epoch {admission.epoch}: {admission.reason}")
                if admission.target is None:
                    return None, None
                return (_target(admission.target),
                        None if ckpt is None else Placement(ckpt.ckpt_id, ckpt.holder,
                                                            ckpt.endpoint))
            view = self._view() or view
        target = choose_worker(view, model, self.in_flight, frozenset(exclude))
        placement = (place(view, target.worker, uuid.uuid4().hex)
                     if target is not None and want_placement else None)
        if self.log_admissions:
            log_admission(rid, exclude, None if target is None else target.worker,
                          None if placement is None else placement.worker,
                          "this gateway's own view (no coordinator answered)"
                          if self.coordinator is not None else "this gateway's own view")
        return target, placement

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

    async def _stream(self, request: web.Request, req: ClientRequest,
                      rid: str) -> web.StreamResponse:
        response = EventStream(headers=SSE_HEADERS)
        renderer = self._renderer(req, rid)
        progress = Progress()

        # Chunks rendered while more output was ready, and the last one until [DONE]: each
        # write is a send to the client, so they go out together (the headers go with the
        # first, the body's end with the last).
        held: list[bytes] = []

        async def write(data: bytes, end: bool = False) -> None:
            if held:
                data = b"".join((*held, data))
                held.clear()
            try:
                if not response.prepared:
                    await response.prepare(request)
                transport = request.transport
                if (not end and transport is not None and not request.protocol.writing_paused
                        and transport.get_write_buffer_size() + len(data)
                        <= transport.get_write_buffer_limits()[1]):
                    # Writing is not paused and this write does not pause it: it cannot wait
                    # for the client, so it needs no timer (one per chunk, otherwise).
                    await response.write(data)
                    return
                async with asyncio.timeout(self.timing.client_write_s):
                    if end:
                        await response.write_eof(data)
                    else:
                        await response.write(data)
            except TimeoutError:
                raise ClientGone(f"the client read nothing for "
                                 f"{self.timing.client_write_s:g} s") from None
            except (ConnectionResetError, aiohttp.ClientConnectionResetError) as exc:
                raise ClientGone(str(exc)) from None

        async def send(out: Out) -> None:
            held.extend(renderer.events(out, progress.prompt_ids))
            if not out.more and held and out.finish_reason is None:
                await write(b"")

        try:
            try:
                await self._pieces(rid, req, progress, send)
            except ApiError as exc:
                self.counters.requests["failed"] += 1
                if not response.prepared:  # nothing sent yet: an HTTP error, as the engine's
                    return exc.response()
                await write(_sse(exc.payload()))
            else:
                self.counters.requests["resumed" if len(progress.workers) > 1 else "ok"] += 1
                if req.include_usage:
                    await write(_sse(renderer.usage_chunk(len(progress.prompt_ids or ()),
                                                          progress.tokens)))
            await write(b"data: [DONE]\n\n", end=True)
        except ClientGone as exc:  # the upstream is already closed
            log.info("request %s: client gone (%s)", rid, exc)
            self.counters.requests["client_gone"] += 1
        return response

    async def _whole(self, req: ClientRequest, rid: str) -> web.Response:
        progress = Progress()

        async def collect(out: Out) -> None:
            progress.logprobs += out.logprobs

        try:
            await self._pieces(rid, req, progress, collect)
        except ApiError as exc:
            self.counters.requests["failed"] += 1
            return exc.response()
        self.counters.requests["resumed" if len(progress.workers) > 1 else "ok"] += 1
        renderer = self._renderer(req, rid)
        return web.json_response(renderer.response(
            progress.text, progress.ids, progress.logprobs, progress.finish_reason or "length",
            progress.stop_reason, progress.prompt_ids))

    @staticmethod
    def _renderer(req: ClientRequest, rid: str) -> Renderer:
        return Renderer(rid, int(time.time()), req.model or "", req.chat, req.want_ids,
                        req.logprobs is not None, req.body["prompt"] if req.echo else None)


_encode = msgspec.json.Encoder()

SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}


class EventStream(web.StreamResponse):
    """A streamed response whose headers go out with its first chunk, in one send (aiohttp
    sends a StreamResponse's headers on their own by default; its Response does not)."""

    _send_headers_immediately = False


def _sse(data: dict[str, Any]) -> bytes:
    return b"data: " + _encode.encode(data) + b"\n\n"


_decode_body = msgspec.json.Decoder().decode


async def _json(request: web.Request) -> Any:
    try:
        body = await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise ApiError(413, f"the body exceeds {MAX_BODY_BYTES} bytes",
                       "invalid_request_error") from None
    try:
        return _decode_body(body)  # UTF-8 JSON, the common case, without the stdlib's cost
    except msgspec.DecodeError:
        pass  # the stdlib's JSON (NaN, another charset) and its error message
    try:
        return json.loads(body.decode(request.charset or "utf-8"))
    except (ValueError, LookupError) as exc:
        raise ApiError(400, f"the body is not valid JSON: {exc}", "invalid_request_error"
                       ) from None


def migrating(view: ClusterView) -> set[str]:
    """Workers under a drain intent with --migrate (naming them or their node)."""
    return {w.name for w in view.workers.values()
            if any(i.kind == "drain" and i.migrate for i in view.intents_for(w))}


def log_admission(rid: str, exclude: set[str], worker: str | None, holder: str | None,
                  decided_by: str) -> None:
    """The `[gateway] log_admissions` line: where a request (re)starts, where its checkpoint
    goes, and who decided (bench/validate_sim.py joins these to the clients' streams)."""
    log.info("admission: request %s to %s, checkpoint %s%s (%s)", rid, worker or "no worker",
             f"on {holder}" if holder else "none",
             f", excluding {', '.join(sorted(exclude))}" if exclude else "", decided_by)


def _target(target: RpcTarget) -> Target:
    return Target(target.worker, target.model, target.urls)

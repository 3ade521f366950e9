"""The sim engine process: vLLM's HTTP surface over `sim_core`, with GMS weights and the
failover lock.

Lifecycle: initialising (weights from GMS, or "from disk" at the preset's bandwidth when
this engine is GMS's writer) -> standby (asleep: no KV pool; waiting on the failover lock)
-> active (lock held, KV pool materialised, serving). An engine that is not active answers
completions with 503 at once, so a caller moves on to the active engine without waiting.

    python -m lumend.engine.sim_server --engine-id w0/0 --port 8100 --model sim-small \
        --gms-socket /run/lumen/w0/gms.sock --failover-lock /run/lumen/w0/failover.lock

The OpenAI surface (`sim_openai`, `sim_responses`) follows vLLM 0.32, `return_token_ids`
included. Model options, each with an environment default (so engines started by lumend
take them from its environment, or from a worker's `args`):
  --tokenizer byte|bpe      LUMEN_SIM_TOKENIZER      (byte: one ASCII byte per token)
  --tokens-per-chunk K      LUMEN_SIM_TOKENS_PER_CHUNK  (1..K tokens per streamed chunk)
  --eos-every N             LUMEN_SIM_EOS_EVERY      (greedy EOS about once per N tokens;
                                                      0: only stop_token_ids end early)
  --max-model-len L         LUMEN_SIM_MAX_MODEL_LEN  (131072, a 128k context: existing
                                                      callers ask for up to 100k tokens)

As vLLM, `--served-model-name NAME [NAME ...]` gives the names it serves under (default: the
preset's name): /v1/models lists them, responses and metrics carry the first, and a request
naming none of them is a 404 (one without `model` is served).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import hashlib
import json
import logging
import math
import os
import time
import uuid
from collections.abc import Coroutine
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from lumend.assist.attach import AssistState, AttachError, AttachRequest
from lumend.checkpoint.security import KeyFileError, client_keys_from_env
from lumend.engine.metric_names import (
    CKPT_REQUESTS_COMPLETE,
    CKPT_REQUESTS_RUNNING,
    deprecated,
)
from lumend.engine.sim_checkpoint import CheckpointPlan, SimCheckpointer
from lumend.engine.sim_core import (
    TTFT_BUCKETS,
    Histogram,
    Sampling,
    Scheduler,
    SimRequest,
    SleepState,
    StepClock,
    StepOutput,
    TokenModel,
)
from lumend.engine.sim_models import MiB, SimModel, sim_model
from lumend.engine.sim_openai import BadRequest, parse, unknown_model
from lumend.engine.sim_output import RequestOutput, bad_request, dumps, stream
from lumend.engine.sim_responses import Responses
from lumend.engine.sim_tokenizer import VOCABULARIES, decode, vocabulary
from lumend.engine.step_fit import StepFitSums
from lumend.failover.lifeline import die_with_supervisor
from lumend.failover.lock import FailoverLock
from lumend.gms.client import GmsClient, GmsError
from lumend.gms.protocol import TensorMeta

log = logging.getLogger("lumend.engine.sim")


@dataclass
class EngineOptions:
    engine_id: str
    host: str
    port: int
    model: SimModel
    seed: int
    time_scale: float
    gms_socket: str | None
    failover_lock: str | None
    tokenizer: str = "byte"
    tokens_per_chunk: int = 1
    eos_every: int = 0
    max_model_len: int = 131072
    served_model_names: tuple[str, ...] = ()  # --served-model-name; () is the preset's name

    @property
    def served_names(self) -> tuple[str, ...]:
        return self.served_model_names or (self.model.name,)


class SimEngine:
    def __init__(self, opts: EngineOptions) -> None:
        self.opts = opts
        self.state = "initialising"
        self.model = TokenModel(vocabulary(opts.tokenizer), opts.eos_every,
                                opts.tokens_per_chunk)
        self.scheduler = Scheduler(opts.seed, opts.model.cost, opts.model.limits, self.model)
        self.clock = StepClock()
        self.step_fit = StepFitSums()  # the step-cost fit's sums (lumend.engine.step_fit)
        self.weights_source = ""
        self.weights_seconds = 0.0
        self.started_at = time.time()
        self.activated_at: float | None = None
        self.lock = (FailoverLock(opts.failover_lock, f"{opts.engine_id} pid {os.getpid()}")
                     if opts.failover_lock else None)
        self._gms: GmsClient | None = None
        self._weights: Any = None  # the mapping (kept for the engine's life)
        self._kv_pool: bytearray | None = None
        self._work = asyncio.Event()
        self._released = asyncio.Event()
        self.checkpointer = SimCheckpointer(opts.model, opts.seed)
        self.saving: dict[str, tuple[SimRequest, CheckpointPlan]] = {}
        self._background: set[asyncio.Task[Any]] = set()
        self.requests_total = 0
        self.refused_total = 0
        # vLLM's `vllm:time_to_first_token_seconds`: from the request's arrival at this
        # engine's API server to its first token out, in wall-clock seconds (queueing and
        # any lag behind the cost model included); a gateway's TTFT minus it is the
        # serving path's share (bench/serving_overhead.py).
        self.ttft = Histogram(TTFT_BUCKETS)
        self.memory = SleepState()  # vLLM-style sleep: what is freed, what wake restores
        self.weight_loads = {"disk": 0, "gms": 0}
        self._layout_hash: str | None = None
        # Draft-assist (survivor side): drafter rounds reach it with the checkpoint keys.
        self.assist = AssistState(opts.model.name, opts.engine_id, client_keys_from_env())

    # -- lifecycle ------------------------------------------------------------------------

    async def run(self) -> None:
        started = time.monotonic()
        await self._load_weights()
        self.weights_seconds = time.monotonic() - started
        await asyncio.sleep(self.opts.model.init_s * self.opts.time_scale)
        while True:
            self.state = "standby"
            log.info("%s standby (weights from %s in %.2f s)", self.opts.engine_id,
                     self.weights_source, self.weights_seconds)
            if self.lock is not None:
                await self.lock.acquire()
            if "weights" not in self.memory.held:  # slept at level 2 while standby
                await self._restore_weights()
            self._wake()
            await self._released.wait()
            self._released.clear()

    def _wake(self) -> None:
        self._kv_pool = bytearray(self.opts.model.kv_cache_bytes)
        self.memory.wake()  # the lock holder serves: nothing stays asleep
        self.state = "active"
        self.activated_at = time.time()
        log.info("%s active", self.opts.engine_id)

    async def release(self, drain_timeout_s: float) -> None:
        """Planned switchover: finish running work, sleep, and hand the lock over."""
        if self.state != "active":
            raise web.HTTPConflict(text=f"engine {self.opts.engine_id} is {self.state}")
        self.state = "releasing"
        deadline = time.monotonic() + drain_timeout_s
        while not self.scheduler.idle() and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        self._kv_pool = None
        if self.lock is not None:
            await self.lock.hand_over()
        self._released.set()

    async def _load_weights(self) -> None:
        model = self.opts.model
        if self.opts.gms_socket is None:
            await self._read_from_disk()
            self._weights = self._fill(bytearray(model.weight_bytes))
            self.weights_source = "disk"
            self.weight_loads["disk"] += 1
            return
        self._gms = await _connect_gms(self.opts.gms_socket, timeout_s=60.0)
        role = await asyncio.to_thread(self._gms.hello, "auto", 600.0)
        if role == "writer":
            await self._read_from_disk()
            await asyncio.to_thread(self._publish_weights)
            self.weights_source = "disk"
        else:
            await asyncio.to_thread(self._map_weights)
            self.weights_source = "gms"
        self.weight_loads[self.weights_source] += 1

    async def _read_from_disk(self) -> None:
        await asyncio.sleep(self.opts.model.load_seconds() * self.opts.time_scale)

    def _publish_weights(self) -> None:
        assert self._gms is not None
        size = self.opts.model.weight_bytes
        alloc, _ = self._gms.allocate("weights", size)
        mapped = self._gms.map(alloc)
        self._fill(mapped.mem)
        self._gms.put_tensor(TensorMeta(name="weights", allocation=alloc, offset=0,
                                        shape=[size], dtype="uint8"))
        self._layout_hash = self._gms.commit()
        self._weights = mapped.mem

    def _map_weights(self) -> None:
        assert self._gms is not None
        _, tensors, committed = self._gms.layout()  # verifies the committed layout hash
        if self._layout_hash is not None and committed != self._layout_hash:
            raise GmsError(f"GMS weights changed while {self.opts.engine_id} slept (layout "
                           f"{self._layout_hash[:12]}, now {str(committed)[:12]})")
        self._layout_hash = committed
        (weights,) = [t for t in tensors if t.name == "weights"]
        self._weights = self._gms.map(weights.allocation).mem

    def _fill(self, buffer: Any) -> Any:
        pattern = hashlib.shake_256(self.opts.seed.to_bytes(8, "big")).digest(MiB)
        view = memoryview(buffer)
        for offset in range(0, len(view), MiB):
            n = min(MiB, len(view) - offset)
            view[offset: offset + n] = pattern[:n]
        return buffer

    # -- sleep and wake (vLLM's /sleep, /wake_up) -----------------------------------------

    async def sleep(self, level: int, mode: str) -> None:
        if self.state == "initialising":
            raise web.HTTPConflict(text=f"engine {self.opts.engine_id} is initialising")
        if mode not in ("abort", "wait"):
            raise ValueError(f"sleep mode must be 'abort' or 'wait', got {mode!r}")
        drop = self.memory.sleep(level)  # from now on completions get 503 at once
        if mode == "wait":
            while not self.scheduler.idle():
                await asyncio.sleep(0.01)
        else:  # vLLM's default: running requests end now
            for request in [*self.scheduler.running, *self.scheduler.waiting]:
                if not request.cancelled:
                    request.cancelled = True
                    request.emit(None)
        if "kv_cache" in drop:
            self._kv_pool = None
        if "weights" in drop:
            self._drop_weights()
        log.info("%s asleep at level %d (freed %s)", self.opts.engine_id, level,
                 ", ".join(drop) or "nothing")

    async def wake_up(self, tags: list[str] | None) -> bool:
        if self.state == "initialising":
            raise web.HTTPConflict(text=f"engine {self.opts.engine_id} is initialising")
        restore = self.memory.wake(tags)
        if "weights" in restore:
            try:
                await self._restore_weights()
            except BaseException:
                self.memory.held.discard("weights")
                if self.memory.level is None:
                    self.memory.level = 2
                raise
        if "kv_cache" in restore and self.state == "active":
            self._kv_pool = bytearray(self.opts.model.kv_cache_bytes)
        return not self.memory.sleeping

    def _drop_weights(self) -> None:
        if self._weights is not None and hasattr(self._weights, "close"):
            self._weights.close()  # the mmap of GMS pages
        self._weights = None
        if self._gms is not None:
            self._gms.close()  # leave the GMS session: the weights stay there for others
            self._gms = None

    async def _restore_weights(self) -> None:
        """Map the weights again: from GMS when it holds them (no disk read), else load
        them from disk (and publish them when this engine becomes GMS's writer)."""
        self.memory.held.add("weights")
        await self._load_weights()
        log.info("%s weights restored from %s", self.opts.engine_id, self.weights_source)

    def weights_digest(self) -> str:
        return hashlib.blake2b(memoryview(self._weights), digest_size=16).hexdigest()

    # -- batching loop --------------------------------------------------------------------

    async def batch_loop(self) -> None:
        while True:
            if self.scheduler.idle():
                self.clock.idle()
                self._work.clear()
                await self._work.wait()
                continue
            prefilled = self.scheduler.prefill_tokens
            duration, decoding = self.scheduler.begin_step()
            extra = self.scheduler.prefill_tokens - prefilled
            attachment, counters = self.assist.attachment, self.assist.current
            drafts = None
            if attachment is not None and counters is not None:
                drafts = await attachment.drafts(_contexts(decoding), counters)
                drafted = sum(len(d) for d in drafts.values())
                duration += self.scheduler.verify_seconds(drafted)
                extra += drafted
            step_s = duration * self.opts.time_scale  # the step as paced: its time base
            self.step_fit.observe(step_s, extra, len(decoding))
            await asyncio.sleep(self.clock.begin(time.monotonic(), step_s))
            self.clock.ended(time.monotonic())
            s = self.scheduler
            drafted, accepted = s.drafted_tokens, s.accepted_tokens
            # Prefill times on the paced steps' timeline, as lumen_sim_step_seconds_total.
            s.end_step(decoding, drafts, step_s)
            if attachment is not None and counters is not None:
                counters.drafted_tokens += s.drafted_tokens - drafted
                counters.accepted_tokens += s.accepted_tokens - accepted
                await attachment.finished(r.id for r in s.running)
            for request, plan in list(self.saving.values()):
                if request.cancelled or request.finished:
                    del self.saving[request.id]
                else:
                    self.checkpointer.save_new_blocks(request, plan)

    def background(self, work: Coroutine[Any, Any, Any]) -> None:
        task = asyncio.get_running_loop().create_task(work)
        self._background.add(task)  # the loop keeps only weak references to tasks
        task.add_done_callback(self._background.discard)

    def submit(self, prompt: list[int], max_tokens: int, *, restored: int = 0,
               plan: CheckpointPlan | None = None, request_id: str | None = None,
               sampling: Sampling | None = None,
               ) -> tuple[SimRequest, asyncio.Queue[StepOutput | None]]:
        queue: asyncio.Queue[StepOutput | None] = asyncio.Queue()
        request = SimRequest(id=request_id or uuid.uuid4().hex, prompt=prompt,
                             max_tokens=max_tokens, emit=queue.put_nowait,
                             prefilled=restored, sampling=sampling or Sampling())
        if plan is not None and plan.mode == "save":
            self.saving[request.id] = (request, plan)
        self.scheduler.add(request)
        self.requests_total += 1
        self._work.set()
        return request, queue


def _histogram_lines(name: str, labels: str, histogram: Histogram) -> list[str]:
    """A histogram in the Prometheus text format, as prometheus_client writes vLLM's (its
    TYPE line: the only one here, so that a Prometheus parser reads one histogram)."""
    def bound(le: float) -> str:
        return "+Inf" if le == math.inf else repr(float(le))

    return [f"# TYPE {name} histogram",
            *(f'{name}_bucket{{{labels},le="{bound(le)}"}} {n}'
              for le, n in histogram.cumulative()),
            f"{name}_count{{{labels}}} {histogram.count}",
            f"{name}_sum{{{labels}}} {histogram.sum!r}"]


def _contexts(decoding: list[SimRequest]) -> dict[str, list[int]]:
    """The committed context of each request that decodes this step (a request whose
    prompt finishes this step has no token to draft after yet)."""
    return {r.id: r.prompt + r.output for r in decoding if r.output and not r.cancelled}


async def _connect_gms(path: str, timeout_s: float) -> GmsClient:
    """Connect, waiting while the GMS server (re)starts: the supervisor may have just
    replaced a dead one."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return await asyncio.to_thread(GmsClient, path)
        except GmsError:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.05)


# -- HTTP -------------------------------------------------------------------------------


def _error(status: int, message: str, kind: str) -> web.Response:
    return web.json_response({"error": {"message": message, "type": kind, "code": status}},
                             status=status)


def _unknown_model(body: object, served: tuple[str, ...]) -> web.Response | None:
    error = unknown_model(body, served)
    return None if error is None else web.json_response(error, status=404)


def build_app(engine: SimEngine) -> web.Application:
    routes = web.RouteTableDef()
    opts = engine.opts
    served = opts.served_names

    @routes.get("/health")
    async def health(_: web.Request) -> web.Response:
        if engine.state == "initialising":
            return _error(503, "initialising", "unavailable")
        return web.Response(text="")

    @routes.get("/is_sleeping")
    async def is_sleeping(_: web.Request) -> web.Response:
        return web.json_response({"is_sleeping": engine.state != "active"
                                  or engine.memory.sleeping})

    @routes.post("/sleep")
    async def sleep(request: web.Request) -> web.Response:
        try:
            level = int(request.query.get("level", "1"))
            await engine.sleep(level, request.query.get("mode", "abort"))
        except ValueError as exc:
            return _error(400, f"bad request: {exc}", "invalid_request_error")
        return web.json_response({"status": "sleeping", "level": level})

    @routes.post("/wake_up")
    async def wake_up(request: web.Request) -> web.Response:
        tags = request.query.getall("tags", []) or None
        try:
            awake = await engine.wake_up(tags)
        except ValueError as exc:
            return _error(400, f"bad request: {exc}", "invalid_request_error")
        except GmsError as exc:
            return _error(503, f"weights could not be restored: {exc}", "unavailable")
        return web.json_response({"status": "awake" if awake else "sleeping", "tags": tags})

    @routes.get("/lumen/engine")
    async def info(_: web.Request) -> web.Response:
        return web.json_response({
            "id": opts.engine_id, "state": engine.state, "pid": os.getpid(),
            "model": opts.model.name, "served_model_names": list(served),
            "weights_source": engine.weights_source,
            "weights_seconds": engine.weights_seconds, "activated_at": engine.activated_at,
            "running": len(engine.scheduler.running), "waiting": len(engine.scheduler.waiting),
            "sleeping": engine.memory.sleeping, "sleep_level": engine.memory.level,
            "memory": sorted(engine.memory.held), "weight_loads": engine.weight_loads,
            "assist": engine.assist.describe(),
        })

    @routes.post("/lumen/assist")
    async def attach(request: web.Request) -> web.Response:
        # Well below a step (the drafts' wait adds to every step): half the fixed step cost.
        default = max(0.001, 0.5 * opts.model.cost.a * opts.time_scale)
        try:
            body = await request.json()
            engine.assist.attach(AttachRequest.parse(body, default))
        except (AttachError, json.JSONDecodeError) as exc:
            return _error(400, f"bad request: {exc}", "invalid_request_error")
        return web.json_response(engine.assist.describe())

    @routes.delete("/lumen/assist")
    async def detach(_: web.Request) -> web.Response:
        engine.assist.detach()
        return web.json_response(engine.assist.describe())

    @routes.get("/lumen/assist")
    async def assist(_: web.Request) -> web.Response:
        return web.json_response(engine.assist.describe())

    @routes.get("/lumen/weights_digest")
    async def digest(_: web.Request) -> web.Response:
        if engine.state == "initialising":
            return _error(503, "initialising", "unavailable")
        if engine._weights is None:
            return _error(503, "asleep: the weights are not mapped", "unavailable")
        return web.json_response({"digest": await asyncio.to_thread(engine.weights_digest)})

    @routes.post("/lumen/release")
    async def release(request: web.Request) -> web.Response:
        timeout = float(request.query.get("drain_timeout_s", "30"))
        await engine.release(timeout)
        return web.json_response({"released": True})

    @routes.get("/metrics")
    async def metrics(_: web.Request) -> web.Response:
        s = engine.scheduler
        lines = [
            f'vllm:num_requests_running{{model_name="{served[0]}"}} {len(s.running)}',
            f'vllm:num_requests_waiting{{model_name="{served[0]}"}} {len(s.waiting)}',
            f'vllm:kv_cache_usage_perc{{model_name="{served[0]}"}} {s.kv_usage()}',
            f"lumen_sim_requests_total {engine.requests_total}",
            f"lumen_sim_refused_total {engine.refused_total}",
            f"lumen_sim_tokens_generated_total {s.tokens_generated}",
            f"lumen_sim_steps_total {s.steps}",
            f"lumen_sim_step_seconds_total {engine.clock.modelled_s}",
            f"lumen_sim_step_late_seconds_total {engine.clock.late_s}",
            f"lumen_sim_step_overrun_seconds_total {engine.clock.overrun_s}",
            *engine.step_fit.metric_lines(),
            f'lumen_sim_active {1 if engine.state == "active" else 0}',
            f"lumen_sim_prefill_tokens_total {s.prefill_tokens}",
            # The same count under vLLM's name for prompt tokens computed (not restored),
            # which lumend reads into the worker's load (prefill_tokens) from both kinds.
            f'vllm:prompt_tokens_by_source_total{{model_name="{served[0]}",'
            f'source="local_compute"}} {s.prefill_tokens}',
            # vLLM's per-request prefill time (scheduled -> first token) on the paced
            # steps' timeline (modelled x time scale, as the step seconds above): lumend
            # reads its sum / the computed prompt tokens as the prefill cost per token.
            *_histogram_lines("vllm:request_prefill_time_seconds",
                              f'model_name="{served[0]}"', s.prefill_time),
            *_histogram_lines("vllm:time_to_first_token_seconds",
                              f'model_name="{served[0]}"', engine.ttft),
            f"lumen_sim_sleeping {1 if engine.memory.sleeping else 0}",
            f'lumen_sim_weight_loads_total{{source="disk"}} {engine.weight_loads["disk"]}',
            f'lumen_sim_weight_loads_total{{source="gms"}} {engine.weight_loads["gms"]}',
        ]
        # Checkpoint coverage (gauges lumend reads into the worker's load): running
        # requests, and those of them whose checkpoint has lost no block so far.
        complete = engine.checkpointer.count_complete(s.running, engine.saving)
        for name, value in ((CKPT_REQUESTS_RUNNING, len(s.running)),
                            (CKPT_REQUESTS_COMPLETE, complete)):
            lines += [f'{n}{{model_name="{served[0]}"}} {value}'
                      for n in (name, deprecated(name))]
        c = engine.checkpointer.counters
        lines += [
            f"lumen_sim_ckpt_blocks_saved_total {c.blocks_saved}",
            f"lumen_sim_ckpt_blocks_dropped_total {c.blocks_dropped}",
            f"lumen_sim_restored_tokens_total {c.restored_tokens}",
            f"lumen_sim_restore_misses_total {c.restore_misses}",
            f"lumen_sim_restore_mismatches_total {c.restore_mismatches}",
        ]
        lines += c.metric_lines()  # restore counters, read into the worker's load by lumend
        lines += engine.assist.metric_lines()
        return web.Response(text="\n".join(lines) + "\n", content_type="text/plain")

    @routes.get("/v1/models")
    async def models(_: web.Request) -> web.Response:
        created = int(engine.started_at)
        return web.json_response({"object": "list", "data": [{
            "id": name, "object": "model", "created": created,
            "owned_by": "lumen-sim", "root": opts.model.name, "parent": None,
            "max_model_len": opts.max_model_len, "permission": []} for name in served]})

    @routes.post("/tokenize")
    async def tokenize(request: web.Request) -> web.Response:
        """vLLM's /tokenize: a prompt, or chat messages rendered with the sim template."""
        try:
            body = await request.json()
            if (unknown := _unknown_model(body, served)) is not None:
                return unknown
            chat = isinstance(body, dict) and "messages" in body
            gen = parse({**body, "max_tokens": 1} if isinstance(body, dict) else body, chat,
                        engine.model.vocab, opts.max_model_len + 1)
        except json.JSONDecodeError as exc:
            return bad_request(BadRequest(f"the body is not JSON: {exc}"))
        except BadRequest as exc:
            return bad_request(exc)
        return web.json_response({"count": len(gen.prompt), "max_model_len":
                                  opts.max_model_len, "tokens": gen.prompt,
                                  "token_strs": None})

    @routes.post("/detokenize")
    async def detokenize(request: web.Request) -> web.Response:
        try:
            body = await request.json()
            if (unknown := _unknown_model(body, served)) is not None:
                return unknown
            tokens = body["tokens"]
            if not all(isinstance(t, int) and 0 <= t < engine.model.vocab.size
                       for t in tokens):
                raise ValueError("tokens must be token ids of the vocabulary")
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
            return bad_request(BadRequest(f"bad request: {exc}", "tokens"))
        return web.json_response({"prompt": decode(engine.model.vocab, tokens)})

    async def completion(request: web.Request, chat: bool) -> web.StreamResponse:
        arrived = time.monotonic()
        if engine.state != "active" or engine.memory.sleeping:
            engine.refused_total += 1
            state = "asleep" if engine.memory.sleeping else engine.state
            return _error(503, f"engine {opts.engine_id} is {state}, not active; "
                          "send the request to the worker's active engine", "unavailable")
        try:
            body = await request.json()
            if (unknown := _unknown_model(body, served)) is not None:
                return unknown
            gen = parse(body, chat, engine.model.vocab, opts.max_model_len)
        except json.JSONDecodeError as exc:
            return bad_request(BadRequest(f"the body is not JSON: {exc}"))
        except BadRequest as exc:
            return bad_request(exc)
        plan = gen.plan
        restored = 0
        request_id = uuid.uuid4().hex  # also the checkpoint's owner while it runs here
        if plan is not None and plan.mode == "resume":
            restored = await engine.checkpointer.restore(gen.prompt, plan, request_id)
        # A save plan never holds the request up: the pages it saves before its holder's
        # first connection wait for it in the streamer (ENGINE_CONNECT_GRACE_S).
        sim_request, queue = engine.submit(gen.prompt, gen.max_tokens, restored=restored,
                                           plan=plan, request_id=request_id,
                                           sampling=gen.sampling)
        responses = Responses(gen, engine.model, opts.seed, served[0],
                              ("chatcmpl-" if chat else "cmpl-") + sim_request.id)
        output = RequestOutput(gen, engine.model, sim_request, queue,
                               lambda: engine.ttft.observe(time.monotonic() - arrived))
        try:
            if gen.stream:
                return await stream(request, responses, output)
            async for _ in output.steps():
                pass
        finally:
            sim_request.cancelled = not sim_request.finished
            if plan is not None:  # the request is over: its checkpoint is not needed
                engine.background(engine.checkpointer.finish(plan, sim_request.id))
        whole = responses.chat if chat else responses.completion
        return web.json_response(whole(output.tokens, output.positions, output.text.text,
                                       output.finish, output.stop_reason),
                                 dumps=dumps)

    @routes.post("/v1/completions")
    async def completions(request: web.Request) -> web.StreamResponse:
        return await completion(request, chat=False)

    @routes.post("/v1/chat/completions")
    async def chat_completions(request: web.Request) -> web.StreamResponse:
        return await completion(request, chat=True)

    app = web.Application()
    app.add_routes(routes)
    return app


async def serve(opts: EngineOptions) -> None:
    engine = SimEngine(opts)
    runner = web.AppRunner(build_app(engine), access_log=None)
    await runner.setup()
    await web.TCPSite(runner, opts.host, opts.port).start()
    log.info("sim engine %s on %s:%d (model %s, pid %d)", opts.engine_id, opts.host,
             opts.port, opts.model.name, os.getpid())
    await asyncio.gather(engine.run(), engine.batch_loop())


MODEL_OPTIONS = {  # option: (environment variable, default)
    "tokenizer": ("LUMEN_SIM_TOKENIZER", "byte"),
    "tokens_per_chunk": ("LUMEN_SIM_TOKENS_PER_CHUNK", "1"),
    "eos_every": ("LUMEN_SIM_EOS_EVERY", "0"),
    "max_model_len": ("LUMEN_SIM_MAX_MODEL_LEN", "131072"),
}


def _model_options(parser: argparse.ArgumentParser) -> None:
    """The model's options; each defaults to its environment variable, so engines that
    lumend starts take them from its environment (or from a worker's `args`)."""

    def default(option: str) -> str:
        name, value = MODEL_OPTIONS[option]
        return os.environ.get(name, value)

    parser.add_argument("--tokenizer", default=default("tokenizer"),
                        help="byte: one printable byte per token; bpe: byte-level BPE-like, "
                        "multi-byte text, non-canonical token sequences ($LUMEN_SIM_TOKENIZER)")
    # String defaults go through `type`: a bad variable is reported like a bad option.
    parser.add_argument("--tokens-per-chunk", type=int, default=default("tokens_per_chunk"),
                        help="each streamed chunk carries 1..K tokens, as with speculative "
                        "decoding ($LUMEN_SIM_TOKENS_PER_CHUNK)")
    parser.add_argument("--eos-every", type=int, default=default("eos_every"),
                        help="greedy generation ends with EOS about once per N tokens; 0: "
                        "never, only stop_token_ids end a request early ($LUMEN_SIM_EOS_EVERY)")
    parser.add_argument("--max-model-len", type=int, default=default("max_model_len"),
                        help="the context length ($LUMEN_SIM_MAX_MODEL_LEN)")


def _check_model_options(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    def bad(option: str, rule: str) -> None:
        name = MODEL_OPTIONS[option][0]
        parser.error(f"--{option.replace('_', '-')} (or {name}) {rule}, got "
                     f"{getattr(args, option)!r}")

    if args.tokenizer not in VOCABULARIES:
        bad("tokenizer", f"must be one of {', '.join(VOCABULARIES)}")
    if args.tokens_per_chunk < 1:
        bad("tokens_per_chunk", "must be at least 1")
    if args.eos_every < 0:
        bad("eos_every", "must be 0 (never) or more")
    if args.max_model_len < 2:
        bad("max_model_len", "must be at least 2")


def main() -> None:
    die_with_supervisor()
    parser = argparse.ArgumentParser(description="LUMEN sim engine")
    parser.add_argument("--engine-id", required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--model", default="sim-small")
    parser.add_argument("--served-model-name", "--served_model_name", nargs="+", default=[],
                        help="the names it serves under, as vLLM's (default: the model's)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--time-scale", type=float, default=1.0,
                        help="multiplies every modelled duration (0.1 = ten times faster)")
    parser.add_argument("--gms-socket")
    parser.add_argument("--failover-lock")
    parser.add_argument("--log-level", default="INFO")
    parser.add_argument("--init-seconds", type=float, default=None,
                        help="the engine's initialisation after its weights load (before "
                        "--time-scale; default: the model preset's), so a cold restart "
                        "can be made as long as a large model's")
    _model_options(parser)
    args = parser.parse_args()
    _check_model_options(parser, args)
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        model = sim_model(args.model)
    except ValueError as exc:
        parser.error(str(exc))
    if args.init_seconds is not None:
        if not args.init_seconds >= 0:  # also refuses nan
            parser.error(f"--init-seconds must be 0 or more, got {args.init_seconds!r}")
        model = dataclasses.replace(model, init_s=args.init_seconds)
    try:
        asyncio.run(serve(EngineOptions(
            engine_id=args.engine_id, host=args.host, port=args.port, model=model,
            seed=args.seed, time_scale=args.time_scale, gms_socket=args.gms_socket,
            failover_lock=args.failover_lock, tokenizer=args.tokenizer,
            tokens_per_chunk=args.tokens_per_chunk, eos_every=args.eos_every,
            max_model_len=args.max_model_len,
            served_model_names=tuple(args.served_model_name),
        )))
    except KeyFileError as exc:
        parser.exit(2, f"sim engine {args.engine_id}: {exc}\n")


if __name__ == "__main__":
    main()

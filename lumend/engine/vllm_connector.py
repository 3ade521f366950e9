"""LumenConnector: vLLM's KV connector for LUMEN checkpoints.

Loaded by vLLM itself, inside its engine-core and worker processes:

    --kv-transfer-config '{"kv_connector": "LumenConnector",
                           "kv_connector_module_path": "lumend.engine.vllm_connector",
                           "kv_role": "kv_both", "kv_load_failure_policy": "recompute"}'

A request asks for a checkpoint in its body, exactly as for the sim engine:
    "kv_transfer_params": {"lumen": {"ckpt_id": ..., "holder": "tcp://host:port",
                                     "worker": ..., "mode": "save" | "resume"}}

Save: the blocks that became full in a step (decode blocks included) are gathered out of
the paged KV cache after the step's forward (`wait_for_save`), in one batch; on CUDA the copy
to pinned host memory runs on a side stream and the pages are handed to the holder once it
completed (a later step), so the step never waits for it. Pages go to the holder without
waiting (`CheckpointStreamer`: drops are counted, never block decoding). Resume: the request
arrives as a new prompt (prompt + tokens already generated); vLLM's chained block hashes of
that prompt are the hashes the saving engine streamed, so the scheduler asks the holder how
many consecutive blocks it has (one `LOOKUP` of all of them, answered without the scheduler
waiting) and the worker fetches them beside the engine (vLLM's asynchronous load: the
request waits in WAITING_FOR_REMOTE_KVS while its `GET`s are in flight, the pages are written
into its blocks as they arrive, between forwards, and the other requests keep decoding);
the request is scheduled once its pages are in. Best effort: any miss, bad page or silent
holder means recompute, never an error to the client (with
`kv_load_failure_policy: recompute`).

Pages are opaque bytes, one page = one block of every layer of this tensor-parallel rank
(`lumend.engine.kv_pages`); they only move between engines with the same layout fingerprint
(page format, model, KV dtype, block size, layers, heads, head size, tp size, platform, hash
algorithm).
"""

from __future__ import annotations

import inspect
import logging
import os
import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import vllm
import zmq
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)

from lumend.checkpoint.fetch import PageFetch
from lumend.checkpoint.streamer import (
    ENGINE_CONNECT_GRACE_S,
    CheckpointStreamer,
    PageLayout,
    StreamedTally,
)
from lumend.engine.kv_pages import PAGE_FORMAT, KvPages, StagedPages
from lumend.engine.metric_names import (
    CKPT_REQUESTS_COMPLETE,
    CKPT_REQUESTS_RUNNING,
    ckpt_counter,
    deprecated,
)
from lumend.engine.sim_checkpoint import CheckpointPlan, parse_plan
from lumend.engine.step_fit import FIT_KEYS, FIT_MEANINGS, METRIC_PREFIX, StepFitSums, StepTimer

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

# Under "vllm." so that vLLM's logging configuration (handlers, level) applies here too.
log = logging.getLogger("vllm.lumen_connector")

# The connector API is experimental and changes between releases: this module is written
# against these versions, and refuses to load elsewhere rather than misbehave.
SUPPORTED_VLLM = ((0, 32), (0, 33))
# A resumed request's LOOKUP: answered within LOOKUP_INLINE_WAIT_S (a live holder, a round
# trip), it is scheduled at once; else it waits (vLLM asks again at its next pass, other
# requests go on) up to LOOKUP_TIMEOUT_S, then recomputes. Waiting inline for the whole
# timeout stalled the engine's every request for each request resumed from a holder that did
# not answer.
LOOKUP_INLINE_WAIT_S = 0.005
LOOKUP_TIMEOUT_S = 0.5
GET_TIMEOUT_S = 2.0  # for each next page of a resumed request
# A holder whose GETs timed out is not asked again for this long: the loads of the next
# resumed requests recompute at once instead of each waiting GET_TIMEOUT_S first.
SILENT_HOLDER_S = 10.0
# A step with nothing to compute while loads are in flight (vLLM steps again at once): the
# worker waits this long for their pages instead of spinning the engine loop.
IDLE_LOAD_WAIT_S = 0.005
# Host memory per engine rank for pages in flight, each way: saves copied out and not sent
# yet; loads asked and not written yet (kv_connector_extra_config {"in_flight_mib": N}).
# The loads' share is what a resume can bring in per step: pages are asked for and written
# between forwards, so a smaller window made a restore slower than its link (16 MiB per
# step: 0.5 GB/s at 30 ms steps).
IN_FLIGHT_MIB = 256
# At most this many GETs in flight (all loads together): below ZeroMQ's default high-water
# marks (1000 messages per pipe), where a holder's replies would be dropped.
GET_WINDOW = 512


def _check_vllm() -> None:
    parts = vllm.__version__.split(".")
    try:
        major_minor = (int(parts[0]), int(parts[1]))
    except (IndexError, ValueError):
        major_minor = (-1, -1)
    if major_minor not in SUPPORTED_VLLM:
        supported = ", ".join(f"{a}.{b}" for a, b in SUPPORTED_VLLM)
        raise ImportError(f"LumenConnector is written against vLLM {supported}; this is "
                          f"vLLM {vllm.__version__}. Install a supported vLLM or update "
                          "lumend.engine.vllm_connector for this one.")
    params = list(inspect.signature(KVConnectorBase_V1.__init__).parameters)
    if params != ["self", "vllm_config", "role", "kv_cache_config"]:
        raise ImportError("KVConnectorBase_V1.__init__ takes "
                          f"{params[1:]}, not (vllm_config, role, kv_cache_config): this vLLM's "
                          "connector API differs from the one LumenConnector is written for.")


_check_vllm()


@dataclass
class SaveSpec:
    """One block to copy out after this step's forward and stream to the holder."""

    plan: CheckpointPlan
    request_id: str
    block_index: int
    block_id: int
    block_hash: bytes
    token_count: int


@dataclass
class LoadSpec:
    """Blocks of a resumed request to fetch from the holder (vLLM allocated them; the
    request waits until the worker reports them loaded)."""

    plan: CheckpointPlan
    request_id: str
    block_ids: list[int]
    block_hashes: list[bytes]


@dataclass
class LumenConnectorMetadata(KVConnectorMetadata):
    saves: list[SaveSpec] = field(default_factory=list)
    loads: list[LoadSpec] = field(default_factory=list)
    idle: bool = False  # the step computes nothing (only transfers are under way)


@dataclass
class _Load:
    """A resumed request's pages on their way in (worker side)."""

    spec: LoadSpec
    fetch: PageFetch | None  # None: the holder is silent, nothing is asked


@dataclass
class _Tracked:
    """What the scheduler side keeps per request with a checkpoint plan."""

    request: Request
    plan: CheckpointPlan
    block_ids: list[int] = field(default_factory=list)
    saved: int = 0  # blocks 0..saved-1 are queued for saving (or were loaded)
    incomplete: bool = False  # the worker lost a block of it (dropped or refused)
    load_from: int = 0  # first block loaded (after the local prefix-cache hit)
    load_block_ids: list[int] = field(default_factory=list)  # the blocks it loaded into


@dataclass(frozen=True)
class _PendingLookup:
    """A LOOKUP sent and not answered yet (scheduler side)."""

    streamer: CheckpointStreamer
    call: int
    deadline: float


def layout_fingerprint(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig) -> str:
    """What two engines must share for a page of one to be valid in the other."""
    groups = kv_cache_config.kv_cache_groups
    if len(groups) != 1:
        raise ValueError(f"LumenConnector supports models with one KV cache group (full "
                         f"attention everywhere); this model has {len(groups)}. Run it "
                         "without LUMEN checkpoints.")
    spec = groups[0].kv_cache_spec
    layers = len(groups[0].layer_names)
    model = vllm_config.model_config.model
    tp = vllm_config.parallel_config.tensor_parallel_size
    from vllm.platforms import current_platform

    dtype = str(getattr(spec, "dtype", "?")).removeprefix("torch.")
    heads = getattr(spec, "num_kv_heads", "?")
    head_size = getattr(spec, "head_size", "?")
    hash_algo = vllm_config.cache_config.prefix_caching_hash_algo
    return (f"vllm/page{PAGE_FORMAT}/{current_platform.device_type}/{dtype}/"
            f"bs{spec.block_size}/L{layers}/"
            f"H{heads}x{head_size}/tp{tp}/{hash_algo}/{os.path.basename(model)}")


class LumenConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole,
                 kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        served = vllm_config.model_config.served_model_name or vllm_config.model_config.model
        self._model: str = served[0] if isinstance(served, list) else served
        self._block_size = vllm_config.cache_config.block_size
        self._fingerprint = layout_fingerprint(vllm_config, kv_cache_config)
        self._tp_size = vllm_config.parallel_config.tensor_parallel_size
        extra = self._kv_transfer_config.kv_connector_extra_config or {}
        self._in_flight_bytes = int(float(extra.get("in_flight_mib", IN_FLIGHT_MIB)) * 2**20)
        self._streamers: dict[str, CheckpointStreamer] = {}
        self._unreachable_logged: set[str] = set()
        # Scheduler side
        self._tracked: dict[str, _Tracked] = {}
        self._matched: dict[str, tuple[int, int]] = {}  # req -> (local tokens, holder blocks)
        self._lookups: dict[str, _PendingLookup] = {}  # req -> its LOOKUP not answered yet
        self._loads_to_start: list[LoadSpec] = []  # allocated since the last step's meta
        # Worker side
        self._pages: KvPages | None = None
        self._page_layout: PageLayout | None = None
        # Saves whose copy to the host is under way (CUDA), oldest first; sent in order.
        self._copying: deque[tuple[StagedPages, list[SaveSpec]]] = deque()
        self._finished_while_copying: set[str] = set()
        self._load_errors: set[int] = set()
        self._loading: dict[str, _Load] = {}  # worker: request -> its pages on their way
        self._loaded: set[str] = set()  # worker: loads ended, not reported to vLLM yet
        self._loading_since: float | None = None  # worker: loads in flight since then
        self._silent_until: dict[str, float] = {}  # worker: holder -> no GETs until then
        # Counts since the last stats report (vLLM sums them into Prometheus counters).
        self.counters: dict[str, float] = dict.fromkeys(COUNTERS, 0)
        # Scheduler: the step-cost fit's sums since the last report (lumend.engine.step_fit).
        self._steps = StepTimer()
        self._incomplete: set[str] = set()  # worker: checkpoints that lost a block
        self._reported_incomplete: set[str] = set()
        self._saving: dict[str, tuple[str, str]] = {}  # worker: request -> (holder, ckpt)
        self._tally = StreamedTally()  # worker: pages sent and dropped, for the counters
        log.info("LumenConnector (%s) layout %s", role.name, self._fingerprint)

    # -- shared --------------------------------------------------------------------------

    def _streamer(self, holder: str, layout: PageLayout) -> CheckpointStreamer:
        """The streamer to `holder`, made on first use; nothing waits for its connection.
        Pages saved before it are held for ENGINE_CONNECT_GRACE_S (a handshake on a busy
        node can take longer than a step); LOOKUP, GET and the scheduler's FINISH go on the
        call socket, which queues them until the holder connects. Waiting for a new holder's
        connection stalled the engine (1 s per holder that did not come up)."""
        streamer = self._streamers.get(holder)
        if streamer is None:
            # A long prompt's prefill fills many blocks in one step: the send queue holds
            # up to IN_FLIGHT_BYTES of pages (host memory) before blocks are dropped.
            sndhwm = max(64, self._in_flight_bytes // max(1, layout.page_nbytes))
            streamer = self._streamers[holder] = CheckpointStreamer(
                holder, layout, sndhwm=sndhwm, connect_grace_s=ENGINE_CONNECT_GRACE_S,
                **_curve_kwargs())
        return streamer

    def _scheduler_layout(self) -> PageLayout:
        # LOOKUP and FINISH carry no page: the scheduler only needs model and fingerprint.
        return PageLayout(model=self._model, layout_fingerprint=self._fingerprint,
                          dtype="uint8", page_shape=(1,), tp_size=self._tp_size)

    # -- scheduler side ------------------------------------------------------------------

    def _plan_of(self, request: Request) -> CheckpointPlan | None:
        try:
            return parse_plan(request.kv_transfer_params)
        except ValueError as exc:
            log.warning("request %s: %s; it runs without a checkpoint", request.request_id, exc)
            return None

    def on_new_request(self, request: Request) -> None:
        plan = self._plan_of(request)
        if plan is not None:
            self._tracked[request.request_id] = _Tracked(request, plan)

    def get_num_new_matched_tokens(self, request: Request,
                                   num_computed_tokens: int) -> tuple[int | None, bool]:
        tracked = self._tracked.get(request.request_id)
        if tracked is None or tracked.plan.mode != "resume":
            return 0, False
        # Asked again while the request waits: the holder's answer is remembered, so the
        # scheduler loop pays one round trip per resumed request.
        remembered = self._matched.get(request.request_id)
        if remembered is None:
            blocks = self._lookup(tracked)
            if blocks is None:
                return None, False  # not answered yet: vLLM asks again at its next pass
            remembered = self._matched[request.request_id] = (num_computed_tokens, blocks)
        _, blocks = remembered
        # At least one token is left to compute: it yields the next token.
        blocks = min(blocks, (request.num_tokens - 1) // self._block_size)
        tokens = max(0, blocks * self._block_size - num_computed_tokens)
        return tokens, tokens > 0  # loaded beside the engine: the batch never waits for it

    def _lookup(self, tracked: _Tracked) -> int | None:
        """Blocks the holder has for a resumed request; None while its answer is awaited
        (the scheduler never waits more than LOOKUP_INLINE_WAIT_S for it)."""
        request_id = tracked.request.request_id
        pending = self._lookups.get(request_id)
        if pending is None:
            hashes = [bytes(h) for h in tracked.request.block_hashes]
            if not hashes:
                return 0
            streamer = self._streamer(tracked.plan.holder, self._scheduler_layout())
            call = streamer.ask_lookup(tracked.plan.ckpt_id, hashes, request_id=request_id)
            if call is None:
                return self._unanswered(tracked)
            pending = self._lookups[request_id] = _PendingLookup(
                streamer, call, time.monotonic() + LOOKUP_TIMEOUT_S)
            matched = streamer.lookup_answer(call, LOOKUP_INLINE_WAIT_S)
        else:
            matched = pending.streamer.lookup_answer(pending.call)
        if matched is None:
            if time.monotonic() < pending.deadline:
                return None
            pending.streamer.forget(pending.call)
            del self._lookups[request_id]
            return self._unanswered(tracked)
        del self._lookups[request_id]
        if matched:
            self.counters["lookup_hits"] += 1
        return matched

    def _unanswered(self, tracked: _Tracked) -> int:
        if tracked.plan.holder not in self._unreachable_logged:
            self._unreachable_logged.add(tracked.plan.holder)
            log.warning("holder %s did not answer LOOKUP within %.1f s; resumed requests "
                        "recompute their prompt", tracked.plan.holder, LOOKUP_TIMEOUT_S)
        return 0

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks,
                                 num_external_tokens: int) -> None:
        tracked = self._tracked.get(request.request_id)
        if tracked is None:
            return
        count = num_external_tokens // self._block_size
        if not count:
            return
        first = self._matched.get(request.request_id, (0, 0))[0] // self._block_size
        block_ids = list(blocks.get_block_ids()[0][first:first + count])
        tracked.load_from, tracked.load_block_ids = first, block_ids
        self._loads_to_start.append(LoadSpec(
            tracked.plan, request.request_id, block_ids,
            [bytes(h) for h in tracked.request.block_hashes[first:first + count]]))
        tracked.saved = first + count  # the holder has them already

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta = LumenConnectorMetadata(
            loads=self._loads_to_start,
            idle=scheduler_output.total_num_scheduled_tokens == 0)
        self._loads_to_start = []
        scheduled = scheduler_output.num_scheduled_tokens
        self._steps.scheduled(scheduled)
        for new in scheduler_output.scheduled_new_reqs:
            tracked = self._tracked.get(new.req_id)
            if tracked is None:
                continue
            tracked.block_ids = list(new.block_ids[0])
            self._plan_saves(meta, tracked, new.num_computed_tokens + scheduled[new.req_id])
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            tracked = self._tracked.get(req_id)
            if tracked is None:
                continue
            new_ids = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:  # after preemption: a new block table
                tracked.block_ids = list(new_ids[0]) if new_ids is not None else []
            elif new_ids is not None:
                tracked.block_ids.extend(new_ids[0])
            self._plan_saves(meta, tracked,
                             cached.num_computed_tokens[i] + scheduled.get(req_id, 0))
        return meta

    def _plan_saves(self, meta: LumenConnectorMetadata, tracked: _Tracked,
                    tokens_after_step: int) -> None:
        """Blocks whose KV is complete once this step's forward ran, and whose tokens (so
        their hash) are known."""
        hashes = tracked.request.block_hashes
        full = min(tokens_after_step // self._block_size, len(hashes), len(tracked.block_ids))
        for index in range(tracked.saved, full):
            meta.saves.append(SaveSpec(
                tracked.plan, tracked.request.request_id, index, tracked.block_ids[index],
                bytes(hashes[index]), (index + 1) * self._block_size))
        tracked.saved = max(tracked.saved, full)

    def request_finished(self, request: Request,
                         block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self._matched.pop(request.request_id, None)
        pending = self._lookups.pop(request.request_id, None)
        if pending is not None:  # it ended (aborted) while its LOOKUP was awaited
            pending.streamer.forget(pending.call)
        tracked = self._tracked.pop(request.request_id, None)
        if tracked is not None:
            # The request ended here (done, or its client left): free its checkpoint. The
            # step's pages were queued before this runs; one that arrives after this FINISH
            # (another connection) is refused by the holder (`finished`), not kept.
            self._streamer(tracked.plan.holder, self._scheduler_layout()).finish(
                tracked.plan.ckpt_id, request.request_id, queued=True)
        return False, None

    # -- worker side ---------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        num_blocks = self._kv_cache_config.num_blocks
        layers = [kv_caches[name] for name in sorted(kv_caches)]
        first = layers[0]
        dims = [d for d, size in enumerate(first.shape) if size == num_blocks]
        if not dims:
            raise ValueError(f"LumenConnector: no dimension of the KV cache {tuple(first.shape)}"
                             f" has the block count {num_blocks}")
        self._pages = KvPages(layers, dims[0])
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        self._page_layout = PageLayout(
            model=self._model, layout_fingerprint=self._fingerprint, dtype="uint8",
            page_shape=(self._pages.page_nbytes,),
            tp_rank=get_tensor_model_parallel_rank(), tp_size=self._tp_size)
        log.info("LumenConnector: %d layers %s %s, block dim %d, page %d bytes, up to %d "
                 "blocks per copy", len(layers), tuple(first.shape), first.dtype, dims[0],
                 self._pages.page_nbytes, self._pages.batch_blocks)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        """Start this step's new loads (vLLM calls this after launching the forward) and
        write the pages that arrived meanwhile; nothing here waits for a holder."""
        meta = self._get_connector_metadata()
        assert isinstance(meta, LumenConnectorMetadata)
        if self._pages is None or self._page_layout is None:
            return
        for spec in meta.loads:
            self._loading[spec.request_id] = _Load(spec, self._start_fetch(spec))
        self._advance_loads()

    def _start_fetch(self, spec: LoadSpec) -> PageFetch | None:
        assert self._page_layout is not None
        layout = self._page_layout
        if self._silent_until.get(spec.plan.holder, 0.0) > time.monotonic():
            return None  # it did not answer a moment ago: recompute without asking
        if self._loading_since is None:
            self._loading_since = time.perf_counter()
        return PageFetch(
            self._streamer(spec.plan.holder, layout), spec.plan.ckpt_id, spec.block_hashes,
            window=self._load_window(layout), timeout_s=GET_TIMEOUT_S,
            page_nbytes=layout.page_nbytes)

    def _load_window(self, layout: PageLayout) -> int:
        """GETs in flight for all loads together (the in-flight budget, in pages)."""
        return max(4, min(GET_WINDOW, self._in_flight_bytes // layout.page_nbytes))

    def _advance_loads(self) -> None:
        """Write the pages that arrived into their blocks (one batch for every load); end
        the loads that are complete, short of a page, or timed out."""
        if not self._loading or self._pages is None or self._page_layout is None:
            return
        block_ids: list[int] = []
        pages: list[Any] = []
        # One budget for every load, the oldest served first.
        budget = self._load_window(self._page_layout)
        in_flight = sum(load.fetch.in_flight for load in self._loading.values()
                        if load.fetch is not None)
        for request_id, load in list(self._loading.items()):
            if load.fetch is not None:
                own = load.fetch.in_flight
                arrived = load.fetch.advance(max_in_flight=own + max(0, budget - in_flight))
                in_flight += load.fetch.in_flight - own
                for index, page in arrived.items():
                    block_ids.append(load.spec.block_ids[index])
                    pages.append(page.data)
            if load.fetch is None or load.fetch.done:
                self._end_load(load)
                del self._loading[request_id]
                self._loaded.add(request_id)
        if block_ids:
            self._pages.load(block_ids, pages)
        if not any(load.fetch is not None for load in self._loading.values()):
            self._count_loading_time()

    def _end_load(self, load: _Load) -> None:
        spec, fetch = load.spec, load.fetch
        usable = fetch.usable if fetch is not None else 0
        if fetch is not None and fetch.timed_out:
            now = time.monotonic()
            if self._silent_until.get(spec.plan.holder, 0.0) <= now:  # once, not per load
                log.warning("holder %s did not answer a GET within %.0f s; loads from it "
                            "recompute for the next %.0f s", spec.plan.holder,
                            GET_TIMEOUT_S, SILENT_HOLDER_S)
            self._silent_until[spec.plan.holder] = now + SILENT_HOLDER_S
        if usable < len(spec.block_ids):
            self.counters["load_failures"] += 1
            self._load_errors.update(spec.block_ids[usable:])
            log.warning("checkpoint %s: block %d missing, of the wrong size or not answered; "
                        "the request recomputes from there", spec.plan.ckpt_id, usable)
        if usable and self._pages is not None:
            self.counters["blocks_loaded"] += usable
            # The restore's cost (lumend.coordinator.estimates): bytes and tokens here, its
            # seconds in _count_loading_time. Ranks restore their own pages in parallel:
            # each counts its share of the wall time, so the sum over ranks is the
            # restore's time and bytes / seconds the engine's bandwidth (and its tokens,
            # each rank holding every token's share, bytes / tokens its KV bytes per token).
            self.counters["restored_bytes"] += usable * self._pages.page_nbytes
            self.counters["restored_tokens"] += usable * self._block_size / self._tp_size

    def _count_loading_time(self, still_loading: bool = False) -> None:
        """Add the wall time with loads in flight (concurrent loads share it: bytes over
        this time is the bandwidth restores got, not the sum of their latencies)."""
        if self._loading_since is None:
            return
        now = time.perf_counter()
        self.counters["restore_seconds"] += (now - self._loading_since) / self._tp_size
        self._loading_since = now if still_loading else None

    def _wait_for_pages(self, wait_s: float) -> None:
        """Wait up to `wait_s` for a reply from a holder a load is fetching from."""
        poller = zmq.Poller()
        sockets = {load.fetch.streamer.reply_socket() for load in self._loading.values()
                   if load.fetch is not None}
        for sock in sockets:
            poller.register(sock, zmq.POLLIN)
        if sockets:
            poller.poll(int(wait_s * 1000))

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor,
                      attn_metadata: AttentionMetadata, **kwargs: Any) -> None:
        return  # whole blocks are copied once per step, in wait_for_save

    def wait_for_save(self) -> None:
        self._send_copied()
        if not self.has_connector_metadata() or self._pages is None:
            return
        meta = self._get_connector_metadata()
        assert isinstance(meta, LumenConnectorMetadata)
        if not meta.saves:
            return
        first = 0
        for batch in self._pages.save([save.block_id for save in meta.saves]):
            self._copying.append((batch, meta.saves[first:first + len(batch.block_ids)]))
            first += len(batch.block_ids)
        self._send_copied()
        # Bounded host memory: past the in-flight budget, wait for the oldest copies.
        while self._copying and sum(b.nbytes for b, _ in self._copying) > self._in_flight_bytes:
            self._copying[0][0].wait()
            self._send_copied()

    def _send_copied(self) -> None:
        """Hand the pages whose copy completed to their holders, in the order saved."""
        for holder, streamer in self._streamers.items():
            streamer.flush()  # the pages held for a holder that was still connecting
            if holder not in self._unreachable_logged and streamer.never_connected:
                self._unreachable_logged.add(holder)
                log.warning("holder %s not connected within %.0f s; the checkpoints saved "
                            "to it lost their blocks", holder, ENGINE_CONNECT_GRACE_S)
        while self._copying and self._copying[0][0].ready():
            batch, saves = self._copying.popleft()
            host = batch.pages.numpy()  # rows keep the pinned buffer alive until sent
            for row, save in enumerate(saves):
                if save.request_id in self._finished_while_copying:
                    continue  # finished meanwhile: its checkpoint is freed
                self._send(save, host[row])
        if not self._copying:
            self._finished_while_copying.clear()

    def _send(self, save: SaveSpec, page: Any) -> None:
        assert self._page_layout is not None
        streamer = self._streamer(save.plan.holder, self._page_layout)
        streamer.put_block(
            ckpt_id=save.plan.ckpt_id, request_id=save.request_id, worker=save.plan.worker,
            block_index=save.block_index, block_hash=save.block_hash, page=page,
            token_count=save.token_count)
        self._saving[save.request_id] = (save.plan.holder, save.plan.ckpt_id)

    def get_finished(self, finished_req_ids: set[str]
                     ) -> tuple[set[str] | None, set[str] | None]:
        """The loads that ended (their requests can be scheduled; a load error was reported
        for the blocks that did not come), and forget finished requests' checkpoint progress
        (the scheduler side sends their FINISH): what the worker keeps, and scans each step,
        stays bounded by what runs."""
        self._send_copied()
        if self._copying:
            self._finished_while_copying |= finished_req_ids
        for request_id in finished_req_ids:
            load = self._loading.pop(request_id, None)
            if load is not None:  # aborted while loading: vLLM frees its blocks once told
                if load.fetch is not None:
                    load.fetch.cancel()
                self._loaded.add(request_id)
            entry = self._saving.pop(request_id, None)
            if entry is None:
                continue
            holder, ckpt_id = entry
            streamer = self._streamers.get(holder)
            if streamer is not None:
                streamer.progress.pop(ckpt_id, None)
            self._incomplete.discard(ckpt_id)
            self._reported_incomplete.discard(ckpt_id)
        if self._loading:
            meta = self._get_connector_metadata() if self.has_connector_metadata() else None
            if isinstance(meta, LumenConnectorMetadata) and meta.idle:
                self._wait_for_pages(IDLE_LOAD_WAIT_S)
            self._advance_loads()
        loaded, self._loaded = self._loaded, set()
        return None, loaded or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    # -- statistics: Prometheus metrics in vLLM's /metrics ----------------------------------

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        if self.role == KVConnectorRole.WORKER:
            self._count_loading_time(still_loading=self._loading_since is not None)
            sent, dropped = self._tally.since_last(self._streamers.values())
            self.counters["blocks_saved"] += sent
            self.counters["blocks_dropped"] += dropped
            for streamer in self._streamers.values():
                for ckpt_id, progress in streamer.progress.items():
                    if progress.lost:
                        self._incomplete.add(ckpt_id)
        data: dict[str, Any] = {k: v for k, v in self.counters.items() if v}
        self.counters = dict.fromkeys(COUNTERS, 0)
        if self.role == KVConnectorRole.WORKER:
            fresh = self._incomplete - self._reported_incomplete
            if fresh:
                data["incomplete"] = sorted(fresh)
                self._reported_incomplete |= fresh
        else:
            # Coverage: requests with a checkpoint plan, and those whose checkpoint lost no
            # block so far (the worker reports losses; the scheduler sees every request).
            data["ckpt_running"] = len(self._tracked)
            data["ckpt_complete"] = sum(1 for t in self._tracked.values() if not t.incomplete)
            data.update((f"fit_{k}", v) for k, v in
                        zip(FIT_KEYS, self._steps.sums.values(), strict=True) if v)
            self._steps.sums = StepFitSums()
        return LumenConnectorStats(data=data) if data else None

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        invalid = connector_output.invalid_block_ids
        if invalid:
            # A load that fell short: the blocks from the first one missing are recomputed
            # here, and saved again (the holder lacks them). vLLM puts the request back in
            # its queue and asks for its external tokens again: the answer is now what
            # loaded, else it would load (and fail) again forever.
            for request_id, tracked in self._tracked.items():
                for index, block_id in enumerate(tracked.load_block_ids):
                    if block_id in invalid:
                        tracked.saved = min(tracked.saved, tracked.load_from + index)
                        local, _ = self._matched.get(request_id, (0, 0))
                        self._matched[request_id] = (local, tracked.load_from + index)
                        tracked.load_block_ids = []
                        break
        stats = connector_output.kv_connector_stats
        if stats is None:
            return
        lost = set(stats.data.get("incomplete", ()))
        for tracked in self._tracked.values():
            if tracked.plan.ckpt_id in lost:
                tracked.incomplete = True

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None
                                 ) -> KVConnectorStats | None:
        return LumenConnectorStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(cls, vllm_config: VllmConfig, metric_types: dict[Any, Any],
                           labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]
                           ) -> KVConnectorPromMetrics | None:
        return LumenPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # best effort: a dropped save is a later recompute, not an error

    def shutdown(self) -> None:
        for load in self._loading.values():
            if load.fetch is not None:
                load.fetch.cancel()
        for batch, _ in self._copying:
            batch.wait()
        self._send_copied()
        for streamer in self._streamers.values():
            streamer.close()
        self._streamers.clear()


COUNTERS = ("blocks_saved", "blocks_dropped", "blocks_loaded", "load_failures", "lookup_hits",
            "restored_bytes", "restored_tokens", "restore_seconds")
FIT_COUNTERS = tuple(f"fit_{key}" for key in FIT_KEYS)


class LumenConnectorStats(KVConnectorStats):
    """Counts (summed) and coverage gauges (the latest wins) on their way from the worker
    and scheduler sides to the API server's Prometheus metrics."""

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for key, value in other.data.items():
            if key in COUNTERS or key in FIT_COUNTERS:
                self.data[key] = self.data.get(key, 0) + value
            elif key == "incomplete":
                self.data[key] = sorted(set(self.data.get(key, ())) | set(value))
            else:
                self.data[key] = value
        return self

    def reset(self) -> None:
        self.data = {}

    def reduce(self) -> dict[str, int | float]:
        return {k: v for k, v in self.data.items() if isinstance(v, int | float)}

    def is_empty(self) -> bool:
        return not self.data


class LumenPromMetrics(KVConnectorPromMetrics):
    """`lumen_ckpt_requests_running` / `lumen_ckpt_requests_complete` (what lumend reads
    as checkpoint coverage) and block counters `lumen_ckpt_*_total`, labelled like vLLM's
    own metrics; each also under its deprecated 0.1 name `lumen:ckpt_*` (metric_names)."""

    def __init__(self, vllm_config: VllmConfig, metric_types: dict[Any, Any],
                 labelnames: list[str], per_engine_labelvalues: dict[int, list[object]]
                 ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        gauge: Any = self._gauge_cls
        counter: Any = self._counter_cls

        def named(make: Any, name: str, documentation: str, **kw: Any) -> list[dict[int, Any]]:
            return [self._per_engine(make(name=name, labelnames=labelnames,
                                          documentation=documentation, **kw)),
                    self._per_engine(make(name=deprecated(name), labelnames=labelnames,
                                          documentation=f"Deprecated: use {name}.", **kw))]

        self._gauges = {
            "ckpt_running": named(
                gauge, CKPT_REQUESTS_RUNNING,
                "Requests in this engine with a LUMEN checkpoint plan.",
                multiprocess_mode="mostrecent"),
            "ckpt_complete": named(
                gauge, CKPT_REQUESTS_COMPLETE,
                "Of those, requests whose checkpoint lost no block so far.",
                multiprocess_mode="mostrecent"),
        }
        self._counters = {
            key: named(counter, ckpt_counter(key),
                       f"LUMEN checkpoint {key.replace('_', ' ')}.")
            for key in COUNTERS
        }
        # The step-cost fit's sums (lumend.engine.step_fit); no 0.1 name: new in 0.2.
        for key in FIT_KEYS:
            self._counters[f"fit_{key}"] = [self._per_engine(counter(
                name=f"{METRIC_PREFIX}{key}", labelnames=labelnames,
                documentation=f"LUMEN step-cost fit: sum over steps of {FIT_MEANINGS[key]}."))]

    def _per_engine(self, metric: Any) -> dict[int, Any]:
        return {idx: metric.labels(*values)
                for idx, values in self.per_engine_labelvalues.items()}

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for key, gauges in self._gauges.items():
            if key in transfer_stats_data:
                for gauge in gauges:
                    gauge[engine_idx].set(transfer_stats_data[key])
        for key, counters in self._counters.items():
            if transfer_stats_data.get(key):
                for counter in counters:
                    counter[engine_idx].inc(transfer_stats_data[key])


def _curve_kwargs() -> dict[str, Any]:
    """CURVE keys for checkpoint sockets when lumend gave this engine some."""
    try:
        from lumend.checkpoint.security import client_keys_from_env  # type: ignore[import-not-found, unused-ignore]
    except ImportError:
        return {}
    keys = client_keys_from_env()
    return {} if keys is None else {"curve": keys}

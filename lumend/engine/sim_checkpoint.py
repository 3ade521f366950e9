"""The sim engine's KV checkpoints: stream each block that becomes full to the request's
holder, and on a resumed request load the blocks the holder has instead of recomputing.

Requests name their checkpoint in the body, as they will for vLLM's connector:
    "kv_transfer_params": {"lumen": {"ckpt_id": "...", "holder": "tcp://host:port",
                                     "worker": "<holder's worker>", "mode": "save"|"resume"}}
Best effort both ways: a dropped block only shortens the checkpoint; a missing or wrong page
(checked byte by byte against what this engine would compute) means recompute, never an
error to the client.

Holders are reached with the cluster's CURVE keys named by LUMEN_CKPT_KEYS (lumend sets it;
unset: no CURVE). How many running requests have a complete checkpoint is what the engine
exports as `lumen_ckpt_requests_complete` (`count_complete`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

from lumend.checkpoint.security import client_keys_from_env
from lumend.checkpoint.streamer import (
    ENGINE_CONNECT_GRACE_S,
    CheckpointStreamer,
    PageLayout,
    StreamedTally,
)
from lumend.engine.metric_names import ckpt_counter
from lumend.engine.sim_core import BLOCK_SIZE, SimRequest, block_hashes, kv_page
from lumend.engine.sim_models import SimModel

log = logging.getLogger("lumend.engine.sim")
T = TypeVar("T")

Mode = Literal["save", "resume"]
SEND_QUEUE_BYTES = 64 << 20


@dataclass(frozen=True)
class CheckpointPlan:
    ckpt_id: str
    holder: str
    worker: str
    mode: Mode


def parse_plan(kv_transfer_params: Any) -> CheckpointPlan | None:
    """The request's checkpoint plan, or None; ValueError names what is malformed."""
    if kv_transfer_params is None:
        return None
    if not isinstance(kv_transfer_params, dict):
        raise ValueError("kv_transfer_params must be an object")
    lumen = kv_transfer_params.get("lumen")
    if lumen is None:
        return None
    if not isinstance(lumen, dict):
        raise ValueError("kv_transfer_params.lumen must be an object")
    fields = {}
    for key in ("ckpt_id", "holder", "worker", "mode"):
        value = lumen.get(key)
        if not isinstance(value, str) or not value:
            raise ValueError(f"kv_transfer_params.lumen.{key} must be a non-empty string")
        fields[key] = value
    if fields["mode"] not in ("save", "resume"):
        raise ValueError('kv_transfer_params.lumen.mode must be "save" or "resume"')
    if not fields["holder"].startswith("tcp://"):
        raise ValueError("kv_transfer_params.lumen.holder must be tcp://host:port")
    return CheckpointPlan(fields["ckpt_id"], fields["holder"], fields["worker"],
                          fields["mode"])  # type: ignore[arg-type]


@dataclass
class CheckpointCounters:
    blocks_saved: int = 0
    blocks_dropped: int = 0
    restored_tokens: int = 0
    restore_misses: int = 0  # resumed requests the holder had nothing for
    restore_mismatches: int = 0  # pages that were not what this engine computes
    # Restores that loaded pages: their bytes, the tokens those pages hold, and the seconds
    # from the first GET to the last page checked. lumend reads them as
    # `lumen_ckpt_restored_{bytes,tokens}_total` and `lumen_ckpt_restore_seconds_total`
    # (`metric_lines`).
    restored_bytes: int = 0
    restored_kv_tokens: int = 0
    restore_seconds: float = 0.0

    def metric_lines(self) -> list[str]:
        """The restore counters in the Prometheus text format, under the names the vLLM
        connector exports them (lumend's load parse reads both kinds the same way)."""
        return [f"{ckpt_counter('restored_bytes')}_total {self.restored_bytes}",
                f"{ckpt_counter('restored_tokens')}_total {self.restored_kv_tokens}",
                f"{ckpt_counter('restore_seconds')}_total {self.restore_seconds!r}"]


class SimCheckpointer:
    """Streams off the decode path: every streaming socket belongs to one I/O thread, which
    builds each page and hands it to ZeroMQ while the engine computes its next step (in a
    real engine: the copy out of GPU memory overlapping the forward pass)."""

    def __init__(self, model: SimModel, seed: int) -> None:
        self.seed = seed
        self.page_bytes = BLOCK_SIZE * model.kv_bytes_per_token
        self.layout = PageLayout(
            model=model.name,
            layout_fingerprint=f"sim/{model.name}/block{BLOCK_SIZE}/{model.kv_bytes_per_token}B",
            dtype="uint8", page_shape=(self.page_bytes,),
        )
        self.counters = CheckpointCounters()
        self.curve = client_keys_from_env()  # KeyFileError: the engine must not start
        # Pages queued per holder before blocks are dropped: enough (64 MiB) to absorb the
        # burst of a batch's prompts becoming full at once.
        self.sndhwm = max(64, SEND_QUEUE_BYTES // self.page_bytes)
        self._streamers: dict[str, CheckpointStreamer] = {}  # used on the I/O thread only
        self._tally = StreamedTally()  # pages sent and dropped, for the counters (I/O thread)
        self._io = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckpt-io")

    def _streamer(self, holder: str) -> CheckpointStreamer:
        streamer = self._streamers.get(holder)
        if streamer is None:
            # Pages put before a slow first connection wait for it (the vLLM connector's rule).
            streamer = self._streamers[holder] = CheckpointStreamer(
                holder, self.layout, sndhwm=self.sndhwm, curve=self.curve,
                connect_grace_s=ENGINE_CONNECT_GRACE_S)
        return streamer

    def _count_streamed(self) -> None:
        sent, dropped = self._tally.since_last(self._streamers.values())
        self.counters.blocks_saved += sent
        self.counters.blocks_dropped += dropped

    def _on_io(self, fn: Callable[..., Any], *args: Any) -> None:
        """Run `fn` on the I/O thread, in order, without waiting (errors are logged)."""
        self._io.submit(fn, *args).add_done_callback(_log_failure)

    async def _io_call(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._io, fn, *args)

    def count_complete(self, running: Iterable[SimRequest],
                       plans: Mapping[str, tuple[SimRequest, CheckpointPlan]]) -> int:
        """Running requests with a checkpoint whose every block that became full so far was
        sent without a drop and not refused. Reads what the I/O thread knows now (a block
        still queued for it counts as not lost) and has it read new ACKs for next time."""
        self._on_io(self._poll_acks)
        complete = 0
        for request in running:
            entry = plans.get(request.id)
            holder = self._streamers.get(entry[1].holder) if entry else None
            if entry is None or holder is None:
                continue
            progress = holder.progress.get(entry[1].ckpt_id)
            if progress is None or progress.intact:  # None: no block sent yet, none lost
                complete += 1
        return complete

    def _poll_acks(self) -> None:
        for streamer in list(self._streamers.values()):
            streamer.flush()
            streamer.poll_acks()
        self._count_streamed()

    def save_new_blocks(self, request: SimRequest, plan: CheckpointPlan) -> None:
        """Queue the blocks that became full for the I/O thread (never blocks; drops are
        counted there)."""
        blocks = request.new_full_blocks(self.seed)  # the request's chain: this thread's
        if blocks:
            self._on_io(self._put, request.id, plan, blocks)

    def _put(self, request_id: str, plan: CheckpointPlan, blocks: list[tuple[int, bytes]]
             ) -> None:
        streamer = self._streamer(plan.holder)
        for index, block_hash in blocks:
            streamer.put_block(
                ckpt_id=plan.ckpt_id, request_id=request_id, worker=plan.worker,
                block_index=index, block_hash=block_hash,
                page=kv_page(block_hash, self.page_bytes),
                token_count=(index + 1) * BLOCK_SIZE)
        self._count_streamed()

    async def finish(self, plan: CheckpointPlan, request_id: str = "",
                     within_s: float = 2.0) -> bool:
        """Tell the holder to free the checkpoint (after its queued blocks: the I/O thread
        runs in order). Off the decode path, so it may wait a moment for the connection (a
        holder first contacted by a resumed request); if it cannot be told, the holder's
        idle collection frees the pages later."""
        deadline = asyncio.get_running_loop().time() + within_s
        while not await self._io_call(self._finish, plan, request_id):
            if asyncio.get_running_loop().time() > deadline:
                return False
            await asyncio.sleep(0.02)
        return True

    def _finish(self, plan: CheckpointPlan, request_id: str) -> bool:
        return self._streamer(plan.holder).finish(plan.ckpt_id, request_id)

    async def restore(self, prompt: list[int], plan: CheckpointPlan,
                      request_id: str = "") -> int:
        """Tokens of `prompt` whose KV the holder has, verified; at least one token is left
        to compute (the step that yields the next token)."""
        restored = await asyncio.to_thread(self._fetch, prompt, plan, request_id)
        restored = min(restored, len(prompt) - 1)
        self.counters.restored_tokens += restored
        return restored

    def _fetch(self, prompt: list[int], plan: CheckpointPlan, request_id: str = "") -> int:
        # A streamer of its own: ZeroMQ sockets belong to one thread.
        streamer = CheckpointStreamer(plan.holder, self.layout, curve=self.curve)
        try:
            hashes = block_hashes(self.seed, prompt)
            matched = streamer.lookup(plan.ckpt_id, hashes, request_id=request_id) or 0
            if not matched:
                self.counters.restore_misses += 1
                return 0
            started = time.perf_counter()
            pages = streamer.get_many(plan.ckpt_id, hashes[:matched])
            usable = matched
            for index in range(matched):
                if index >= len(pages) or not is_kv_page(pages[index].data, hashes[index],
                                                         self.page_bytes):
                    self.counters.restore_mismatches += 1
                    log.warning("checkpoint %s: block %d is missing or not this engine's KV; "
                                "recomputing from there", plan.ckpt_id, index)
                    usable = index
                    break
            if usable:
                self._count_restore(usable, time.perf_counter() - started)
            return usable * BLOCK_SIZE
        finally:
            streamer.close()

    def _count_restore(self, blocks: int, seconds: float) -> None:
        # As the vLLM connector counts it: from the first GET to the last page usable (the
        # LOOKUP before, a round trip whatever the size, is not bandwidth). On the restore
        # thread, as the miss and mismatch counts are.
        self.counters.restored_bytes += blocks * self.page_bytes
        self.counters.restored_kv_tokens += blocks * BLOCK_SIZE
        self.counters.restore_seconds += seconds

    def close(self) -> None:
        def close_all() -> None:
            for streamer in self._streamers.values():
                streamer.close()

        self._io.submit(close_all)
        self._io.shutdown(wait=True)


def _log_failure(future: Future[Any]) -> None:
    if not future.cancelled() and future.exception() is not None:
        log.error("checkpoint I/O failed", exc_info=future.exception())


def is_kv_page(data: memoryview, block_hash: bytes, page_bytes: int) -> bool:
    """`data == kv_page(block_hash, page_bytes)`, byte for byte, without building the page
    (that costs more than a restore should): a sim page is its first 64 bytes repeated, so
    when 64 divides its size it is exactly that many non-overlapping copies of them."""
    page = bytes(data)
    if len(page) != page_bytes:
        return False
    if page_bytes % 64:
        return page == kv_page(block_hash, page_bytes)
    return page.count(kv_page(block_hash, 64)) == page_bytes // 64

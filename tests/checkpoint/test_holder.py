"""The holder service over real ZeroMQ sockets on loopback."""

from __future__ import annotations

import asyncio
import itertools
import random
import threading
import time
from collections.abc import Callable
from typing import Any

import msgspec
import pytest
import zmq

from lumend.checkpoint import wire
from lumend.checkpoint.holder import HolderConfig, HolderService
from lumend.checkpoint.streamer import CheckpointStreamer, PageLayout

from .conftest import (
    LAYOUT,
    PAGE,
    MakeHolder,
    RawPeer,
    RunningHolder,
    block_hash,
    page,
    put_header,
)

MakeStreamer = Callable[..., CheckpointStreamer]


def stream(streamer: CheckpointStreamer, ckpt: str, blocks: range, worker: str = "w0",
           fill: int = 0) -> None:
    for i in blocks:
        assert streamer.put_block(ckpt_id=ckpt, request_id=f"req-{ckpt}", worker=worker,
                                  block_index=i, block_hash=block_hash(ckpt, i),
                                  page=page(fill + i), token_count=16 * (i + 1))
    streamer.wait_acks(ckpt, 10)


def test_pages_stream_in_and_come_back_byte_identical(holder: RunningHolder,
                                                      make_streamer: MakeStreamer) -> None:
    s = make_streamer(holder.endpoint)
    stream(s, "c1", range(4), fill=40)
    progress = s.progress["c1"]
    assert progress.complete and progress.reached == 4
    assert s.lookup("c1", [block_hash("c1", i) for i in range(6)]) == 4
    fetched = s.get("c1", block_hash("c1", 2))
    assert fetched is not None and bytes(fetched.data) == page(42)
    assert fetched.header.token_count == 48 and fetched.header.block_index == 2
    assert s.get("c1", block_hash("c1", 9)) is None  # missing: no page, no exception
    stats = holder.stats().workers["w0"]
    assert (stats.bytes_held, stats.requests) == (4 * PAGE, 1)


def test_get_many_fetches_the_held_prefix_with_gets_in_flight(
    holder: RunningHolder, make_streamer: MakeStreamer,
) -> None:
    s = make_streamer(holder.endpoint)
    stream(s, "c1", range(40))
    chain = [block_hash("c1", i) for i in range(40)]
    pages = s.get_many("c1", chain, window=8)
    assert [bytes(p.data) for p in pages] == [page(i) for i in range(40)]
    assert [p.header.block_index for p in pages] == list(range(40))
    # A page the holder lacks ends the prefix, wherever it is in the window.
    gap = [*chain[:10], block_hash("other", 0), *chain[11:]]
    assert len(s.get_many("c1", gap, window=8)) == 10
    assert s.get_many("c1", [block_hash("other", 0), *chain], window=8) == []
    # Replies to the GETs given up on do not confuse later calls.
    assert s.lookup("c1", chain) == 40
    assert [bytes(p.data) for p in s.get_many("c1", chain[5:8], window=1)] == [
        page(i) for i in range(5, 8)]


def test_finish_frees_the_pages(holder: RunningHolder, make_streamer: MakeStreamer) -> None:
    s = make_streamer(holder.endpoint)
    stream(s, "c1", range(3))
    assert s.finish("c1", "req-c1")
    assert s.lookup("c1", [block_hash("c1", 0)]) == 0  # ordered after the FINISH
    assert holder.stats().workers["w0"].bytes_held == 0


def test_lookup_needs_every_tp_rank(holder: RunningHolder,
                                    make_streamer: MakeStreamer) -> None:
    ranks = [make_streamer(holder.endpoint, PageLayout(
        model=LAYOUT.model, layout_fingerprint=LAYOUT.layout_fingerprint, dtype=LAYOUT.dtype,
        page_shape=LAYOUT.page_shape, tp_rank=r, tp_size=2)) for r in (0, 1)]
    stream(ranks[0], "c1", range(5))
    stream(ranks[1], "c1", range(3))
    chain = [block_hash("c1", i) for i in range(5)]
    assert ranks[0].lookup("c1", chain) == 3
    stream(ranks[1], "c1", range(3, 5))
    assert ranks[1].lookup("c1", chain) == 5
    assert bytes(ranks[0].get("c1", chain[4], tp_rank=1).data) == page(4)  # type: ignore[union-attr]


@pytest.mark.parametrize("policy", ["lru", "shortest_prefix", "longest_prefix_protected"])
def test_a_full_holder_evicts_by_its_policy(make_holder: MakeHolder,
                                            make_streamer: MakeStreamer, policy: Any) -> None:
    holder = make_holder(budget_bytes=4 * PAGE, policy=policy)
    s = make_streamer(holder.endpoint)
    stream(s, "long", range(3))   # 48 tokens, the oldest
    stream(s, "short", range(1))  # 16 tokens
    stream(s, "new", range(1))
    stats = holder.stats().workers["w0"]
    assert stats.evictions == 1 and stats.bytes_held <= 4 * PAGE
    gone = "long" if policy == "lru" else "short"
    assert s.lookup(gone, [block_hash(gone, 0)]) == 0
    assert s.lookup("new", [block_hash("new", 0)]) == 1


def test_refuse_tells_the_sender(make_holder: MakeHolder, make_streamer: MakeStreamer) -> None:
    holder = make_holder(budget_bytes=2 * PAGE, policy="refuse")
    s = make_streamer(holder.endpoint)
    stream(s, "a", range(2))
    s.put_block(ckpt_id="b", request_id="b", worker="w0", block_index=0,
                block_hash=block_hash("b", 0), page=page(0), token_count=16)
    progress = s.wait_acks("b", 10)
    assert progress.refused == "budget" and not progress.complete
    assert not s.put_block(ckpt_id="b", request_id="b", worker="w0", block_index=1,
                           block_hash=block_hash("b", 1), page=page(1), token_count=32)
    assert holder.stats().workers["w0"].refusals == 1


def test_budget_zero_refuses_everything(make_holder: MakeHolder,
                                        make_streamer: MakeStreamer) -> None:
    holder = make_holder(budget_bytes=0)
    s = make_streamer(holder.endpoint)
    s.put_block(ckpt_id="a", request_id="a", worker="w1", block_index=0,
                block_hash=block_hash("a", 0), page=page(0), token_count=16)
    assert s.wait_acks("a", 10).refused == "budget"
    assert holder.stats().workers["w1"].bytes_held == 0


def test_orphans_are_collected(make_holder: MakeHolder, make_streamer: MakeStreamer) -> None:
    holder = make_holder(ttl_s=0.2, sweep_interval_s=0.05)
    s = make_streamer(holder.endpoint)
    stream(s, "forgotten", range(2))
    deadline = time.monotonic() + 10
    while holder.stats().workers["w0"].requests and time.monotonic() < deadline:
        time.sleep(0.05)
    stats = holder.stats().workers["w0"]
    assert (stats.requests, stats.bytes_held, stats.orphans) == (0, 0, 1)


def test_the_budget_holds_under_a_random_workload(make_holder: MakeHolder,
                                                  make_streamer: MakeStreamer) -> None:
    rng = random.Random(4)
    budget = 12 * PAGE
    holder = make_holder(budget_bytes=budget, policy="lru")
    s = make_streamer(holder.endpoint, sndhwm=10_000)
    next_block: dict[str, int] = {}
    generation = dict.fromkeys(range(9), 0)  # a finished slot's next request: a new id
    for _ in range(300):
        slot = rng.randint(0, 8)
        ckpt = f"c{slot}.{generation[slot]}"
        if rng.random() < 0.85:
            i = next_block.get(ckpt, 0)
            s.put_block(ckpt_id=ckpt, request_id=ckpt, worker=rng.choice(["w0", "w1"]),
                        block_index=i, block_hash=block_hash(ckpt, i), page=page(i),
                        token_count=16 * (i + 1))
            next_block[ckpt] = i + 1
            s.wait_acks(ckpt, 10)
        else:
            s.finish(ckpt, ckpt)
            next_block.pop(ckpt, None)
            generation[slot] += 1
        for worker in holder.stats().workers.values():
            assert worker.bytes_held <= budget
    assert sum(w.evictions for w in holder.stats().workers.values()) > 0  # it was full


def encoded(header: wire.Header | dict[str, Any]) -> bytes:
    return msgspec.msgpack.encode(header)


GOOD = msgspec.to_builtins(put_header(), builtin_types=(bytes,))


@pytest.mark.parametrize(
    ("parts", "reason"),
    [
        ([b"garbage"], "malformed"),
        ([encoded({**GOOD, "version": 99}), page(0)], "version"),
        ([encoded({**GOOD, "tp_size": "two"}), page(0)], "malformed"),
        ([encoded(GOOD), page(0)[:100]], "size_mismatch"),
        ([encoded({**GOOD, "page_shape": [2, 4, 64 * 128]}), bytes(128 * PAGE)], "oversized"),
        ([encoded({**GOOD, "worker": "stranger"}), page(0)], "unknown_worker"),
        ([encoded({**GOOD, "op": "ack"})], "malformed"),
    ],
)
def test_bad_input_is_refused_counted_and_the_holder_keeps_serving(
    make_holder: MakeHolder, parts: list[Any], reason: str,
) -> None:
    holder = make_holder(max_page_bytes=64 * PAGE)
    peer = RawPeer(holder.endpoint)
    try:
        reply = peer.ask(parts)
        assert (reply.op, reply.reason) == ("error", reason)
        assert holder.stats().bad_frames[reason] == 1
        # negative control: a good page on the same connection is stored and not counted
        good = peer.ask(wire.frames(put_header(), page(0)))
        assert (good.op, good.reached) == ("ack", 1)
        assert sum(holder.stats().bad_frames.values()) == 1
    finally:
        peer.close()


def test_a_page_of_another_model_is_refused(raw_peer: RawPeer, holder: RunningHolder) -> None:
    assert raw_peer.ask(wire.frames(put_header(), page(0))).op == "ack"
    other = put_header(block_index=1, block_hash=block_hash("c1", 1), model="other")
    reply = raw_peer.ask(wire.frames(other, page(1)))
    assert (reply.op, reply.reason) == ("error", "fingerprint")
    assert holder.stats().bad_frames["fingerprint"] == 1
    lookup = wire.request(wire.LOOKUP, seq=5, ckpt_id="c1", hashes=[block_hash("c1", 0)],
                          model="tiny", layout_fingerprint="fp-2")
    reply = raw_peer.ask(wire.frames(lookup))
    assert (reply.seq, reply.reason) == (5, "fingerprint")


def test_random_and_mutated_input_never_raises() -> None:
    service = HolderService(HolderConfig(listen="127.0.0.1:0", workers=("w0",),
                                         budget_bytes=64 * PAGE, max_page_bytes=4 * PAGE))
    rng = random.Random(7)
    good = bytearray(wire.encode_header(put_header()))
    errors = 0
    for _ in range(3000):
        if rng.random() < 0.5:
            header = bytes(rng.randbytes(rng.randint(0, 80)))
        else:  # a valid header with a few bytes flipped
            mutated = bytearray(good)
            for _ in range(rng.randint(1, 4)):
                mutated[rng.randrange(len(mutated))] = rng.randrange(256)
            header = bytes(mutated)
        parts = [header, *([page(0)] if rng.random() < 0.7 else [])]
        reply = wire.decode(service.handle(parts))
        errors += reply.header.op == "error"
    bad = sum(service.bad_frames.values())
    assert 0 < bad <= errors
    good_reply = wire.decode(service.handle(wire.frames(put_header(ckpt_id="ok"), page(0))))
    assert good_reply.header.op == "ack"


def test_a_flood_of_pages_leaves_the_event_loop_turns(make_holder: MakeHolder,
                                                      make_streamer: MakeStreamer) -> None:
    """lumend renews its etcd lease on the loop the holder serves on: while pages are
    queued, the holder must still give the loop a turn between messages. A ticker on that
    loop records how many pages were handled at each of its turns; a receive loop that never
    yields would let thousands through between two turns."""
    holder = make_holder(budget_bytes=4096 * PAGE)
    marks: list[int] = []
    stop = threading.Event()

    async def tick() -> None:
        while not stop.is_set():
            marks.append(holder.service.store.stats["w0"].requests)
            await asyncio.sleep(0)

    ticker = asyncio.run_coroutine_threadsafe(tick(), holder._loop)
    s = make_streamer(holder.endpoint, sndhwm=100_000)
    flood = 3000
    for i in range(flood):
        assert s.put_block(ckpt_id=f"f{i}", request_id=f"r{i}", worker="w0", block_index=0,
                           block_hash=block_hash(f"f{i}", 0), page=page(0), token_count=16)
    deadline = time.monotonic() + 60
    while holder.call(lambda: holder.service.store.stats["w0"].requests) < flood:
        assert time.monotonic() < deadline, "the flood was not handled"
        time.sleep(0.05)
    stop.set()
    ticker.result(timeout=10)
    gaps = [b - a for a, b in itertools.pairwise(marks)]
    assert max(gaps) <= 64, f"{max(gaps)} pages were handled between two turns of the loop"


def test_what_one_peer_can_queue_is_bounded_in_bytes(make_holder: MakeHolder) -> None:
    """The receive high-water mark counts messages: with 64 MiB pages, 1000 of them per peer
    is 64 GiB before the budget is checked. It is derived from [checkpoint]'s page limit."""
    big = make_holder(max_page_bytes=64 << 20)
    sock = big.service._socket
    assert sock is not None
    hwm = big.call(lambda: sock.getsockopt(zmq.RCVHWM))
    assert hwm * big.service.max_message_bytes() <= big.service.config.queue_bytes
    small = make_holder(max_page_bytes=64 * PAGE)  # control: small pages queue as before
    assert small.service.queue_messages() == 1000

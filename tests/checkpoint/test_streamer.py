"""The streamer never blocks decode: a missing or slow holder costs blocks, not time."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pytest

from lumenctl.localcluster import free_ports
from lumend.checkpoint.streamer import CheckpointStreamer, PageLayout

from .conftest import RunningHolder, block_hash, page

MakeStreamer = Callable[..., CheckpointStreamer]
GRACE_S = 2.0  # long enough that a busy machine does not pass it between two lines
BIG = PageLayout(model="tiny", layout_fingerprint="fp-1", dtype="uint8", page_shape=(256 * 1024,))


def put(s: CheckpointStreamer, ckpt: str, i: int, data: Any) -> bool:
    return s.put_block(ckpt_id=ckpt, request_id=ckpt, worker="w0", block_index=i,
                       block_hash=block_hash(ckpt, i), page=data, token_count=16 * (i + 1))


def test_no_holder_means_every_block_is_dropped_at_once(make_streamer: MakeStreamer) -> None:
    (port,) = free_ports(1)
    s = make_streamer(f"tcp://127.0.0.1:{port}", connect=False)
    assert not any(put(s, "c1", i, page(i)) for i in range(50))
    progress = s.progress["c1"]
    assert (progress.sent, progress.dropped, progress.complete) == (0, 50, False)
    assert s.counters.dropped == 50
    assert s.lookup("c1", [block_hash("c1", 0)], timeout_s=0.2) is None
    assert s.get("c1", block_hash("c1", 0), timeout_s=0.2) is None


def test_a_slow_holder_costs_blocks_not_blocking(deaf_holder: str,
                                                 make_streamer: MakeStreamer) -> None:
    s = make_streamer(deaf_holder, layout=BIG, sndhwm=2)
    data = bytes(BIG.page_nbytes)
    results = [put(s, "c1", i, data) for i in range(400)]  # 100 MiB into a full pipe
    assert results[0] and not all(results)
    first_drop = results.index(False)
    assert not any(results[first_drop:]), "blocks after a gap are not sent (useless)"
    progress = s.progress["c1"]
    assert progress.dropped == 400 - first_drop and not progress.complete
    assert s.counters.dropped == progress.dropped


def test_a_holder_that_goes_away_costs_blocks_not_blocking(
    make_holder: Callable[..., RunningHolder], make_streamer: MakeStreamer,
) -> None:
    holder = make_holder()
    s = make_streamer(holder.endpoint)
    assert put(s, "c1", 0, page(0))
    assert s.wait_acks("c1", 10).complete
    holder.stop()
    # with the holder gone, blocks are dropped instead of queued; the call returns
    results = [put(s, "c2", i, page(i)) for i in range(5_000)]
    assert not all(results)
    assert s.counters.dropped > 0 and not s.progress["c2"].complete


def test_a_wrong_page_size_is_a_caller_bug(make_streamer: MakeStreamer,
                                           holder: RunningHolder) -> None:
    s = make_streamer(holder.endpoint)
    with pytest.raises(ValueError, match="layout says"):
        put(s, "c1", 0, b"short")
    assert s.counters.sent == 0


def test_pages_put_while_a_new_holder_connects_are_held_then_delivered_in_order(
    make_streamer: MakeStreamer,
) -> None:
    """A holder whose first connection comes late (a busy node's handshake) still gets the
    checkpoint from its first block; without a grace (the negative control) the first
    blocks are lost and with them the whole checkpoint."""
    from lumend.checkpoint.holder import HolderConfig

    (port,) = free_ports(1)
    endpoint = f"tcp://127.0.0.1:{port}"
    patient = make_streamer(endpoint, connect=False, connect_grace_s=30)
    hasty = make_streamer(endpoint, connect=False)
    assert all(put(patient, "c1", i, page(i)) for i in range(5))
    assert all(put(patient, "gone", i, page(i)) for i in range(2))
    assert not any(put(hasty, "c2", i, page(i)) for i in range(5))
    assert (patient.held, patient.counters.sent, patient.counters.dropped) == (7, 0, 0)
    waiting = patient.progress["c1"]
    assert waiting.held == 5 and not waiting.intact and not waiting.complete, (
        "pages not yet at the holder do not count as covered")
    patient.progress.pop("gone")  # its request ended while the holder was connecting

    holder = RunningHolder(HolderConfig(listen=f"127.0.0.1:{port}", workers=("w0",),
                                        budget_bytes=1 << 20)).start()
    try:
        assert patient.wait_connected(10) and hasty.wait_connected(10)
        patient.flush()
        assert (patient.held, patient.counters.sent) == (0, 5), "the held pages are sent"
        assert waiting.held == 0 and waiting.intact
        assert put(patient, "c1", 5, page(5)) and not put(hasty, "c2", 5, page(5))
        assert patient.wait_acks("c1", 10).complete and patient.progress["c1"].reached == 6

        def held(ckpt: str) -> int:
            found = holder.service.store.checkpoints.get(ckpt)
            return 0 if found is None else found.reached.get(0, 0)

        assert holder.call(lambda: (held("c1"), held("c2"), held("gone"))) == (6, 0, 0)
    finally:
        holder.stop()


def test_pages_held_for_a_holder_that_never_connects_are_dropped_after_the_grace(
    make_streamer: MakeStreamer,
) -> None:
    (port,) = free_ports(1)
    s = make_streamer(f"tcp://127.0.0.1:{port}", connect=False, sndhwm=3,
                      connect_grace_s=GRACE_S)
    assert [put(s, "c1", i, page(i)) for i in range(4)] == [True, True, True, False]
    assert s.held == 3 and not s.never_connected
    s.flush()
    assert s.held == 3, "still within the grace: nothing dropped yet"
    deadline = time.monotonic() + GRACE_S
    while time.monotonic() < deadline:
        time.sleep(0.05)
    s.flush()
    assert s.never_connected and s.held == 0
    assert (s.progress["c1"].dropped, s.counters.dropped, s.counters.sent) == (4, 4, 0)
    assert not put(s, "c1", 4, page(4)), "a block after the lost ones is useless"


def stall(holder: RunningHolder, seconds: float) -> None:
    """Block the holder's event loop (a hung holder: its socket accepts, nothing answers)."""
    holder.service_loop().call_soon_threadsafe(time.sleep, seconds)


def test_a_lookup_asked_without_waiting_is_answered_later_and_never_lost(
    holder: RunningHolder, make_streamer: MakeStreamer,
) -> None:
    """vLLM's scheduler asks a LOOKUP and goes on; the answer is picked up at a later pass,
    even when a blocking call (a GET) read the socket in between."""
    s = make_streamer(holder.endpoint)
    for i in range(3):
        assert put(s, "c1", i, page(i))
    assert s.wait_acks("c1", 10).reached == 3
    chain = [block_hash("c1", i) for i in range(4)]

    answered = s.ask_lookup("c1", chain, request_id="r2")
    assert answered is not None
    assert s.lookup_answer(answered, wait_s=10) == 3
    assert s.lookup_answer(answered) is None, "an answer is handed out once"

    # A hung holder: the answer is not there; the caller is not held; it comes later.
    stall(holder, 1.5)
    late = s.ask_lookup("c1", chain)
    assert late is not None
    assert s.lookup_answer(late, wait_s=0.005) is None, "the caller is not held for it"
    # A GET (a blocking call) reads the same socket meanwhile: the LOOKUP's answer is kept.
    fetched = s.get("c1", block_hash("c1", 0), timeout_s=10)
    assert fetched is not None and bytes(fetched.data) == page(0)
    assert s.lookup_answer(late, wait_s=10) == 3

    # Given up on (the request ended): its answer, when it comes, is dropped.
    stall(holder, 0.5)
    abandoned = s.ask_lookup("c1", chain)
    assert abandoned is not None
    s.forget(abandoned)
    assert s.lookup("c1", chain, timeout_s=10) == 3
    assert s.lookup_answer(abandoned, wait_s=0.2) is None
    assert not s._awaited, "nothing is kept for calls given up on"


def test_a_queued_finish_from_a_streamer_not_connected_yet_reaches_the_holder(
    holder: RunningHolder, make_streamer: MakeStreamer,
) -> None:
    """vLLM's scheduler sends FINISH with a streamer that sent no page and does not wait for
    its connection: queued, it frees the checkpoint once connected (on the stream, which
    needs a connection, it is dropped: `finish` without `queued`)."""
    pages = make_streamer(holder.endpoint)
    for i in range(2):
        assert put(pages, "c1", i, page(i))
    assert pages.wait_acks("c1", 10).reached == 2
    scheduler = make_streamer(holder.endpoint, connect=False)
    assert scheduler.finish("c1", "c1", queued=True)
    deadline = time.monotonic() + 10
    while holder.call(lambda: "c1" in holder.service.store.checkpoints):
        assert time.monotonic() < deadline, "the queued FINISH never freed the checkpoint"
        time.sleep(0.05)
    assert holder.stats().workers["w0"].bytes_held == 0

"""A checkpoint belongs to the engine request that last wrote it or resumed from it: when
a request moves (drain --migrate, a gateway that gave up on a slow engine), the engine it
left must not free what the new one continues from."""

from __future__ import annotations

import time
from collections.abc import Callable

from lumend.checkpoint import wire
from lumend.checkpoint.streamer import CheckpointStreamer

from .conftest import MakeHolder, RawPeer, RunningHolder, block_hash, page


def held(holder: RunningHolder, ckpt_id: str) -> bool:
    return holder.call(lambda: ckpt_id in holder.service.store.checkpoints)


def settle(holder: RunningHolder, ckpt_id: str, want: bool) -> bool:
    deadline = time.monotonic() + 5
    while held(holder, ckpt_id) != want and time.monotonic() < deadline:
        time.sleep(0.02)
    return held(holder, ckpt_id)


def put_two(streamer: CheckpointStreamer, ckpt_id: str, request_id: str) -> None:
    for i in range(2):
        assert streamer.put_block(ckpt_id=ckpt_id, request_id=request_id, worker="w0",
                                  block_index=i, block_hash=block_hash(ckpt_id, i),
                                  page=page(i), token_count=16 * (i + 1))
    assert streamer.wait_acks(ckpt_id, 5).reached == 2


def test_finish_from_the_engine_a_request_left_is_ignored(
    make_holder: MakeHolder, make_streamer: Callable[..., CheckpointStreamer],
) -> None:
    holder = make_holder()
    old_engine, new_engine = make_streamer(holder.endpoint), make_streamer(holder.endpoint)
    put_two(old_engine, "c1", "r-old")
    hashes = [block_hash("c1", i) for i in range(2)]
    assert new_engine.lookup("c1", hashes, request_id="r-new") == 2  # resumed: now its own

    assert old_engine.finish("c1", "r-old")
    time.sleep(0.3)
    assert settle(holder, "c1", want=True), "the old engine's FINISH freed the new one's pages"
    assert holder.call(lambda: holder.service.finishes_ignored) == 1
    assert new_engine.finish("c1", "r-new")
    assert not settle(holder, "c1", want=False)


def test_a_lookup_that_matches_nothing_takes_nothing_over_and_plain_finish_frees(
    make_holder: MakeHolder, make_streamer: Callable[..., CheckpointStreamer],
) -> None:
    holder = make_holder()
    engine, other = make_streamer(holder.endpoint), make_streamer(holder.endpoint)
    put_two(engine, "c2", "r1")
    assert other.lookup("c2", [b"not a block of it".ljust(32, b"\0")], request_id="r2") == 0
    assert engine.finish("c2", "r1")  # still r1's: freed
    assert not settle(holder, "c2", want=False)



def test_a_put_after_a_lookup_does_not_give_the_checkpoint_back(
    make_holder: MakeHolder, make_streamer: Callable[..., CheckpointStreamer],
) -> None:
    """During a make-before-break migration the engine a request leaves keeps writing
    pages after the new engine resumed from them: its FINISH must still free nothing.
    Control: the new engine's FINISH frees them."""
    holder = make_holder()
    old_engine, new_engine = make_streamer(holder.endpoint), make_streamer(holder.endpoint)
    put_two(old_engine, "c4", "r-old")
    assert new_engine.lookup("c4", [block_hash("c4", i) for i in range(2)],
                             request_id="r-new") == 2
    assert old_engine.put_block(ckpt_id="c4", request_id="r-old", worker="w0", block_index=2,
                                block_hash=block_hash("c4", 2), page=page(2), token_count=48)
    assert old_engine.wait_acks("c4", 5).reached == 3
    assert old_engine.finish("c4", "r-old")
    time.sleep(0.3)
    assert settle(holder, "c4", want=True), "the old engine's late PUT made it the owner again"
    assert new_engine.finish("c4", "r-new")
    assert not settle(holder, "c4", want=False)


def test_a_finish_that_names_no_request_is_refused(
    holder: RunningHolder, raw_peer: RawPeer, make_streamer: Callable[..., CheckpointStreamer],
) -> None:
    """An empty request id would free whatever checkpoint it names, a resumed one too."""
    engine = make_streamer(holder.endpoint)
    put_two(engine, "c3", "r1")
    reply = raw_peer.ask(
        [wire.encode_header(wire.request(wire.FINISH, seq=7, ckpt_id="c3"))])
    assert reply.op == wire.ERROR and reply.reason == "malformed" and "request_id" in (
        reply.error)
    assert settle(holder, "c3", want=True), "a FINISH without a request freed the checkpoint"
    assert engine.finish("c3", "r1")  # control: the owner's FINISH frees it
    assert not settle(holder, "c3", want=False)

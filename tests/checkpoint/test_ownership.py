"""A checkpoint belongs to the engine request that last wrote it or resumed from it: when
a request moves (drain --migrate, a gateway that gave up on a slow engine), the engine it
left must not free what the new one continues from."""

from __future__ import annotations

import time
from collections.abc import Callable

from lumend.checkpoint.streamer import CheckpointStreamer

from .conftest import MakeHolder, RunningHolder, block_hash, page


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

    put_two(engine, "c3", "r1")
    assert other.lookup("c3", [block_hash("c3", 0)], request_id="r2") == 1
    assert engine.finish("c3")  # no request named: unconditional, as before
    assert not settle(holder, "c3", want=False)

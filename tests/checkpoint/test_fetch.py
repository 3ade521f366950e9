"""PageFetch: a checkpoint's pages fetched without ever waiting, over real sockets."""

from __future__ import annotations

import time
from collections.abc import Callable

from lumend.checkpoint.fetch import PageFetch
from lumend.checkpoint.store import CheckpointStore, Page
from lumend.checkpoint.streamer import CheckpointStreamer, FetchedPage

from .conftest import PAGE, RunningHolder, block_hash, page
from .test_holder import stream

MakeStreamer = Callable[..., CheckpointStreamer]


def run_to_the_end(fetch: PageFetch, limit_s: float = 10.0) -> tuple[dict[int, FetchedPage], int]:
    """Advance as a vLLM worker does, once a 'step', until done: the pages and the steps."""
    pages: dict[int, FetchedPage] = {}
    steps = 0
    deadline = time.monotonic() + limit_s
    while not fetch.done:
        assert time.monotonic() < deadline, "the fetch never ended"
        for index, arrived in fetch.advance().items():
            assert index not in pages, f"page {index} handed out twice"
            pages[index] = arrived
        steps += 1
        time.sleep(0.001)
    return pages, steps


def test_pages_arrive_over_several_advances_byte_identical(
    holder: RunningHolder, make_streamer: MakeStreamer,
) -> None:
    s = make_streamer(holder.endpoint)
    stream(s, "c1", range(40))
    chain = [block_hash("c1", i) for i in range(40)]
    fetch = PageFetch(s, "c1", chain, window=8, timeout_s=10, page_nbytes=PAGE)
    assert fetch.advance() == {}, "the first advance only sends: it never waits for replies"
    pages, steps = run_to_the_end(fetch)
    assert fetch.usable == 40 and not fetch.timed_out
    assert [bytes(pages[i].data) for i in range(40)] == [page(i) for i in range(40)]
    assert steps >= 40 // 8, "a window of 8 cannot bring 40 pages in fewer advances"


def test_a_missing_page_ends_the_usable_prefix_and_nothing_after_it_is_handed_out(
    holder: RunningHolder, make_streamer: MakeStreamer,
) -> None:
    s = make_streamer(holder.endpoint)
    stream(s, "c1", range(30))
    chain = [block_hash("c1", i) for i in range(30)]
    chain[12] = block_hash("other", 0)
    fetch = PageFetch(s, "c1", chain, window=30, timeout_s=10, page_nbytes=PAGE)
    pages, _ = run_to_the_end(fetch)
    assert fetch.usable == 12 and not fetch.timed_out
    assert sorted(pages) == list(range(12))
    # The replies to GETs given up on do not confuse the next fetch on the same socket.
    again = PageFetch(s, "c1", [block_hash("c1", i) for i in range(5)], window=2,
                      timeout_s=10, page_nbytes=PAGE)
    pages, _ = run_to_the_end(again)
    assert again.usable == 5 and [bytes(pages[i].data) for i in range(5)] == [
        page(i) for i in range(5)]


def test_a_page_of_the_wrong_size_is_not_usable(holder: RunningHolder,
                                                make_streamer: MakeStreamer) -> None:
    s = make_streamer(holder.endpoint)
    stream(s, "c1", range(6))
    fetch = PageFetch(s, "c1", [block_hash("c1", i) for i in range(6)], window=4,
                      timeout_s=10, page_nbytes=2 * PAGE)
    pages, _ = run_to_the_end(fetch)
    assert (fetch.usable, pages) == (0, {})
    # Negative control: the right size is usable.
    right = PageFetch(s, "c1", [block_hash("c1", i) for i in range(6)], window=4,
                      timeout_s=10, page_nbytes=PAGE)
    run_to_the_end(right)
    assert right.usable == 6


def test_a_holder_that_never_answers_costs_no_wait_and_ends_in_a_timeout(
    deaf_holder: str, make_streamer: MakeStreamer,
) -> None:
    s = make_streamer(deaf_holder)
    fetch = PageFetch(s, "c1", [block_hash("c1", i) for i in range(10)], window=4,
                      timeout_s=0.3, page_nbytes=PAGE)
    started = time.monotonic()
    advances = 0
    while not fetch.done:
        assert fetch.advance() == {}
        advances += 1
        assert time.monotonic() - started < 10, "the fetch never timed out"
        time.sleep(0.01)
    assert fetch.timed_out and fetch.usable == 0
    assert s.counters.timeouts == 1
    # An advance that waited for the holder would have spent the whole timeout in one or
    # two calls; one that never waits is called again and again meanwhile (a count, not a
    # timing: each call sleeps 10 ms of the 300 ms).
    assert advances >= 5, f"{advances} advances: the fetch waited for the holder"


def test_a_cancelled_fetch_hands_out_nothing_more(holder: RunningHolder,
                                                  make_streamer: MakeStreamer) -> None:
    s = make_streamer(holder.endpoint)
    stream(s, "c1", range(8))
    fetch = PageFetch(s, "c1", [block_hash("c1", i) for i in range(8)], window=8,
                      timeout_s=10, page_nbytes=PAGE)
    fetch.advance()
    fetch.cancel()
    time.sleep(0.2)
    assert fetch.done and fetch.advance() == {}
    # What it asked for is dropped when it comes: a later blocking call is not confused.
    assert s.lookup("c1", [block_hash("c1", i) for i in range(8)]) == 8


def test_a_fetch_held_back_by_a_shared_budget_does_not_time_out(
    holder: RunningHolder, make_streamer: MakeStreamer,
) -> None:
    """The vLLM worker shares one in-flight budget among its loads: a fetch given no room
    asks nothing, and nobody is late for it, however long that lasts."""
    s = make_streamer(holder.endpoint)
    stream(s, "c1", range(6))
    fetch = PageFetch(s, "c1", [block_hash("c1", i) for i in range(6)], window=4,
                      timeout_s=0.2, page_nbytes=PAGE)
    held_until = time.monotonic() + 0.6
    while time.monotonic() < held_until:
        assert fetch.advance(max_in_flight=0) == {} and fetch.in_flight == 0
        time.sleep(0.01)
    assert not fetch.done, "a fetch that asked nothing timed out"
    pages, _ = run_to_the_end(fetch)
    assert fetch.usable == 6 and not fetch.timed_out
    assert [bytes(pages[i].data) for i in range(6)] == [page(i) for i in range(6)]
    # Within a budget of 2 it never has more than 2 GETs in flight.
    capped = PageFetch(s, "c1", [block_hash("c1", i) for i in range(6)], window=4,
                       timeout_s=10, page_nbytes=PAGE)
    while not capped.done:
        capped.advance(max_in_flight=2)
        assert capped.in_flight <= 2
        time.sleep(0.001)
    assert capped.usable == 6


class SlowGets(CheckpointStore):
    """A real store whose holder takes `get_s` for each GET (its event loop busy)."""

    def __init__(self, get_s: float) -> None:
        super().__init__(("w0",), 64 * PAGE, "lru")
        self.get_s = get_s

    def get(self, ckpt_id: str, block_hash: bytes, tp_rank: int) -> Page | None:
        time.sleep(self.get_s)
        return super().get(ckpt_id, block_hash, tp_rank)


def test_fetches_queued_behind_each_other_at_a_busy_holder_do_not_time_out(
    make_streamer: MakeStreamer,
) -> None:
    """Two fetches from one holder that serves a GET every 0.1 s: the second one's replies
    come only after the first one's 8 (0.8 s), longer than its 0.4 s timeout. The holder
    answered all along, so neither times out (and the vLLM worker does not take the holder
    for silent); negative control: a holder that answers nothing still times out (above)."""
    from lumend.checkpoint.holder import HolderConfig

    slow = RunningHolder(HolderConfig(listen="127.0.0.1:0", workers=("w0",),
                                      budget_bytes=64 * PAGE), store=SlowGets(0.1)).start()
    try:
        s = make_streamer(slow.endpoint)
        stream(s, "c1", range(8))
        stream(s, "c2", range(8))
        first = PageFetch(s, "c1", [block_hash("c1", i) for i in range(8)], window=8,
                          timeout_s=0.4, page_nbytes=PAGE)
        second = PageFetch(s, "c2", [block_hash("c2", i) for i in range(8)], window=8,
                           timeout_s=0.4, page_nbytes=PAGE)
        deadline = time.monotonic() + 30
        while not (first.done and second.done):
            assert time.monotonic() < deadline, "the fetches never ended"
            first.advance()
            second.advance()
            time.sleep(0.005)
        assert (first.usable, second.usable) == (8, 8)
        assert not first.timed_out and not second.timed_out
    finally:
        slow.stop()

"""PageFetch: a checkpoint's pages fetched without ever waiting, over real sockets."""

from __future__ import annotations

import time
from collections.abc import Callable

from lumend.checkpoint.fetch import PageFetch
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
    slowest = 0.0
    while not fetch.done:
        before = time.monotonic()
        assert fetch.advance() == {}
        slowest = max(slowest, time.monotonic() - before)
        assert time.monotonic() - started < 10, "the fetch never timed out"
        time.sleep(0.005)
    assert fetch.timed_out and fetch.usable == 0
    assert s.counters.timeouts == 1
    assert time.monotonic() - started >= 0.3, "it timed out before its timeout"
    # The bound is loose for a loaded machine; a fetch that waited would take 0.3 s here.
    assert slowest < 0.25, f"one advance took {slowest:.3f} s: it waited for the holder"


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

"""Draft-assist protocol: the wire format, the survivor's client and the drafter's server,
over real ZeroMQ sockets on loopback."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import msgspec
import pytest
import zmq.asyncio

from lumend.assist import wire
from lumend.assist.client import AsyncDraftClient, DraftClient
from lumend.assist.server import DraftJob
from lumend.assist.sim_draft import SimDraftFunction
from lumend.checkpoint.security import CurveKeys
from lumend.engine.sim_core import encode, reference_completion

from .conftest import EchoDrafter, MakeDrafter, RawPeer, wait_for


def client(endpoint: str, deadline_s: float, **kwargs: Any) -> DraftClient:
    c = DraftClient(endpoint, deadline_s=deadline_s, **kwargs)
    assert c.wait_connected(10), f"no drafter connected at {endpoint}"
    return c

# -- wire ---------------------------------------------------------------------------------


def test_a_round_survives_the_wire() -> None:
    r = wire.round_(7, 3, [wire.Update(request_id="a", base=5, tokens=[1, 2])], model="m")
    assert wire.decode_request([wire.encode(r)]) == r
    d = wire.drafts(7, [wire.Draft(request_id="a", drafts=[3, 4]),
                        wire.Draft(request_id="b", resync=True)])
    assert wire.decode_reply([wire.encode(d)]) == d
    rel = wire.release(["a", "b"])
    assert wire.decode_request([wire.encode(rel)]) == rel


@pytest.mark.parametrize("field,value,named", [
    ("k", wire.MAX_K + 1, "$.k"),
    ("seq", -1, "$.seq"),
    ("items", [{"request_id": "a", "base": -1, "tokens": []}], "$.items[0].base"),
    ("items", [{"request_id": "a", "base": 0, "tokens": [1, -2]}], "$.items[0].tokens[1]"),
    ("items", [{"request_id": "x" * 300, "base": 0, "tokens": []}], "$.items[0].request_id"),
    ("items", [{"request_id": "a", "base": 0}], "tokens"),
])
def test_a_bad_field_is_named(field: str, value: object, named: str) -> None:
    body = {"op": "round", "version": wire.WIRE_VERSION, "seq": 9, "k": 2, "items": []}
    body[field] = value
    with pytest.raises(wire.WireError) as err:
        wire.decode_request([msgspec.msgpack.encode(body)])
    assert err.value.reason == "malformed"
    assert named in str(err.value)
    # The seq is kept where it could be read, so the error reply can name the round.
    assert err.value.seq == (9 if field != "seq" else 0)


def test_versions_frames_and_sizes_are_checked() -> None:
    good = wire.encode(wire.round_(1, 1, []))
    future = msgspec.msgpack.encode({"op": "round", "version": 99, "seq": 1, "k": 1,
                                     "items": []})
    with pytest.raises(wire.WireError) as err:
        wire.decode_request([future])
    assert err.value.reason == "version" and "version: 99" in str(err.value)
    with pytest.raises(wire.WireError) as err:
        wire.decode_request([good, good])
    assert err.value.reason == "oversized"
    with pytest.raises(wire.WireError) as err:
        wire.decode_request([b"\xc1 not msgpack"])
    assert err.value.reason == "malformed"
    with pytest.raises(wire.WireError) as err:
        wire.decode_request([b"\0" * (wire.MAX_MESSAGE_BYTES + 1)])
    assert err.value.reason == "oversized"
    # A reply is not a request (and the other way round).
    with pytest.raises(wire.WireError):
        wire.decode_request([wire.encode(wire.drafts(1, []))])
    with pytest.raises(wire.WireError):
        wire.decode_reply([good])


# -- client and server --------------------------------------------------------------------


def test_rounds_send_only_new_tokens_and_return_drafts(make_drafter: MakeDrafter) -> None:
    d = make_drafter()
    fn: EchoDrafter = d.function
    c = client(d.endpoint, deadline_s=5.0, model="m")
    try:
        assert c.propose({"a": [10, 11, 12]}, 3) == {"a": [13, 14, 15]}
        # Two drafts accepted plus the bonus token: the survivor committed 13, 14, 99.
        assert c.propose({"a": [10, 11, 12, 13, 14, 99]}, 2) == {"a": [100, 101]}
        first, second = fn.jobs
        assert first[0] == DraftJob("a", [10, 11, 12], 0) and first[1] == 3
        # The drafter's speculative state 10..15 shares 5 tokens with the new context.
        assert second[0] == DraftJob("a", [10, 11, 12, 13, 14, 99], 5)
        assert c.session.sent == {"a": 6}
        assert c.counters.rounds == 2 and c.counters.on_time == 2 and c.counters.late == 0
    finally:
        c.close()
    assert d.stats().rounds == 2


def test_a_late_drafter_costs_the_deadline_and_no_drafts(make_drafter: MakeDrafter) -> None:
    fn = EchoDrafter()
    fn.gate = threading.Event()  # drafting cannot finish until the test opens the gate
    d = make_drafter(fn)
    c = client(d.endpoint, deadline_s=0.05)
    try:
        assert c.propose({"a": [1, 2]}, 2) == {}
        assert c.counters.late == 1
        fn.gate.set()
        # The late reply to round 1 arrives now; round 2 must get its own answer, not it.
        wait_for(lambda: d.stats().drafted_rounds == 1, "the first round drafted")
        c.deadline_s = 5.0
        assert c.propose({"a": [1, 2, 3]}, 2) == {"a": [4, 5]}
        assert c.counters.stale == 1
    finally:
        c.close()


def test_queued_rounds_apply_every_update_and_draft_only_the_newest(
        make_drafter: MakeDrafter) -> None:
    fn = EchoDrafter()
    fn.gate = threading.Event()
    d = make_drafter(fn)
    c = client(d.endpoint, deadline_s=0.02)
    try:
        assert c.propose({"a": [1]}, 2) == {}           # drafting, blocked on the gate
        wait_for(lambda: d.stats().rounds == 1, "round 1 received")
        assert c.propose({"a": [1, 2]}, 2) == {}        # queued
        assert c.propose({"a": [1, 2, 3], "b": [7]}, 2) == {}  # queued
        fn.gate.set()
        wait_for(lambda: d.stats().drafted_rounds == 2, "the queued rounds handled")
        stats = d.stats()
        assert stats.rounds == 3 and stats.skipped_rounds == 1
        # Round 2's tokens reached the context round 3 was drafted from.
        contexts = [(job.request_id, list(job.context)) for job, _ in fn.jobs]
        assert contexts == [("a", [1]), ("a", [1, 2, 3]), ("b", [7])]
    finally:
        c.close()


def test_a_drafter_that_lost_a_request_asks_for_it_whole(make_drafter: MakeDrafter) -> None:
    d = make_drafter()
    fn: EchoDrafter = d.function
    c = client(d.endpoint, deadline_s=5.0)
    try:
        assert c.propose({"a": [1, 2]}, 1) == {"a": [3]}
        d.call(lambda: d.service.contexts.clear())   # as after a drafter restart
        assert c.propose({"a": [1, 2, 3]}, 1) == {}   # base 2 beyond what it has: resync
        assert c.counters.resyncs == 1 and c.session.sent["a"] == 0
        assert c.propose({"a": [1, 2, 3, 4]}, 1) == {"a": [5]}
        assert fn.jobs[-1][0] == DraftJob("a", [1, 2, 3, 4], 0)
        assert d.stats().resyncs == 1
    finally:
        c.close()


def test_released_requests_are_freed(make_drafter: MakeDrafter) -> None:
    d = make_drafter()
    fn: EchoDrafter = d.function
    c = client(d.endpoint, deadline_s=5.0)
    try:
        c.propose({"a": [1], "b": [2], "c": [3]}, 1)
        c.release(["a"])
        c.release_absent(["c"])  # b finished too
        wait_for(lambda: d.stats().requests == 1, "two contexts freed")
        assert sorted(fn.released) == ["a", "b"]
        assert list(d.call(lambda: list(d.service.contexts))) == ["c"]
        assert d.stats().releases == 2 and c.counters.releases == 2
    finally:
        c.close()


def test_idle_and_excess_contexts_are_dropped(make_drafter: MakeDrafter) -> None:
    d = make_drafter(max_requests=2, ttl_s=3600)
    c = client(d.endpoint, deadline_s=5.0)
    try:
        c.propose({"a": [1], "b": [2], "c": [3]}, 1)
        assert d.call(lambda: sorted(d.service.contexts)) == ["b", "c"]
        assert d.call(lambda: d.service.sweep()) == 0  # nothing idle for an hour
        d.service.config = type(d.service.config)(listen="x:0", ttl_s=0.0)
        assert d.call(lambda: d.service.sweep()) == 2
        assert d.stats().evicted == 3 and d.stats().requests == 0
    finally:
        c.close()


def test_malformed_messages_are_refused_counted_and_survived(make_drafter: MakeDrafter) -> None:
    d = make_drafter(model="sim-small")
    peer = RawPeer(d.endpoint)
    try:
        peer.send(b"\xc1 garbage")
        peer.send(msgspec.msgpack.encode({"op": "round", "version": 1, "seq": 4, "k": 99,
                                          "items": []}))
        peer.send(msgspec.msgpack.encode({"op": "round", "version": 2, "seq": 5, "k": 1,
                                          "items": []}))
        peer.send(wire.encode(wire.round_(6, 1, [], model="other")))
        peer.send(b"a", b"b")
        replies = [wire.decode_reply([peer.recv() or b""]) for _ in range(5)]
        assert [(r.seq, r.reason) for r in replies if isinstance(r, wire.Error)] == [
            (0, "malformed"), (4, "malformed"), (5, "version"), (6, "model"),
            (0, "oversized")]
        assert "$.k" in replies[1].error  # type: ignore[union-attr]
        refused = d.stats().refused
        assert (refused["malformed"], refused["version"], refused["model"],
                refused["oversized"]) == (2, 1, 1, 1)
        # Still serving: a proper round gets its drafts.
        c = client(d.endpoint, deadline_s=5.0, model="sim-small")
        assert c.propose({"a": [1]}, 1) == {"a": [2]}
        c.close()
    finally:
        peer.close()


def test_an_error_reply_ends_the_wait_with_no_drafts(make_drafter: MakeDrafter) -> None:
    d = make_drafter(model="sim-small")
    c = client(d.endpoint, deadline_s=5.0, model="another-model")
    try:
        assert c.propose({"a": [1]}, 1) == {}
        assert c.counters.refused == 1 and c.counters.late == 0
    finally:
        c.close()


def test_curve_admits_the_cluster_and_refuses_the_rest(make_drafter: MakeDrafter) -> None:
    keys = CurveKeys.generate()
    d = make_drafter(curve=keys)
    plain = DraftClient(d.endpoint, deadline_s=0.2)
    stranger = DraftClient(d.endpoint, deadline_s=0.2, curve=CurveKeys.generate())
    # Another cluster's client key but this cluster's server key: refused by ZAP.
    other = CurveKeys.generate()
    impostor = CurveKeys(keys.server_public, "x" * 40, other.client_public, other.client_secret)
    sneaky = DraftClient(d.endpoint, deadline_s=0.2, curve=impostor)
    try:
        for c in (plain, stranger, sneaky):
            assert c.propose({"a": [1]}, 1) == {}
        member = client(d.endpoint, deadline_s=5.0, curve=keys)
        wait_for(lambda: d.stats().refused["unauthenticated"] >= 3,
                 "three refused handshakes counted")
        assert d.stats().rounds == 0  # nothing of theirs reached the drafter
        assert member.propose({"a": [1]}, 1) == {"a": [2]}
    finally:
        for c in (plain, stranger, sneaky):
            c.close()
        if "member" in locals():
            member.close()


def test_the_async_client_speaks_the_same_protocol(make_drafter: MakeDrafter) -> None:
    fn = EchoDrafter()
    d = make_drafter(fn)

    async def main() -> None:
        c = AsyncDraftClient(d.endpoint, deadline_s=5.0, context=zmq.asyncio.Context())
        try:
            assert await c.wait_connected(10)
            assert await c.propose({"a": [4, 5]}, 2) == {"a": [6, 7]}
            assert await c.propose({"a": [4, 5, 6, 9]}, 1) == {"a": [10]}
            fn.gate = threading.Event()
            c.deadline_s = 0.05
            assert await c.propose({"a": [4, 5, 6, 9, 10]}, 1) == {}
            assert c.counters.late == 1
            fn.gate.set()
            await c.release(["a"])
        finally:
            c.close()

    asyncio.run(main())
    wait_for(lambda: d.stats().requests == 0, "a released")


# -- the sim draft function ---------------------------------------------------------------


def test_a_perfect_sim_drafter_drafts_the_target_tokens() -> None:
    prompt = encode("the quick brown fox")
    target = reference_completion(3, prompt, 12)
    fn = SimDraftFunction(seed=3, agreement=1.0)
    assert fn.draft([DraftJob("r", prompt, 0)], 4) == [target[:4]]
    # Incremental: two drafts accepted, then the bonus token; the state is reused.
    ctx = prompt + target[:3]
    assert fn.draft([DraftJob("r", ctx, len(prompt) + 2)], 4) == [target[3:7]]


def test_a_noisy_sim_drafter_is_deterministic_and_sometimes_wrong() -> None:
    prompt = encode("hello")
    target = reference_completion(0, prompt, 400)
    agree = []
    for draft_seed in (1, 1, 2):
        fn = SimDraftFunction(seed=0, agreement=0.5, draft_seed=draft_seed)
        agree.append([fn.draft([DraftJob("r", prompt + target[:i], 0)], 1)[0][0] == target[i]
                      for i in range(400)])
    assert agree[0] == agree[1]   # same seed, same drafts
    assert agree[0] != agree[2]   # another seed, other drafts
    assert 120 < sum(agree[0]) < 280  # about half agree
    never = SimDraftFunction(seed=0, agreement=0.0)
    assert not any(never.draft([DraftJob("r", prompt + target[:i], 0)], 1)[0][0] == target[i]
                   for i in range(100))

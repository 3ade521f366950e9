"""The holder's bookkeeping, driven directly with a fake clock: budget, policies, TTL."""

from __future__ import annotations

import random

import pytest

from lumend.checkpoint.store import CheckpointStore, PageMeta, Policy, StoreRefusal

from .conftest import block_hash

PAGE = 100


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def make(budget: int, policy: Policy = "lru", workers: tuple[str, ...] = ("w0", "w1"),
         ttl_s: float = 60.0) -> tuple[CheckpointStore, Clock]:
    clock = Clock()
    return CheckpointStore(workers, budget, policy, ttl_s, clock=clock), clock


def put(store: CheckpointStore, ckpt: str, index: int, *, worker: str = "w0",
        tp_rank: int = 0, tp_size: int = 1, nbytes: int = PAGE, tokens: int | None = None,
        model: str = "tiny", fingerprint: str = "fp-1", request_id: str = "") -> int:
    return store.put(
        ckpt_id=ckpt, request_id=request_id or ckpt, worker=worker, model=model,
        fingerprint=fingerprint,
        tp_rank=tp_rank, tp_size=tp_size, block_hash=block_hash(ckpt, index),
        meta=PageMeta(index, tokens if tokens is not None else 16 * (index + 1), "uint8",
                      (nbytes,)),
        data=bytes(nbytes), nbytes=nbytes,
    ).reached


def check_invariants(store: CheckpointStore) -> None:
    for worker, stats in store.stats.items():
        mine = [c for c in store.checkpoints.values() if c.worker == worker]
        assert stats.bytes_held <= stats.budget_bytes, f"{worker} over budget"
        assert stats.bytes_held == sum(p.nbytes for c in mine for p in c.pages.values())
        assert stats.requests == len(mine)


@pytest.mark.parametrize("policy", ["lru", "shortest_prefix", "longest_prefix_protected",
                                    "refuse"])
@pytest.mark.parametrize("seed", range(5))
def test_the_budget_is_never_exceeded_under_a_random_workload(policy: Policy,
                                                               seed: int) -> None:
    rng = random.Random(seed)
    store, clock = make(budget=rng.randint(0, 40) * PAGE, policy=policy)
    next_block: dict[str, int] = {}
    refused = evicted = 0
    generation = dict.fromkeys(range(31), 0)  # a finished slot's next request: a new id
    for _ in range(3000):
        clock.now += rng.random()
        action = rng.random()
        slot = rng.randint(0, 30)
        ckpt = f"c{slot}.{generation[slot]}"
        if action < 0.75:
            index = next_block.get(ckpt, 0)
            try:
                put(store, ckpt, index, worker=rng.choice(["w0", "w1"]) if index == 0 else
                    store.checkpoints[ckpt].worker if ckpt in store.checkpoints else "w0",
                    nbytes=rng.choice([PAGE, PAGE // 2, 3 * PAGE]))
                next_block[ckpt] = index + 1
            except StoreRefusal as exc:
                assert exc.reason in ("budget", "evicted")
                refused += 1
        elif action < 0.85:
            store.finish(ckpt)
            next_block.pop(ckpt, None)
            generation[slot] += 1
        elif action < 0.95:
            store.lookup(ckpt, [block_hash(ckpt, i) for i in range(next_block.get(ckpt, 0))])
        else:
            store.collect_orphans()
        check_invariants(store)
        evicted = sum(s.evictions for s in store.stats.values())
    if policy == "refuse":
        assert evicted == 0
    assert sum(s.refusals for s in store.stats.values()) <= refused


def test_lru_evicts_the_least_recently_used() -> None:
    store, clock = make(budget=3 * PAGE, policy="lru")
    for i, ckpt in enumerate(("a", "b", "c")):
        clock.now = i
        put(store, ckpt, 0)
    clock.now = 10
    assert store.lookup("a", [block_hash("a", 0)]) == 1  # "a" is used again; "b" is oldest
    put(store, "d", 0)
    assert sorted(store.checkpoints) == ["a", "c", "d"]
    assert store.stats["w0"].evictions == 1


def test_shortest_prefix_evicts_the_fewest_tokens() -> None:
    store, _ = make(budget=3 * PAGE, policy="shortest_prefix")
    put(store, "long", 0, tokens=4000)
    put(store, "short", 0, tokens=16)
    put(store, "mid", 0, tokens=500)
    put(store, "new", 0, tokens=16)
    assert sorted(store.checkpoints) == ["long", "mid", "new"]


def test_longest_prefix_protected_never_evicts_the_longest() -> None:
    store, _ = make(budget=2 * PAGE, policy="longest_prefix_protected")
    put(store, "long", 0, tokens=4000)
    put(store, "short", 0, tokens=16)
    put(store, "new", 0, tokens=8)
    assert sorted(store.checkpoints) == ["long", "new"]


@pytest.mark.parametrize(("policy", "kept"), [("longest_prefix_protected", True),
                                              ("shortest_prefix", False)])
def test_only_the_protected_left_means_refusal(policy: Policy, kept: bool) -> None:
    store, _ = make(budget=PAGE, policy=policy)
    put(store, "long", 0, tokens=4000)
    if kept:
        with pytest.raises(StoreRefusal) as caught:
            put(store, "new", 0, tokens=8)
        assert caught.value.reason == "budget"
    else:  # negative control: without protection the long checkpoint goes
        put(store, "new", 0, tokens=8)
    assert ("long" in store.checkpoints) is kept


def test_refuse_keeps_what_it_holds_and_refuses_new_checkpoints() -> None:
    store, _ = make(budget=2 * PAGE, policy="refuse")
    put(store, "a", 0)
    put(store, "b", 0)
    with pytest.raises(StoreRefusal) as caught:
        put(store, "c", 0)
    assert caught.value.reason == "budget" and "refused" in str(caught.value)
    with pytest.raises(StoreRefusal) as later:  # the refused request simply has none
        put(store, "c", 1)
    assert later.value.reason == "evicted"
    assert sorted(store.checkpoints) == ["a", "b"]
    assert store.stats["w0"].refusals == 1 and store.stats["w0"].evictions == 0


def test_a_full_checkpoint_stops_growing_but_keeps_its_prefix() -> None:
    store, _ = make(budget=2 * PAGE, policy="lru")
    put(store, "a", 0)
    put(store, "a", 1)
    with pytest.raises(StoreRefusal):
        put(store, "a", 2)  # nothing else to evict: this page is refused
    assert store.lookup("a", [block_hash("a", i) for i in range(3)]) == 2


def test_budget_zero_holds_nothing() -> None:
    store, _ = make(budget=0)
    with pytest.raises(StoreRefusal) as caught:
        put(store, "a", 0)
    assert caught.value.reason == "budget"
    assert store.stats["w0"].bytes_held == 0 and store.stats["w0"].refusals == 1


def test_budgets_are_per_worker() -> None:
    store, _ = make(budget=PAGE, policy="refuse")
    put(store, "a", 0, worker="w0")
    put(store, "b", 0, worker="w1")
    assert (store.stats["w0"].bytes_held, store.stats["w1"].bytes_held) == (PAGE, PAGE)
    with pytest.raises(StoreRefusal) as caught:
        put(store, "c", 0, worker="w2")
    assert caught.value.reason == "unknown_worker"


def test_finish_frees_every_rank() -> None:
    store, _ = make(budget=10 * PAGE)
    for rank in (0, 1):
        put(store, "a", 0, tp_rank=rank, tp_size=2)
    assert store.finish("a") == 2 * PAGE
    assert store.stats["w0"].bytes_held == 0 and store.stats["w0"].requests == 0
    assert store.finish("a") == 0


def test_a_page_that_arrives_after_its_finish_is_refused_not_kept_as_an_orphan() -> None:
    """The engine's pages and its scheduler's FINISH travel on two connections: the last
    step's page can arrive after the FINISH. It must not grow the checkpoint back and hold
    budget until the TTL."""
    store, clock = make(budget=10 * PAGE, ttl_s=30)
    put(store, "a", 0)
    assert store.finish("a", "a") == PAGE
    assert store.finish("a", "a") == 0  # a repeated FINISH keeps it finished
    with pytest.raises(StoreRefusal) as caught:
        put(store, "a", 1)
    assert caught.value.reason == "finished" and "finished before this page" in str(caught.value)
    assert "a" not in store.checkpoints and store.stats["w0"].bytes_held == 0
    # Negative control: a FINISH from a request the checkpoint moved away from frees nothing,
    # and the checkpoint goes on growing.
    put(store, "b", 0, request_id="old")
    assert store.lookup("b", [block_hash("b", 0)], request_id="new") == 1
    assert store.finish("b", "old") is None
    put(store, "b", 1, request_id="new")
    assert store.checkpoints["b"].reached[0] == 2
    # The finished id is remembered for the TTL, then forgotten.
    clock.now = 31
    store.collect_orphans()
    put(store, "a", 0)
    assert store.checkpoints["a"].reached[0] == 1


def test_orphans_are_collected_after_the_ttl() -> None:
    store, clock = make(budget=10 * PAGE, ttl_s=30)
    put(store, "idle", 0)
    clock.now = 20
    put(store, "busy", 0)
    clock.now = 31
    assert store.collect_orphans() == ["idle"]
    assert sorted(store.checkpoints) == ["busy"] and store.stats["w0"].orphans == 1


def test_lookup_counts_blocks_complete_on_every_rank() -> None:
    store, _ = make(budget=100 * PAGE)
    for i in range(4):
        put(store, "a", i, tp_rank=0, tp_size=2)
    for i in (0, 1, 3):  # rank 1 lacks block 2
        put(store, "a", i, tp_rank=1, tp_size=2)
    chain = [block_hash("a", i) for i in range(4)]
    assert store.lookup("a", chain) == 2
    assert store.lookup("a", [block_hash("x", 0), *chain]) == 0
    put(store, "a", 2, tp_rank=1, tp_size=2)
    assert store.lookup("a", chain) == 4


def test_ack_reached_counts_consecutive_blocks() -> None:
    store, _ = make(budget=100 * PAGE)
    assert put(store, "a", 0) == 1
    assert put(store, "a", 2) == 1
    assert put(store, "a", 1) == 3


@pytest.mark.parametrize(("field", "value"), [("model", "other"), ("fingerprint", "fp-2")])
def test_a_page_of_another_layout_is_refused(field: str, value: str) -> None:
    store, _ = make(budget=100 * PAGE)
    put(store, "a", 0)
    with pytest.raises(StoreRefusal) as caught:
        put(store, "a", 1, **{field: value})  # type: ignore[arg-type]
    assert caught.value.reason == "fingerprint"
    assert store.lookup("a", [block_hash("a", 0), block_hash("a", 1)]) == 1

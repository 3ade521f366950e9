from __future__ import annotations

import math

import pytest

from lumend.coordinator.policy import (
    GIB,
    LoadSnapshot,
    Mode,
    PolicyConfig,
    Route,
    WorkerLoad,
    assist_target,
    choose_assist_target,
    choose_holder,
    least_loaded,
    load_hat,
    neighbour_holder,
    place_checkpoint,
    recover,
    route_interrupted,
)

CFG = PolicyConfig(alpha=1.0 / GIB, beta=1.0, theta=10.0, tau=8)


def snap(*workers: tuple[str, float, int], budget: float = math.inf,
         dead: tuple[int, ...] = ()) -> LoadSnapshot:
    """workers: (node, checkpoint GiB held, queue)."""
    return LoadSnapshot.from_workers([
        WorkerLoad(name=f"w{i}", node=node, ckpt_bytes=gib * GIB, queue=q, budget_bytes=budget,
                   alive=i not in dead)
        for i, (node, gib, q) in enumerate(workers)
    ])


def test_load_hat_weighs_checkpoint_bytes_and_queue() -> None:
    s = snap(("n0", 2.0, 3), ("n0", 0.0, 0))
    assert load_hat(s, 0, CFG) == pytest.approx(2.0 + 3.0)
    assert load_hat(s, 1, CFG) == 0.0
    heavy = PolicyConfig(alpha=10.0 / GIB, beta=0.0)
    assert load_hat(s, 0, heavy) == pytest.approx(20.0)


def test_holder_is_least_loaded_other_node_never_the_server() -> None:
    s = snap(("n0", 0.0, 0), ("n0", 0.0, 0), ("n1", 1.0, 5), ("n1", 0.5, 2))
    # Worker 1 is idler but shares the server's node: another node is preferred.
    assert choose_holder(s, serving=0, kv_bytes=1.0, cfg=CFG) == 3
    # Serving on n1: worker 0 and 1 tie on n0; the lower index wins.
    assert choose_holder(s, serving=3, kv_bytes=1.0, cfg=CFG) == 0


def test_holder_falls_back_to_same_node_and_respects_budget() -> None:
    s = snap(("n0", 0.0, 0), ("n0", 3.0, 0), ("n1", 3.9, 0), budget=4 * GIB)
    # 0.5 GiB more does not fit on worker 2 (3.9 + 0.5 > 4), so worker 1 on the same node.
    assert choose_holder(s, serving=0, kv_bytes=0.5 * GIB, cfg=CFG) == 1
    # Nothing fits anywhere: no checkpoint.
    assert choose_holder(s, serving=0, kv_bytes=2 * GIB, cfg=CFG) is None


def test_holder_skips_dead_workers_and_single_worker_has_none() -> None:
    s = snap(("n0", 0.0, 0), ("n1", 0.0, 0), ("n1", 5.0, 9), dead=(1,))
    assert choose_holder(s, serving=0, kv_bytes=1.0, cfg=CFG) == 2
    assert choose_holder(snap(("n0", 0.0, 0)), serving=0, kv_bytes=1.0, cfg=CFG) is None


def test_route_resumes_on_a_lightly_loaded_holder() -> None:
    s = snap(("n0", 0.0, 0), ("n1", 0.0, 4), ("n1", 0.0, 1))
    assert route_interrupted(s, holder=1, prefix_blocks=2, cfg=CFG) == Route(1, resume=True)


def test_route_recomputes_short_prefix_away_from_overloaded_holder() -> None:
    s = snap(("n0", 0.0, 0), ("n1", 0.0, 40), ("n1", 0.0, 1))
    assert route_interrupted(s, holder=1, prefix_blocks=2, cfg=CFG) == Route(0, resume=False)


def test_route_resumes_long_prefix_even_on_overloaded_holder() -> None:
    s = snap(("n0", 0.0, 0), ("n1", 0.0, 40))
    assert route_interrupted(s, holder=1, prefix_blocks=9, cfg=CFG) == Route(1, resume=True)
    # Exactly tau blocks is not "longer than tau".
    assert route_interrupted(s, holder=1, prefix_blocks=8, cfg=CFG) == Route(0, resume=False)


def test_route_boundaries_theta_inclusive_and_dead_or_missing_holder() -> None:
    s = snap(("n0", 0.0, 3), ("n1", 0.0, 10))
    assert route_interrupted(s, holder=1, prefix_blocks=1, cfg=CFG) == Route(1, resume=True)
    s_dead = snap(("n0", 0.0, 3), ("n1", 0.0, 0), dead=(1,))
    assert route_interrupted(s_dead, holder=1, prefix_blocks=50, cfg=CFG) == Route(0, False)
    assert route_interrupted(s, holder=None, prefix_blocks=50, cfg=CFG) == Route(0, False)
    # An empty checkpoint is not worth resuming from.
    assert route_interrupted(s, holder=1, prefix_blocks=0, cfg=CFG) == Route(0, False)
    assert route_interrupted(snap(("n0", 0.0, 0), dead=(0,)), None, 0, CFG) is None


def test_assist_target_is_most_loaded_survivor_ties_lowest_index() -> None:
    s = snap(("n0", 0.0, 5), ("n1", 0.0, 9), ("n1", 0.0, 9), ("n2", 0.0, 99), dead=(3,))
    assert choose_assist_target(s, CFG) == 1
    assert choose_assist_target(snap(("n0", 0.0, 1), dead=(0,)), CFG) is None


def test_least_loaded_ties_go_to_lowest_index() -> None:
    assert least_loaded(snap(("n0", 0.0, 2), ("n0", 0.0, 1), ("n1", 0.0, 1)), CFG) == 1


def test_neighbour_holder_is_static_same_position_on_next_node() -> None:
    nodes = [("n0", 0.0, 0), ("n0", 0.0, 0), ("n1", 0.0, 0), ("n1", 0.0, 0)]
    s = snap(*nodes)
    assert [neighbour_holder(s, i, 1.0) for i in range(4)] == [2, 3, 0, 1]
    # Load does not move it (that is the baseline's weakness) ...
    loaded = snap(("n0", 0.0, 0), ("n0", 0.0, 0), ("n1", 0.0, 500), ("n1", 0.0, 0))
    assert neighbour_holder(loaded, 0, 1.0) == 2
    # ... but a dead or full neighbour means no checkpoint.
    assert neighbour_holder(snap(*nodes, dead=(2,)), 0, 1.0) is None
    assert neighbour_holder(snap(*nodes, budget=0.5), 0, 1.0) is None
    assert neighbour_holder(snap(("n0", 0.0, 0), ("n0", 0.0, 0)), 1, 1.0) == 0


def test_modes_dispatch_to_baselines_and_mechanisms() -> None:
    s = snap(("n0", 0.0, 0), ("n0", 0.0, 0), ("n1", 0.0, 50), ("n1", 0.0, 0))
    restart = PolicyConfig(mode=Mode.stop_and_restart, theta=10, tau=8)
    fixed = PolicyConfig(mode=Mode.fixed_checkpoint, theta=10, tau=8)
    lumen = PolicyConfig(mode=Mode.lumen, theta=10, tau=8)
    assert place_checkpoint(s, 0, 1.0, restart) is None
    assert place_checkpoint(s, 0, 1.0, fixed) == 2          # static neighbour, though loaded
    assert place_checkpoint(s, 0, 1.0, lumen) == 3          # load-aware
    no_placement = PolicyConfig(mode=Mode.lumen, load_aware_placement=False)
    assert place_checkpoint(s, 0, 1.0, no_placement) == 2
    # Holder 2 overloaded, short prefix: fixed always resumes there, LUMEN recomputes.
    assert recover(s, 2, 3, fixed) == Route(2, resume=True)
    assert recover(s, 2, 3, lumen) == Route(0, resume=False)
    assert recover(s, 2, 3, restart) == Route(0, resume=False)
    assert assist_target(s, lumen) == 2
    assert assist_target(s, fixed) is None
    assert assist_target(s, PolicyConfig(mode=Mode.lumen, draft_assist=False)) is None


def test_config_rejects_negative_weights() -> None:
    with pytest.raises(ValueError, match="alpha"):
        PolicyConfig(alpha=-1.0)
    with pytest.raises(ValueError, match="tau"):
        PolicyConfig(tau=-1)


# -- fast paths and replicas ------------------------------------------------------------------


def test_fast_paths_decide_exactly_as_the_snapshot_functions() -> None:
    import random

    from lumend.coordinator.policy import choose_holder_in, least_loaded_in, loads

    rng = random.Random(5)
    checked = 0
    for _ in range(400):
        n = rng.randint(1, 9)
        s = LoadSnapshot(
            nodes=[f"n{rng.randint(0, 2)}" for _ in range(n)],
            ckpt_bytes=[rng.choice([0.0, 1.0, 2.0]) * GIB for _ in range(n)],
            queue=[rng.randint(0, 3) for _ in range(n)],
            budget_bytes=[rng.choice([1.5, 2.5, math.inf]) * GIB for _ in range(n)],
            alive=[rng.random() > 0.2 for _ in range(n)],
        )
        values = loads(s, CFG)
        assert least_loaded_in(values) == least_loaded(s, CFG)
        for serving in range(n):
            kv = rng.choice([0.25, 1.0]) * GIB
            expected = choose_holder(s, serving, kv, CFG)
            assert choose_holder_in(values, s, serving, kv) == expected
            checked += expected is not None
    assert checked > 500  # the cases are not all "no holder"


def test_dual_replicas_go_to_two_other_nodes_when_there_are_two() -> None:
    from lumend.coordinator.policy import choose_holders

    s = snap(("n0", 0.0, 0), ("n0", 0.0, 0), ("n1", 0.0, 3), ("n1", 0.0, 1), ("n2", 0.0, 2))
    # First the least loaded away from n0 (3 on n1), then one on a node of neither (4 on n2),
    # though worker 1 (the server's node) and 2 are idler or tied.
    assert choose_holders(s, 0, 1.0, CFG, replicas=2) == [3, 4]
    # Two nodes only: the second replica stays off the server's node (worker 2 over 1).
    two = snap(("n0", 0.0, 0), ("n0", 0.0, 0), ("n1", 0.0, 3), ("n1", 0.0, 1))
    assert choose_holders(two, 0, 1.0, CFG, replicas=2) == [3, 2]
    # One node: any other worker; budgets still rule.
    one = snap(("n0", 0.0, 0), ("n0", 0.0, 5), ("n0", 0.0, 1), budget=2 * GIB)
    assert choose_holders(one, 0, 1.0 * GIB, CFG, replicas=2) == [2, 1]
    assert choose_holders(one, 0, 3.0 * GIB, CFG, replicas=2) == []


def test_replicated_placement_dispatches_by_mode() -> None:
    from lumend.coordinator.policy import place_checkpoint_replicas

    nodes = [("n0", 0.0, 0), ("n0", 0.0, 0), ("n1", 0.0, 9), ("n1", 0.0, 0), ("n2", 0.0, 0)]
    s = snap(*nodes)
    fixed = PolicyConfig(mode=Mode.fixed_checkpoint)
    # Static chain: 0's neighbour is 2 (next node, same position), 2's is 4.
    assert place_checkpoint_replicas(s, 0, 1.0, fixed, 2) == [2, 4]
    assert place_checkpoint_replicas(s, 0, 1.0, fixed, 1) == [place_checkpoint(s, 0, 1.0, fixed)]
    assert place_checkpoint_replicas(s, 0, 1.0, PolicyConfig(mode=Mode.stop_and_restart), 2) == []
    assert place_checkpoint_replicas(s, 0, 1.0, CFG, 1) == [place_checkpoint(s, 0, 1.0, CFG)]
    with pytest.raises(ValueError, match="replicas"):
        place_checkpoint_replicas(s, 0, 1.0, CFG, 0)


def test_interrupted_request_is_routed_against_its_least_loaded_live_replica() -> None:
    from lumend.coordinator.policy import choose_replica

    s = snap(("n0", 0.0, 0), ("n1", 0.0, 7), ("n1", 0.0, 2), ("n2", 0.0, 1), dead=(3,))
    assert choose_replica(s, [1, 2], CFG) == 2
    assert choose_replica(s, [3, 1], CFG) == 1  # the dead replica is skipped
    assert choose_replica(s, [3], CFG) is None
    assert choose_replica(s, [], CFG) is None


def test_paper_worked_example_a_workers_checkpoints_spread_over_three_peers() -> None:
    """The LUMEN paper's example: worker 0 serves 10 requests whose checkpoints are placed
    one after another, each placement seeing the bytes the earlier ones added. Algorithm 1
    spreads them over the three peers; fixed checkpointing puts all 10 on the neighbour, so
    when worker 0 fails one peer takes every interrupted request."""
    size = 1.0 * GIB
    cfg_lumen = PolicyConfig(alpha=1.0 / GIB, beta=1.0, theta=10.0, tau=8, mode=Mode.lumen)
    cfg_fixed = PolicyConfig(alpha=1.0 / GIB, beta=1.0, theta=10.0, tau=8,
                             mode=Mode.fixed_checkpoint)

    def place_ten(cfg: PolicyConfig) -> list[int]:
        held = [0.0, 0.0, 0.0, 0.0]
        holders = []
        for _ in range(10):
            snapshot = LoadSnapshot.from_workers([
                WorkerLoad(name=f"w{i}", node=f"n{i}", ckpt_bytes=held[i], queue=2)
                for i in range(4)])
            holder = place_checkpoint(snapshot, 0, size, cfg)
            assert holder is not None and holder != 0
            held[holder] += size
            holders.append(holder)
        return holders

    lumen, fixed = place_ten(cfg_lumen), place_ten(cfg_fixed)
    assert sorted(set(lumen)) == [1, 2, 3]
    assert max(lumen.count(h) for h in (1, 2, 3)) == 4  # 4/3/3: as even as 10 allows
    assert set(fixed) == {1}  # the static neighbour takes all ten

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

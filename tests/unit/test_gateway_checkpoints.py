"""Placement and recovery routing of the gateway, over a decoded view (no processes)."""

from __future__ import annotations

from dataclasses import replace

from lumend.cluster.models import (
    CheckpointUsage,
    ClusterSettings,
    NodeRecord,
    WorkerLoad,
    WorkerRecord,
)
from lumend.cluster.view import ClusterView
from lumend.coordinator.policy import Mode, PolicyConfig
from lumend.coordinator.settings import policy_config
from lumend.gateway.checkpoints import place, route

GIB = 1 << 30


def node(name: str) -> NodeRecord:
    return NodeRecord(name=name, address="10.0.0.1", pid=1, version="0", started_at=0,
                      updated_at=0, gateway="g", rpc="r", checkpoint=f"{name}:7441",
                      metrics="m")


def worker(name: str, node_name: str, running: int = 0, held: int = 0,
           budget: int = GIB, state: str = "serving") -> WorkerRecord:
    return WorkerRecord(name=name, node=node_name, gpus=[0], engine="sim", model="m",
                        state=state,  # type: ignore[arg-type]
                        load=WorkerLoad(running=running),
                        checkpoints=CheckpointUsage(bytes_held=held, budget_bytes=budget),
                        updated_at=0)


def view(*workers: WorkerRecord) -> ClusterView:
    nodes = {w.node for w in workers}
    return ClusterView(cluster="t", revision=1, nodes={n: node(n) for n in nodes},
                       workers={w.name: w for w in workers})


def test_holder_is_the_least_loaded_elsewhere_with_budget() -> None:
    v = view(worker("a0", "a", running=1), worker("b0", "b", running=5),
             worker("c0", "c", running=2), worker("c1", "c", running=0, budget=0))
    placement = place(v, "a0", "req")
    assert placement is not None
    assert (placement.worker, placement.endpoint) == ("c0", "tcp://c:7441")
    assert placement.params("save")["lumen"]["mode"] == "save"
    # Nobody with budget: no checkpoint; stop-and-restart: none either.
    assert place(view(worker("a0", "a"), worker("b0", "b", budget=0)), "a0", "r") is None
    assert place(v, "a0", "r", PolicyConfig(mode=Mode.stop_and_restart)) is None


def test_recovery_resumes_on_the_holder_unless_it_is_overloaded() -> None:
    v = view(worker("a0", "a"), worker("b0", "b", running=1), worker("c0", "c", running=0))
    placement = place(v, "a0", "req")
    assert placement is not None and placement.worker == "c0"
    assert route(v, placement, "a0", prefix_tokens=160) == ("c0", True)
    # The holder is overloaded and the prefix short: recompute on the least-loaded survivor.
    busy = view(worker("a0", "a"), worker("b0", "b", running=1), worker("c0", "c", running=99))
    assert route(busy, placement, "a0", prefix_tokens=32) == ("b0", False)
    # ...unless the prefix is long (more than tau blocks): resume anyway (the paper's
    # decisions). Cost-aware ones compare estimated seconds: the restore runs beside the
    # holder's engine and stalls none of its 99 running requests, so resuming wins; with
    # restores inside the holder's step (vLLM before 2026-12-07) those 99 would wait for it
    # and recomputing 65 blocks elsewhere wins.
    paper = policy_config(ClusterSettings(decisions="paper"))
    assert route(busy, placement, "a0", prefix_tokens=16 * 65, cfg=paper) == ("c0", True)
    assert route(busy, placement, "a0", prefix_tokens=16 * 65) == ("c0", True)
    in_step = replace(policy_config(ClusterSettings()), restore_beside_engine=False)
    assert route(busy, placement, "a0", prefix_tokens=16 * 65, cfg=in_step) == ("b0", False)
    # No checkpoint: recompute on the least-loaded survivor, never on the failed worker.
    assert route(v, None, "a0", prefix_tokens=160) == ("c0", False)


def test_degraded_recovery_reads_queued_work_as_the_coordinator_does() -> None:
    """Cost-aware (the default): a worker's queued work is its requests not yet running
    (lumend.coordinator.loadbook); running ones have had their prefill. Counting them as
    queued work, the gateway's fallback decided otherwise than the coordinator would. The
    recompute target is the survivor admission would pick (the shortest queue, running and
    waiting, as stop-and-restart recomputes)."""
    from msgspec.structs import replace

    running = worker("b0", "b", running=4)
    waiting = replace(worker("c0", "c"), load=WorkerLoad(running=0, waiting=2))
    v = view(worker("a0", "a"), running, waiting)
    assert route(v, None, "a0", prefix_tokens=160) == ("c0", False)
    # A checkpoint held by b0: resumed there, its 4 running requests being no queued work;
    # counted as queued work, they would send it to recompute on c0.
    on_b0 = place(view(worker("a0", "a"), worker("b0", "b")), "a0", "req")
    assert on_b0 is not None and on_b0.worker == "b0"
    assert route(v, on_b0, "a0", prefix_tokens=160) == ("b0", True)
    # The paper's decisions count every request in the queue.
    paper = policy_config(ClusterSettings(decisions="paper"))
    assert route(v, None, "a0", prefix_tokens=160, cfg=paper) == ("c0", False)

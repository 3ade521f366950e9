"""The coordinator's decisions over a decoded view (no processes): admission, placement,
recovery, progress, settings; and the agent's epoch fence."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from lumend.cluster.fencing import EpochFence
from lumend.cluster.models import ClusterSettings, Intent, WorkerRecord
from lumend.cluster.view import ClusterView
from lumend.coordinator.service import CoordinatorService
from lumend.rpc.agent_service import AgentService, CommandRefused
from lumend.rpc.messages import CheckpointProgress, RecoverAsk

from ..unit.test_gateway_checkpoints import GIB, node, worker


def engines(w: WorkerRecord) -> WorkerRecord:
    from msgspec.structs import replace

    from lumend.cluster.models import EngineInfo

    return replace(w, engines=[EngineInfo(id=f"{w.name}-e0", role="active", state="active",
                                          url=f"http://{w.name}:1")])


def view(*workers: WorkerRecord, settings: ClusterSettings | None = None,
         intents: list[Intent] | None = None) -> ClusterView:
    return ClusterView(cluster="t", revision=1, nodes={w.node: node(w.node) for w in workers},
                       workers={w.name: engines(w) for w in workers}, settings=settings,
                       intents=intents or [])


def test_admission_goes_to_the_least_loaded_and_counts_its_own_queue() -> None:
    v = view(worker("a0", "a", running=1), worker("b0", "b"), worker("c0", "c"))
    service = CoordinatorService("a", 7, lambda: v)
    first = service.admit("r1", "m", "gw")
    assert first.epoch == 7 and first.target is not None and first.target.worker == "b0"
    assert first.target.urls == ("http://b0:1",)
    assert first.checkpoint is not None and first.checkpoint.holder == "c0"
    assert first.checkpoint.endpoint == "tcp://c:7441"
    # b0 now has one request from this coordinator that its heartbeat does not show yet.
    second = service.admit("r2", "m", "gw")
    assert second.target is not None and second.target.worker == "c0"
    assert service.finish("r1") and not service.finish("r1")
    assert service.admit("r3", "m", "gw", exclude=["b0", "c0"]).target.worker == "a0"  # type: ignore[union-attr]
    none = service.admit("r4", "other-model", "gw")
    assert none.target is None and "no serving worker" in none.reason


def test_drained_and_failed_workers_get_nothing() -> None:
    drain = Intent(kind="drain", target="b", target_kind="node", requested_at=0,
                   requested_by="op")
    v = view(worker("a0", "a", running=5), worker("b0", "b"),
             worker("c0", "c", state="failed"), intents=[drain])
    admission = CoordinatorService("a", 1, lambda: v).admit("r", None, "gw")
    assert admission.target is not None and admission.target.worker == "a0"
    assert admission.checkpoint is None  # the only other workers are drained or failed


def test_progress_weighs_a_holder_by_the_bytes_it_holds() -> None:
    settings = ClusterSettings(alpha=1.0 / GIB, beta=1.0)
    v = view(worker("a0", "a", running=9), worker("b0", "b", running=1),
             worker("c0", "c", running=1), settings=settings)
    service = CoordinatorService("a", 1, lambda: v)
    admission = service.admit("r", None, "gw")
    assert admission.checkpoint is not None
    holder = admission.checkpoint.holder
    # The holder now reports 3 GiB of pages: L_hat 1 + 3; the other is the better holder.
    assert service.progress(CheckpointProgress(admission.checkpoint.ckpt_id, holder, 3 * GIB,
                                               480))
    assert not service.progress(CheckpointProgress("unknown", holder, 1, 1))
    other = service.admit("r2", None, "gw", exclude=["b0", "c0"])
    assert other.checkpoint is not None and other.checkpoint.holder != holder
    service.progress(CheckpointProgress(admission.checkpoint.ckpt_id, holder, 0, 0))
    assert admission.checkpoint.ckpt_id not in service.held


def test_a_new_coordinator_recovers_with_the_gateways_placement() -> None:
    v = view(worker("a0", "a"), worker("b0", "b", running=1), worker("c0", "c"))
    old = CoordinatorService("a", 3, lambda: v)
    admission = old.admit("r", None, "gw")
    assert admission.target is not None and admission.checkpoint is not None
    assert (admission.target.worker, admission.checkpoint.holder) == ("a0", "c0")
    ask = RecoverAsk("r", admission.target.worker, 160, "", admission.checkpoint, "gw")
    # Elected after the old one died: it knows nothing but etcd and what the gateway says.
    new = CoordinatorService("b", 9, lambda: v)
    recovery = new.recover(ask)
    assert recovery.epoch == 9 and recovery.resume
    assert recovery.target is not None
    assert recovery.target.worker == admission.checkpoint.holder
    # The holder reports holding only one block: with the holder loaded above theta (the
    # paper's decisions), so short a prefix is recomputed on the least-loaded survivor.
    new.progress(CheckpointProgress(admission.checkpoint.ckpt_id, admission.checkpoint.holder,
                                    4096, 16))
    strict = view(worker("a0", "a"), worker("b0", "b", running=1), worker("c0", "c", running=2),
                  settings=ClusterSettings(theta=0.5, decisions="paper"))
    new._view = lambda: strict
    rerouted = new.recover(RecoverAsk("r", admission.target.worker, 160, "",
                                      admission.checkpoint, "gw"))
    assert not rerouted.resume and rerouted.target is not None
    assert rerouted.target.worker == "b0"
    assert "prefix 1 blocks" in rerouted.reason


def test_policy_settings_come_from_the_view() -> None:
    v = view(worker("a0", "a"), worker("b0", "b"),
             settings=ClusterSettings(mode="stop_and_restart"))
    admission = CoordinatorService("a", 1, lambda: v).admit("r", None, "gw")
    assert admission.policy == "stop_and_restart" and admission.checkpoint is None
    assert "stop_and_restart" in admission.reason


def test_agent_commands_are_fenced_by_epoch() -> None:
    fence = EpochFence()
    done: list[str] = []

    async def failover(worker: str, requested_at: float, by: str) -> tuple[str, float]:
        done.append(f"{worker} {by}")
        return "e1", 0.5

    records = [worker("n1-w0", "n1", running=2)]
    agent = AgentService("n1", fence, lambda: records, lambda: "following", failover)
    fence.observe(41)  # seen in etcd: epoch 41 is the coordinator now
    with pytest.raises(CommandRefused) as stale:
        agent.drain(10, "n1", undo=False)
    assert stale.value.code == grpc.StatusCode.FAILED_PRECONDITION
    assert "epoch 10" in str(stale.value) and "epoch 41" in str(stale.value)
    with pytest.raises(CommandRefused) as unsigned:
        agent.drain(0, "n1", undo=False)
    assert unsigned.value.code == grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(CommandRefused):
        asyncio.run(agent.failover(40, "n1-w0"))
    assert agent.stale_refused == 2 and done == [] and agent.drained == set()
    # The current epoch is obeyed.
    assert agent.drain(41, "n1", undo=False) == (["n1-w0"], 2)
    assert asyncio.run(agent.failover(41, "n1-w0")) == ("e1", 0.5)
    assert done == ["n1-w0 ordered by coordinator epoch 41"]
    with pytest.raises(CommandRefused) as unknown:
        agent.drain(41, "elsewhere", undo=False)
    assert unknown.value.code == grpc.StatusCode.NOT_FOUND
    status = agent.status()
    assert status.highest_epoch == 41 and status.stale_refused == 2
    assert status.workers[0].drained


def test_the_checkpoint_never_lands_on_the_worker_it_protects() -> None:
    # Admission leaves a0 out (excluded), so b0 is index 0 of the admission table but
    # index 1 among the holders: placement must exclude b0 itself, not a0.
    v = view(worker("a0", "a"), worker("b0", "b"), worker("c0", "c", running=3))
    service = CoordinatorService("a", 1, lambda: v)
    for i in range(4):
        admission = service.admit(f"r{i}", "m", "gw", exclude=["a0"])
        assert admission.target is not None and admission.checkpoint is not None
        assert admission.checkpoint.holder != admission.target.worker, admission.reason

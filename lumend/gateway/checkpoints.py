"""Checkpoint placement and recovery routing for the gateway's requests when the coordinator
cannot answer (degraded mode): the policy functions (Algorithms 1 and 2) the coordinator and
the simulator call, applied to this node's view of the cluster with the cluster's settings.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from lumend.cluster.view import ClusterView
from lumend.coordinator.policy import (
    LoadSnapshot,
    PolicyConfig,
    WorkerLoad,
    place_checkpoint,
    queued_prefill_s,
)
from lumend.coordinator.policy import recover as policy_recover
from lumend.coordinator.settings import measured_policy_config

BLOCK_TOKENS = 16


@dataclass(frozen=True)
class Placement:
    ckpt_id: str
    worker: str  # the holder: a worker on the node whose holder keeps the pages
    endpoint: str  # tcp://host:port of that node's holder

    def params(self, mode: str) -> dict[str, Any]:
        return {"lumen": {"ckpt_id": self.ckpt_id, "holder": self.endpoint,
                          "worker": self.worker, "mode": mode}}


def _snapshot(view: ClusterView, down: str | None, cfg: PolicyConfig
              ) -> tuple[list[str], LoadSnapshot]:
    """The heartbeats' loads, as the coordinator reads them (lumend.coordinator.loadbook):
    cost-aware, each worker's queued work in seconds from its request counts."""
    workers = sorted((w for w in view.workers.values() if w.node in view.nodes),
                     key=lambda w: w.name)
    names = [w.name for w in workers]
    snapshot = LoadSnapshot.from_workers([
        WorkerLoad(name=w.name, node=w.node, ckpt_bytes=float(w.checkpoints.bytes_held),
                   queue=w.load.running + w.load.waiting,
                   budget_bytes=float(w.checkpoints.budget_bytes),
                   alive=w.state == "serving" and w.name != down and not w.stalled
                   and not any(i.kind == "drain" for i in view.intents_for(w)),
                   work_s=(queued_prefill_s(w.load.running + w.load.waiting, w.load.running,
                                            cfg) if cfg.cost_aware else None))
        for w in workers
    ])
    return names, snapshot


def place(view: ClusterView, serving: str, ckpt_id: str,
          cfg: PolicyConfig | None = None) -> Placement | None:
    """Algorithm 1 (or the configured baseline) for a request served by `serving`."""
    cfg = cfg or measured_policy_config(view.settings, view.workers.values())
    names, snapshot = _snapshot(view, None, cfg)
    if serving not in names:
        return None
    # The size is not known up front; one byte asks for a holder with any budget at all.
    index = place_checkpoint(snapshot, names.index(serving), 1.0, cfg)
    if index is None:
        return None
    holder = view.workers[names[index]]
    return Placement(ckpt_id, holder.name, "tcp://" + view.nodes[holder.node].checkpoint)


def route(view: ClusterView, placement: Placement | None, broken: str, prefix_tokens: int,
          cfg: PolicyConfig | None = None) -> tuple[str, bool] | None:
    """Algorithm 2 (or the baseline) for a request whose worker `broken` failed: the worker
    to continue on and whether to resume there from the checkpoint."""
    cfg = cfg or measured_policy_config(view.settings, view.workers.values())
    names, snapshot = _snapshot(view, broken, cfg)
    holder = (names.index(placement.worker)
              if placement is not None and placement.worker in names else None)
    # Cost-aware: by estimated completion of the whole context, as the coordinator decides.
    decision = policy_recover(snapshot, holder, prefix_tokens // BLOCK_TOKENS, cfg,
                              prefix_tokens)
    return None if decision is None else (names[decision.worker], decision.resume)

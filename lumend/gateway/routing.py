"""Where the gateway sends a request: pure functions over the cluster view.

Admissions go through the coordinator (lumend/gateway/coordinator.py); when it cannot answer
the admission is local: the least-loaded serving worker as this node last read the cluster,
counting the requests this gateway itself has in flight there since (the view's load is a
heartbeat old).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from lumend.cluster.models import WorkerRecord
from lumend.cluster.view import ClusterView


@dataclass(frozen=True)
class Target:
    worker: str
    model: str  # the worker's served name (its record's model), what its engines answer to
    urls: tuple[str, ...]  # the active engine first, then the others (a shadow may take over)

    @classmethod
    def of(cls, worker: WorkerRecord) -> Target:
        return cls(worker.name, worker.model, engine_urls(worker))


def engine_urls(worker: WorkerRecord) -> tuple[str, ...]:
    active = [e.url for e in worker.engines if e.role == "active"]
    others = [e.url for e in worker.engines if e.role != "active"]
    return (*active, *others)


def drained(view: ClusterView, worker: WorkerRecord) -> bool:
    return any(i.kind == "drain" for i in view.intents_for(worker))


def choose_worker(
    view: ClusterView,
    model: str | None,
    in_flight: Mapping[str, int],
    exclude: frozenset[str] = frozenset(),
) -> Target | None:
    """The least-loaded serving worker for `model` (any model when None), or None; a
    stalled one (its engine missed a probe) only when no other serves."""
    candidates = [
        w for w in view.workers.values()
        if w.state == "serving" and w.name not in exclude and not drained(view, w)
        and (model is None or w.model == model) and w.engines
    ]
    if not candidates:
        return None
    best = min(candidates, key=lambda w: (bool(w.stalled), w.load.running + w.load.waiting
                                          + in_flight.get(w.name, 0), w.name))
    return Target.of(best)


def models(view: ClusterView) -> list[str]:
    """Every name the cluster serves under: workers' served names and their aliases."""
    return sorted({name for w in view.workers.values() for name in (w.model, *w.aliases)})


def served_as(view: ClusterView, name: str) -> str | None:
    """The served name (a worker record's `model`) a request for `name` routes to: `name`
    itself when a worker serves under it, else the worker's whose alias it is; None when no
    worker serves it. Requests go on under that name, which the engine answers as vLLM does
    (an alias's responses carry the first served name)."""
    workers = view.workers.values()
    if any(w.model == name for w in workers):
        return name
    return next((w.model for w in workers if name in w.aliases), None)

"""A node's part in draft-assist: attach its survivors' engines to the drafters the
coordinator assigned, and publish what they accept.

Every tick it reads the assignments (`assist/` in the node's etcd view; only the coordinator
writes them, epoch-guarded) and asks each local worker's active engine what it is attached
to (GET /lumen/assist); where that differs from the assignment it attaches (POST) or
detaches (DELETE). So an engine that restarted or failed over is attached again, and an
assignment that ended is detached, from fresh observations alone. The engine's counters
for the assignment go into the worker's etcd record (`assist`) and Prometheus.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import aiohttp
import msgspec
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from lumend.cluster.models import AssistAssignment, AssistUsage, WorkerRecord
from lumend.cluster.view import ClusterView

log = logging.getLogger("lumend.assist")

KEPT_ASSIGNMENTS = 64  # ended assignments whose counters stay exported


class AssistLinks:
    def __init__(self, view: Callable[[], ClusterView | None],
                 workers: Callable[[], Sequence[WorkerRecord]], *, tick_s: float = 0.25,
                 timeout_s: float = 2.0) -> None:
        self._view = view
        self._workers = workers
        self.tick_s = tick_s
        self.timeout_s = timeout_s
        self.usage: dict[str, AssistUsage] = {}  # by local worker, while assisted
        # (survivor, usage) by assignment id, newest last: what Prometheus exports.
        self.history: OrderedDict[str, tuple[str, AssistUsage]] = OrderedDict()
        self.attaches = 0
        self.detaches = 0
        self.errors = 0
        self._warned: set[str] = set()

    async def run(self, stop: asyncio.Event) -> None:
        timeout = aiohttp.ClientTimeout(total=self.timeout_s)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            while not stop.is_set():
                with contextlib.suppress(Exception):  # logged in tick; never stop the node
                    await self.tick(session)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), self.tick_s)

    async def tick(self, session: aiohttp.ClientSession) -> None:
        view = self._view()
        if view is None:
            return
        by_survivor = {a.survivor: a for a in view.assists.values()}
        await asyncio.gather(*(self._link(session, w, by_survivor.get(w.name))
                               for w in self._workers()))

    async def _link(self, session: aiohttp.ClientSession, worker: WorkerRecord,
                    assignment: AssistAssignment | None) -> None:
        active = [e for e in worker.engines if e.role == "active" and e.state == "active"]
        if not active:
            self.usage.pop(worker.name, None)
            return
        url = active[0].url + "/lumen/assist"
        # Attaching and detaching control the engine: its gate wants lumend's token.
        from lumend.engine.engine_auth import control_headers

        headers = control_headers(active[0].id)
        try:
            async with session.get(url) as r:
                # 404: no /lumen/assist; 409: a vLLM worker without `assist = true`
                if r.status in (404, 409):
                    if assignment is not None and worker.name not in self._warned:
                        self._warned.add(worker.name)
                        log.warning("worker %s was assigned drafter %s, but its engine takes "
                                    "no drafts (no /lumen/assist, or the worker's assist is "
                                    "off): no draft-assist there", worker.name,
                                    assignment.recovering)
                    return
                r.raise_for_status()
                info: dict[str, Any] = await r.json()
            attached = info.get("assignment") if info.get("attached") else None
            if assignment is not None and attached != assignment.id:
                async with session.post(url, json={"endpoint": assignment.endpoint,
                                                   "assignment": assignment.id},
                                        headers=headers) as r:
                    r.raise_for_status()
                    info = await r.json()
                self.attaches += 1
                log.info("%s: engine attached to drafter %s at %s (assignment %s)",
                         worker.name, assignment.recovering, assignment.endpoint, assignment.id)
            elif assignment is None and attached is not None:
                async with session.delete(url, headers=headers) as r:
                    r.raise_for_status()
                self.detaches += 1
                log.info("%s: engine detached from its drafter (assignment %s ended)",
                         worker.name, attached)
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            self.errors += 1
            log.warning("%s: draft-assist link to %s failed: %r", worker.name, url, exc)
            return
        if assignment is None:
            self.usage.pop(worker.name, None)
            return
        counters = info.get("assignments", {}).get(assignment.id, {})
        usage = AssistUsage(assignment=assignment.id, drafter=assignment.recovering,
                            drafted_tokens=int(counters.get("drafted_tokens", 0)),
                            accepted_tokens=int(counters.get("accepted_tokens", 0)))
        self.usage[worker.name] = usage
        self.history[assignment.id] = (worker.name, usage)
        self.history.move_to_end(assignment.id)
        while len(self.history) > KEPT_ASSIGNMENTS:
            self.history.popitem(last=False)

    def decorate(self, record: WorkerRecord) -> WorkerRecord:
        """The worker's record with the assist its engine reports (None when not assisted)."""
        usage = self.usage.get(record.name)
        return record if usage == record.assist else msgspec.structs.replace(record,
                                                                              assist=usage)


class AssistCollector(Collector):
    """Draft-assist acceptance per assignment, as this node's survivor engines count it."""

    def __init__(self, links: AssistLinks) -> None:
        self._links = links

    def collect(self) -> Iterator[Metric]:
        labels = ["worker", "drafter", "assignment"]
        drafted = CounterMetricFamily("lumen_assist_drafted_tokens", "Drafted tokens the "
                                      "survivor's engine verified, per assignment.",
                                      labels=labels)
        accepted = CounterMetricFamily("lumen_assist_accepted_tokens", "Drafted tokens the "
                                       "survivor's engine accepted, per assignment.",
                                       labels=labels)
        acceptance = GaugeMetricFamily("lumen_assist_acceptance", "Accepted / drafted tokens "
                                       "of the assignment (absent before any draft).",
                                       labels=labels)
        for assignment, (worker, u) in self._links.history.items():
            values = [worker, u.drafter, assignment]
            drafted.add_metric(values, u.drafted_tokens)
            accepted.add_metric(values, u.accepted_tokens)
            if u.drafted_tokens:
                acceptance.add_metric(values, u.accepted_tokens / u.drafted_tokens)
        yield from (drafted, accepted, acceptance)

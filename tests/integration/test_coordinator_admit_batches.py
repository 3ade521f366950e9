"""Admissions batched under load (issue 16), through real gRPC: the gateway's link sends at
most a few Admit calls at once and the admissions asked meanwhile together in the next one;
the coordinator decides them in order, so a burst stays as balanced as one call each. A
coordinator of an earlier release (answering the first admission of a call only) still
answers every admission, one per call; a coordinator that is gone fails them all at once
(each decided locally, counted as degraded)."""

from __future__ import annotations

import asyncio
from collections import Counter
from typing import Any

import grpc
from prometheus_client import CollectorRegistry

from lumend.cluster.models import CoordinatorRecord
from lumend.cluster.view import ClusterView, Coordinator
from lumend.coordinator.service import CoordinatorService
from lumend.gateway.coordinator import CoordinatorLink, LinkTiming
from lumend.gateway.metrics import CoordinatorLinkCollector
from lumend.rpc import lumen_pb2 as pb
from lumend.rpc import lumen_pb2_grpc as stubs
from lumend.rpc.messages import Admission
from lumend.rpc.server import CoordinatorServicer

from ..rpc.test_coordinator_service import view as decoded_view
from ..unit.test_gateway_checkpoints import GIB, worker

WORKERS = [worker(f"n{n}-w{k}", f"n{n}", budget=1024 * GIB) for n in range(4) for k in range(3)]
BURST = 600


class Counting(CoordinatorServicer):
    """The coordinator's servicer, counting Admit calls; `earlier_release` answers the first
    admission of a call only, as a coordinator whose AdmitRequest has no `more`."""

    def __init__(self, service: CoordinatorService, earlier_release: bool = False) -> None:
        super().__init__(lambda: service, lambda: "-", lambda s: None)
        self.calls = 0
        self.earlier_release = earlier_release

    async def Admit(self, request: pb.AdmitRequest, context: Any) -> pb.AdmitReply:
        self.calls += 1
        if self.earlier_release:
            del request.more[:]
        return await super().Admit(request, context)


def with_coordinator(base: ClusterView, address: str) -> ClusterView:
    record = CoordinatorRecord(node="n0", address="127.0.0.1", rpc=address, elected_at=0)
    return ClusterView(cluster="t", revision=1, nodes=base.nodes, workers=base.workers,
                       coordinator=Coordinator(record=record, epoch=5, lease=1))


def burst(earlier_release: bool, stop_first: bool = False
          ) -> tuple[list[Admission | None], Counting, CoordinatorService, CoordinatorLink]:
    base = decoded_view(*WORKERS)

    async def scenario() -> tuple[list[Admission | None], Counting, CoordinatorService,
                                  CoordinatorLink]:
        service = CoordinatorService("n0", 5, lambda: base)
        servicer = Counting(service, earlier_release)
        server = grpc.aio.server()
        stubs.add_CoordinatorServicer_to_server(servicer, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        current = with_coordinator(base, f"127.0.0.1:{port}")
        # Deadlines far beyond any decision: this test is about what is decided, not when
        # (the machine may be loaded); timings are bench/admission.py's.
        link = CoordinatorLink("gw", lambda: current,
                               timing=LinkTiming(admit_deadline_s=60.0))
        try:
            if stop_first:
                await server.stop(0)
            admitted = await asyncio.gather(*(link.admit(f"r{i}", None, ())
                                              for i in range(BURST)))
        finally:
            await link.close()
            await server.stop(0)
        return admitted, servicer, service, link

    return asyncio.run(scenario())


def test_a_burst_goes_in_batches_and_stays_balanced() -> None:
    admitted, servicer, service, link = burst(earlier_release=False)
    assert all(a is not None and a.target is not None and a.epoch == 5 for a in admitted)
    assert len(service.requests) == BURST and link.admit_calls["admissions"] == BURST
    assert servicer.calls < BURST // 10, "batches, not a call per admission"
    # Decided in order: the very placements of one call per admission, in some order.
    base = decoded_view(*WORKERS)
    reference = CoordinatorService("n0", 5, lambda: base)
    one_by_one = [reference.admit(f"r{i}", None, "gw") for i in range(BURST)]
    assert placements(admitted) == placements(one_by_one)
    served = Counter(a.target.worker for a in admitted if a is not None and a.target)
    assert max(served.values()) - min(served.values()) <= 1, served
    assert not link.degraded
    # What an operator sees of it: calls and admissions, whose ratio is the mean batch.
    assert scraped(link, "lumen_gateway_admit_calls_total") == servicer.calls
    assert scraped(link, "lumen_gateway_admit_call_admissions_total") == BURST


def scraped(link: CoordinatorLink, name: str, labels: dict[str, str] | None = None) -> float:
    registry = CollectorRegistry()
    registry.register(CoordinatorLinkCollector(link))
    value = registry.get_sample_value(name, labels)
    assert value is not None, f"{name} not exported"
    return value


def placements(admitted: list[Admission] | list[Admission | None]) -> Counter[tuple[str, str]]:
    return Counter((a.target.worker, a.checkpoint.holder) for a in admitted
                   if a is not None and a.target is not None and a.checkpoint is not None)


def test_a_coordinator_of_an_earlier_release_answers_every_admission_one_per_call() -> None:
    admitted, servicer, service, link = burst(earlier_release=True)
    assert all(a is not None and a.target is not None for a in admitted)
    assert len(service.requests) == BURST
    assert len({a.target.worker for a in admitted if a is not None and a.target}) == 12
    # Control for the test above: without `more` each admission costs a call of its own
    # (the first batch is what tells the link).
    assert servicer.calls > BURST - 2 * link.timing.admit_batch
    assert not link.degraded


def test_a_gone_coordinator_fails_the_whole_burst_at_once() -> None:
    admitted, servicer, _, link = burst(earlier_release=False, stop_first=True)
    assert admitted == [None] * BURST
    assert link.degraded["admit"] == BURST and servicer.calls == 0
    assert scraped(link, "lumen_gateway_admit_calls_total") == 0
    assert scraped(link, "lumen_gateway_degraded_total", {"call": "admit"}) == BURST

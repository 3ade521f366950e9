"""The gateway's Finish is off the request path (issue 16): finished requests go to the
coordinator in batches over real gRPC; a batch that cannot be sent is dropped and counted,
never raised into a request."""

from __future__ import annotations

import asyncio
from typing import Any

import grpc

from lumend.cluster.models import CoordinatorRecord
from lumend.cluster.view import ClusterView, Coordinator
from lumend.coordinator.service import CoordinatorService
from lumend.gateway.coordinator import CoordinatorLink
from lumend.rpc import lumen_pb2 as pb
from lumend.rpc import lumen_pb2_grpc as stubs
from lumend.rpc.server import CoordinatorServicer

from ..unit.test_gateway_checkpoints import worker
from .test_coordinator_service import view as decoded_view


class Counting(CoordinatorServicer):
    def __init__(self, service: CoordinatorService) -> None:
        super().__init__(lambda: service, lambda: "-", lambda s: None)
        self.finish_calls = 0

    async def Finish(self, request: pb.FinishRequest, context: Any) -> pb.FinishReply:
        self.finish_calls += 1
        return await super().Finish(request, context)


def with_coordinator(base: ClusterView, address: str) -> ClusterView:
    record = CoordinatorRecord(node="a", address="127.0.0.1", rpc=address, elected_at=0)
    return ClusterView(cluster="t", revision=1, nodes=base.nodes, workers=base.workers,
                       coordinator=Coordinator(record=record, epoch=3, lease=1))


def test_finish_is_batched_off_the_request_path() -> None:
    base = decoded_view(worker("a0", "a"), worker("b0", "b"), worker("c0", "c"))

    async def scenario() -> None:
        service = CoordinatorService("a", 3, lambda: base)
        servicer = Counting(service)
        server = grpc.aio.server()
        stubs.add_CoordinatorServicer_to_server(servicer, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        current = with_coordinator(base, f"127.0.0.1:{port}")
        link = CoordinatorLink("gw", lambda: current)
        try:
            admitted = await asyncio.gather(*(link.admit(f"r{i}", None, ()) for i in range(200)))
            assert all(a is not None and a.epoch == 3 for a in admitted)
            assert len(service.requests) == 200
            for i in range(200):
                link.finish(f"r{i}")  # returns at once: nothing is awaited on the request path
            assert servicer.finish_calls == 0
            for _ in range(100):  # the coordinator forgot them and the link read its reply
                if not service.requests and link.finishes["sent"] == 200:
                    break
                await asyncio.sleep(0.02)
            assert not service.requests
            assert servicer.finish_calls < 20, "one call per request, not batches"
            assert link.finishes["sent"] == 200 and link.finishes["known"] == 200
            # A single finish is sent the way a coordinator without batches reads it.
            assert (await link.admit("last", None, ())) is not None
            link.finish("last")
            await link.close()
            assert not service.requests
            # Negative control: with the coordinator gone the batch is dropped and counted.
            await server.stop(0)
            lost = CoordinatorLink("gw", lambda: current)
            lost.finish("gone")
            await lost.close()
            assert lost.finishes["dropped"] == 1
        finally:
            await server.stop(0)

    asyncio.run(scenario())


def test_after_an_etcd_restore_the_link_follows_the_new_coordinator_and_no_deposed_one() -> None:
    """A gateway that saw epoch 1519 before etcd was restored from a snapshot: the
    coordinator elected since has epoch 19. Its replies are taken once the view (read at
    revision 40, below 1519: a rewound etcd) names it; the same reply under a view read at a
    revision above 1519 (etcd not rewound: a deposed coordinator) is refused, and the
    admission decided locally."""
    base = decoded_view(worker("a0", "a"), worker("b0", "b"))

    async def scenario() -> None:
        service = CoordinatorService("a", 19, lambda: base)
        server = grpc.aio.server()
        stubs.add_CoordinatorServicer_to_server(CoordinatorServicer(
            lambda: service, lambda: "-", lambda s: None), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        record = CoordinatorRecord(node="a", address="127.0.0.1", rpc=f"127.0.0.1:{port}",
                                   elected_at=0)

        def read_at(revision: int) -> ClusterView:
            return ClusterView(cluster="t", revision=revision, nodes=base.nodes,
                               workers=base.workers,
                               coordinator=Coordinator(record=record, epoch=19, lease=1))

        restored = CoordinatorLink("gw", lambda: read_at(40))
        running = CoordinatorLink("gw", lambda: read_at(2000))
        restored.highest_epoch = running.highest_epoch = 1519
        try:
            admitted = await restored.admit("r1", None, ())
            assert admitted is not None and admitted.epoch == 19
            assert restored.highest_epoch == 19 and not restored.degraded
            # Negative control: etcd not rewound, so epoch 19 is a deposed coordinator's.
            assert await running.admit("r2", None, ()) is None
            assert running.degraded["admit"] == 1 and running.highest_epoch == 1519
        finally:
            await restored.close()
            await running.close()
            await server.stop(0)

    asyncio.run(scenario())

"""A coordinator answers only while it is sure of its lease (issue 14 item 4): real etcd,
real lumend processes, real gRPC.

* SIGSTOP the coordinator's lumend past its TTL with calls queued on its socket, SIGCONT
  after another node took over: none of the queued Admit/Recover calls is answered for
  the old epoch.
* Pause etcd under a coordinator: its keepalive is retried and fails; once the last renewal
  is older than TTL minus the margin, calls are refused (UNAVAILABLE, counted), although the
  coordinator has not stepped down.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import time
from collections.abc import Callable
from typing import Any

import grpc
import pytest

from lumenctl.demo import read_view
from lumenctl.localcluster import EtcdCluster, LocalCluster
from lumend.cluster.lease import LeaseKeeper
from lumend.cluster.models import CoordinatorRecord
from lumend.cluster.store import EtcdStore, StoreError
from lumend.cluster.view import ClusterView, Coordinator
from lumend.coordinator.service import CoordinatorService
from lumend.rpc import lumen_pb2_grpc as stubs
from lumend.rpc.client import CoordinatorClient, RpcFailure
from lumend.rpc.messages import Admission, RecoverAsk, Recovery
from lumend.rpc.server import CoordinatorServicer, lease_confidence

from ..rpc.test_coordinator_service import view as decoded_view
from ..unit.test_gateway_checkpoints import worker
from .conftest import wait_until
from .test_coordinator import all_serving

pytestmark = pytest.mark.etcd

MakeCluster = Callable[..., LocalCluster]


def test_a_coordinator_paused_past_its_ttl_answers_no_queued_call(
    local_cluster: MakeCluster,
) -> None:
    cluster = local_cluster(size=3, lease_ttl_s=3, shadows=0)
    view = wait_until(all_serving(cluster), 60, "3 serving workers and one coordinator")
    assert view.coordinator is not None
    leader, old_epoch = view.coordinator.record.node, view.coordinator.epoch
    paused = cluster.node(leader)

    def new_term() -> ClusterView | None:
        v = read_view(cluster.endpoints, cluster.cluster)
        return v if v.coordinator is not None and v.coordinator.epoch > old_epoch else None

    async def scenario() -> list[Any]:
        client = CoordinatorClient(view.coordinator.record.rpc)  # type: ignore[union-attr]
        try:
            # Control: the connection is up and the coordinator answers for its epoch.
            warm = await client.admit("warm", None, "test", timeout_s=5)
            assert warm.epoch == old_epoch and warm.target is not None
            paused.signal(signal.SIGSTOP)
            try:
                queued: list[asyncio.Task[Any]] = [
                    asyncio.create_task(client.admit(f"queued-{i}", None, "test",
                                                     timeout_s=60)) for i in range(6)]
                queued += [asyncio.create_task(client.recover(
                    RecoverAsk(f"lost-{i}", warm.target.worker, 64, "", warm.checkpoint,
                               "test"), timeout_s=60)) for i in range(3)]
                await asyncio.to_thread(wait_until, new_term, cluster.lease_ttl_s + 10,
                                        "another node to take over")
                await asyncio.sleep(1.0)  # the paused node's lease is well past its TTL
            finally:
                paused.signal(signal.SIGCONT)
            return await asyncio.gather(*queued, return_exceptions=True)
        finally:
            await client.close()

    results = asyncio.run(scenario())
    answered = [r for r in results if isinstance(r, Admission | Recovery)]
    assert answered == [], f"answered for the old epoch {old_epoch} after SIGCONT: {answered}"
    for r in results:
        assert isinstance(r, RpcFailure) and r.code == "UNAVAILABLE", r
    wait_until(lambda: "stepped down as coordinator" in paused.log_text(), 15,
               f"{leader} to step down")


async def _serve(servicer: CoordinatorServicer) -> tuple[Any, str]:
    server = grpc.aio.server()
    stubs.add_CoordinatorServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, f"127.0.0.1:{port}"


def test_calls_are_refused_once_the_lease_is_not_renewed(etcd: EtcdCluster) -> None:
    member = etcd.members[0]
    assert member.proc is not None

    async def scenario() -> None:
        store = EtcdStore(etcd.endpoints, request_timeout_s=0.5)
        keeper = LeaseKeeper(store, ttl_s=3)
        lease = await keeper.grant()
        base = decoded_view(worker("a0", "a"), worker("b0", "b"))
        record = CoordinatorRecord(node="a", address="127.0.0.1", rpc="-", elected_at=0)
        current = ClusterView(cluster="t", revision=2, nodes=base.nodes, workers=base.workers,
                              coordinator=Coordinator(record=record, epoch=5, lease=lease))
        service = CoordinatorService("a", 5, lambda: current)
        servicer = CoordinatorServicer(lambda: service, lambda: "nobody")
        server, address = await _serve(servicer)
        client = CoordinatorClient(address)

        async def keepalive() -> None:  # as the HA loop's keepalive task does
            while True:
                with contextlib.suppress(StoreError):
                    await keeper.renew()
                await asyncio.sleep(keeper.ttl_s / 3)

        renewing = asyncio.create_task(keepalive())
        try:
            # Control: answered while the lease is renewed.
            for i in range(3):
                assert (await client.admit(f"r{i}", None, "gw")).epoch == 5
                await asyncio.sleep(keeper.ttl_s / 3)
            assert keeper.confident()
            member.proc.send_signal(signal.SIGSTOP)  # type: ignore[union-attr]
            try:
                async def refused() -> RpcFailure | None:
                    try:
                        await client.admit("late", None, "gw", timeout_s=1)
                    except RpcFailure as exc:
                        return exc
                    return None

                failure = None
                for _ in range(100):
                    failure = await refused()
                    if failure is not None:
                        break
                    await asyncio.sleep(0.1)
                assert failure is not None, "still answering without a renewed lease"
                assert failure.code == "UNAVAILABLE" and "lease" in failure.details
                assert servicer.refused["lease"] >= 1
                assert service.decisions["refused_lease"] >= 1
                with pytest.raises(RpcFailure):
                    await client.recover(RecoverAsk("r0", "a0", 64, "", None, "gw"))
                # A view naming another term is refused whatever the lease.
                assert lease_confidence(CoordinatorService("a", 4, lambda: current)) is not None
            finally:
                member.proc.send_signal(signal.SIGCONT)  # type: ignore[union-attr]
        finally:
            renewing.cancel()
            await client.close()
            await server.stop(0)
            await keeper.revoke()
            await store.close()

    asyncio.run(scenario())



def hog(seconds: float) -> None:
    """Hold the event loop's thread, as a long synchronous step on the loop would."""
    time.sleep(seconds)


def test_the_lease_is_renewed_while_the_loop_is_busy_and_lapses_when_it_is_wedged(
    etcd: EtcdCluster,
) -> None:
    """The renewal thread (issue 16): a loop busy for longer than a renewal interval still
    gets its lease renewed; a loop that stops answering for good lets it lapse (so another
    node can take over a coordinator that cannot act)."""
    import pyetcd

    host, port = etcd.endpoints[0].removeprefix("http://").split(":")
    probe = pyetcd.client(host=host, port=int(port))

    async def scenario() -> None:
        store = EtcdStore(etcd.endpoints, request_timeout_s=0.5)
        keeper = LeaseKeeper(store, ttl_s=3)
        lease = await keeper.grant()

        async def keepalive() -> None:  # as the HA loop's keepalive task does
            while True:
                with contextlib.suppress(StoreError):
                    await keeper.renew()
                await asyncio.sleep(keeper.ttl_s / 3)

        renewing = asyncio.create_task(keepalive())
        try:
            await asyncio.sleep(0.1)
            busy_s = 2 * keeper.ttl_s / 3
            hog(busy_s)  # busy: the loop runs nothing meanwhile
            assert keeper.seconds_since_renewal() < busy_s, "no renewal while the loop was busy"
            assert int(probe.get_lease_info(lease).TTL) > 0
            await asyncio.sleep(0.1)  # answers again
            # Wedged: no answer for three TTLs; the lease must be gone from etcd by then.
            hog(3 * keeper.ttl_s)
            assert int(probe.get_lease_info(lease).TTL) <= 0, "a wedged loop kept its lease"
        finally:
            renewing.cancel()
            await keeper.revoke()
            await store.close()

    asyncio.run(scenario())

"""The holders' Progress stream moves to the new term when its coordinator is paused (issue 14
item 8): a real coordinator gRPC server in a child process, SIGSTOPped while a holder
streams growing checkpoints to it (megabytes a tick: soon more than the flow-control window
and the socket buffers hold), then the view names another coordinator, which must receive
them."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import textwrap
import time

import grpc

from lumend.cluster.models import CoordinatorRecord
from lumend.cluster.view import ClusterView, Coordinator
from lumend.coordinator.service import CoordinatorService
from lumend.rpc import lumen_pb2_grpc as stubs
from lumend.rpc.progress import ProgressReporter
from lumend.rpc.server import CoordinatorServicer

from ..unit.test_gateway_checkpoints import worker
from .test_coordinator_service import view as decoded_view

SERVER = textwrap.dedent("""
    import asyncio, grpc
    from lumend.coordinator.service import CoordinatorService
    from lumend.rpc import lumen_pb2_grpc as stubs
    from lumend.rpc.server import CoordinatorServicer

    async def main():
        service = CoordinatorService("a", 1, lambda: None)
        server = grpc.aio.server()
        stubs.add_CoordinatorServicer_to_server(
            CoordinatorServicer(lambda: service, lambda: "-", lambda s: None), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        print(port, flush=True)
        await server.wait_for_termination()

    asyncio.run(main())
""")


def coordinator_at(address: str, epoch: int) -> ClusterView:
    base = decoded_view(worker("a0", "a"), worker("b0", "b"))
    record = CoordinatorRecord(node="x", address="127.0.0.1", rpc=address, elected_at=0)
    return ClusterView(cluster="t", revision=epoch, nodes=base.nodes, workers=base.workers,
                       coordinator=Coordinator(record=record, epoch=epoch, lease=1))


def test_progress_moves_to_the_new_term_when_the_coordinator_is_paused() -> None:
    child = subprocess.Popen([sys.executable, "-c", SERVER], stdout=subprocess.PIPE)
    try:
        assert child.stdout is not None
        paused_at = f"127.0.0.1:{int(child.stdout.readline())}"
        # Long ids make each report about a kilobyte; every tick every checkpoint grows.
        names = [f"ckpt-{i:05d}-" + "x" * 1000 for i in range(2000)]
        ticks = [0]

        def holdings() -> dict[str, tuple[str, int, int]]:
            ticks[0] += 1
            return {name: ("a0", 4096 * ticks[0], 16) for name in names}

        async def scenario() -> None:
            current = [coordinator_at(paused_at, 1)]
            reporter = ProgressReporter(holdings, lambda: current[0], every_s=0.2)
            stop = asyncio.Event()
            running = asyncio.create_task(reporter.run(stop))
            successor = CoordinatorService("b", 2, lambda: None)
            server = grpc.aio.server()
            stubs.add_CoordinatorServicer_to_server(
                CoordinatorServicer(lambda: successor, lambda: "-", lambda s: None), server)
            port = server.add_insecure_port("127.0.0.1:0")
            await server.start()
            try:
                while reporter.reports == 0:  # control: the first coordinator gets reports
                    await asyncio.sleep(0.05)
                child.send_signal(signal.SIGSTOP)
                await asyncio.sleep(3.0)  # the buffers fill; writes can no longer complete
                current[0] = coordinator_at(f"127.0.0.1:{port}", 2)
                deadline = time.monotonic() + 30
                while len(successor.held) < len(names):
                    assert time.monotonic() < deadline, (
                        f"the new coordinator got {len(successor.held)} of {len(names)} "
                        "checkpoints: the stream is stuck on the paused one")
                    await asyncio.sleep(0.1)
            finally:
                stop.set()
                await asyncio.wait_for(running, 10)
                await server.stop(0)

        asyncio.run(scenario())
    finally:
        child.send_signal(signal.SIGCONT)
        child.kill()
        child.wait(5)

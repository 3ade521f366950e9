"""Streams this node's checkpoint growth to the coordinator (Coordinator.Progress).

One long-lived client-streamed call per coordinator term. Each tick sends the checkpoints
whose bytes changed since the last tick (bytes 0 for one that is gone); a new call (a new
coordinator, or after an error) starts with everything held, which is how a newly elected
coordinator learns the checkpoints placed by its predecessor.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Mapping

from lumend.cluster.view import ClusterView
from lumend.rpc.client import CoordinatorClient, ProgressStream, RpcFailure
from lumend.rpc.messages import CheckpointProgress
from lumend.rpc.tls import RpcTls

log = logging.getLogger("lumend.rpc")

# ckpt id -> (holder worker, bytes, tokens)
Holdings = Mapping[str, tuple[str, int, int]]


class ProgressReporter:
    def __init__(self, holdings: Callable[[], Holdings],
                 view: Callable[[], ClusterView | None], tls: RpcTls | None = None,
                 every_s: float = 0.5) -> None:
        self._holdings = holdings
        self._view = view
        self._tls = tls
        self._every_s = every_s
        self._term: tuple[str, int] | None = None  # (rpc address, epoch) of the open call
        self._client: CoordinatorClient | None = None
        self._stream: ProgressStream | None = None
        self._sent: dict[str, int] = {}  # ckpt id -> bytes last sent on the open call
        self.reports = 0
        self.errors = 0

    async def run(self, stop: asyncio.Event) -> None:
        try:
            while not stop.is_set():
                await self.tick()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), self._every_s)
        finally:
            await self._close()

    async def tick(self) -> None:
        view = self._view()
        coordinator = None if view is None else view.coordinator
        if coordinator is None:
            await self._close()
            return
        term = (coordinator.record.rpc, coordinator.epoch)
        if term != self._term:
            await self._close()
            self._client = CoordinatorClient(term[0], self._tls)
            self._stream = self._client.progress()
            self._term = term
        assert self._stream is not None
        now = {ckpt: held for ckpt, held in self._holdings().items()}
        sent = self.reports
        try:
            for ckpt, (holder, nbytes, tokens) in now.items():
                if self._sent.get(ckpt) != nbytes:
                    await self._stream.send(CheckpointProgress(ckpt, holder, nbytes, tokens))
                    self._sent[ckpt] = nbytes
                    self.reports += 1
            for ckpt in [c for c in self._sent if c not in now]:
                await self._stream.send(CheckpointProgress(ckpt, "-", 0, 0))
                del self._sent[ckpt]
                self.reports += 1
            if self.reports == sent:
                # Nothing to report: a keepalive, so that an idle stream whose call has
                # ended (its coordinator restarted or went away) finds out and reopens.
                await self._stream.keepalive()
        except RpcFailure as exc:
            self.errors += 1
            log.debug("progress to the coordinator: %s", exc)
            await self._close(keep_term=False)

    async def _close(self, keep_term: bool = False) -> None:
        stream, client = self._stream, self._client
        self._stream = self._client = None
        self._sent = {}
        if not keep_term:
            self._term = None
        if stream is not None:
            stream.cancel()
        if client is not None:
            await client.close()

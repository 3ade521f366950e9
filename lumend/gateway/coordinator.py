"""The gateway's line to the coordinator: Admit, Recover and Finish with short deadlines.

The coordinator is whoever the `coordinator` key names in this node's latest view. When it
cannot answer (no coordinator, unreachable, too slow) the gateway decides locally with the
same policy functions over its own view; each such decision is counted as degraded and the
change of mode is logged. A recovery is worth waiting for a little: when the coordinator
dies the key names its successor within a lease TTL, and Recover is retried against it.

Admissions are batched under load (issue 16): up to `admit_calls` Admit calls are in flight
at once; admissions asked meanwhile wait for the first of them to return and go together
in the next call (at most `admit_batch`), decided in order by the coordinator. One caller
alone never waits (its call is sent at once, as before); many callers share the per-call
cost of gRPC, which is what bounds a coordinator's admissions per second. A coordinator of
an earlier release answers the first of a batch only; the link then asks one per call.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from lumend.cluster.view import ClusterView
from lumend.gateway.latency import DECISION_BUCKETS, Buckets
from lumend.rpc.client import CoordinatorClient, RpcFailure
from lumend.rpc.messages import Admission, RecoverAsk, Recovery
from lumend.rpc.tls import RpcTls

log = logging.getLogger("lumend.gateway")

Term = tuple[str, int]  # (rpc address, epoch) of a coordinator


@dataclass(frozen=True)
class LinkTiming:
    admit_deadline_s: float = 0.5
    recover_deadline_s: float = 1.0
    # How long an interrupted request waits for a coordinator (the same or a newly elected
    # one) to answer Recover before the gateway routes it locally; about one lease TTL.
    coordinator_wait_s: float = 12.0
    # After a failed call, admissions go local without trying that coordinator for this long.
    down_for_s: float = 1.0
    retry_pause_s: float = 0.1
    # Finished requests are sent in batches, off the request path: at most this long after
    # the first of a batch, or at once when the batch holds `finish_batch` of them.
    finish_delay_s: float = 0.02
    finish_batch: int = 512
    # Admit calls in flight at once before admissions wait and go as one batch; the most
    # admissions in one call (the coordinator decides them in one go on its event loop).
    admit_calls: int = 4
    admit_batch: int = 128


@dataclass
class _Ask:
    """An admission waiting for its call: what to ask, and where its answer goes."""

    request_id: str
    model: str | None
    exclude: Sequence[str]
    asked: float
    answer: asyncio.Future[Admission] = field(repr=False)


class CoordinatorLink:
    def __init__(self, node: str, view: Callable[[], ClusterView | None],
                 tls: RpcTls | None = None, timing: LinkTiming | None = None) -> None:
        self.node = node
        self._view = view
        self._tls = tls
        self.timing = timing or LinkTiming()
        self.degraded: Counter[str] = Counter()  # local decisions, by call: admit, recover
        # Round trips of the coordinator's answers, by call.
        self.decision_seconds = {call: Buckets(DECISION_BUCKETS) for call in ("admit", "recover")}
        self.answered: Counter[str] = Counter()  # decisions the coordinator made
        self.coordinator_changes = 0  # recoveries answered by a coordinator elected meanwhile
        self.highest_epoch = 0
        self._clients: dict[str, CoordinatorClient] = {}
        self._down_until: dict[Term, float] = {}
        self._degraded_why: str | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._finished: list[str] = []  # request ids not sent yet
        self._asks: dict[Term, list[_Ask]] = {}  # admissions waiting for a call, per term
        self._admitting: Counter[Term] = Counter()  # Admit calls in flight, per term
        self._single: set[Term] = set()  # coordinators that answer one admission per call
        # Admit calls sent, and admissions in them (their ratio: the mean batch).
        self.admit_calls: Counter[str] = Counter()
        self._flush: asyncio.TimerHandle | None = None
        # Finish batches: sent, requests in them, requests the coordinator knew, and
        # requests dropped with a failed batch (the coordinator expires those itself).
        self.finishes: Counter[str] = Counter()

    def _term(self) -> Term | None:
        view = self._view()
        if view is None or view.coordinator is None:
            return None
        return view.coordinator.record.rpc, view.coordinator.epoch

    def _client(self, address: str) -> CoordinatorClient:
        client = self._clients.get(address)
        if client is None:
            client = self._clients[address] = CoordinatorClient(address, self._tls)
        return client

    def _check_epoch(self, term: Term, epoch: int) -> None:
        if epoch < self.highest_epoch and not self._rewound(term, epoch):
            raise RpcFailure(term[0], "reply", "FAILED_PRECONDITION",
                             f"reply from deposed coordinator epoch {epoch} (epoch "
                             f"{self.highest_epoch} seen)")
        self.highest_epoch = epoch

    def _rewound(self, term: Term, epoch: int) -> bool:
        """Whether a reply below the highest epoch seen comes from the coordinator etcd
        elected after a restore from a snapshot: the view (a linearizable read) names it, at
        a revision below that highest epoch, which a running etcd cannot answer (see
        lumend/cluster/fencing.py). Then its epoch is the bar from now on."""
        view = self._view()
        if view is None or view.revision >= self.highest_epoch or term[1] != epoch:
            return False
        log.warning("coordinator epoch %d answers below epoch %d seen before: etcd was "
                    "restored from a snapshot (its revision is %d); following the new one",
                    epoch, self.highest_epoch, view.revision)
        return True

    def _answered(self, call: str, term: Term) -> None:
        self.answered[call] += 1
        if self._degraded_why is not None:
            log.info("coordinator at %s (epoch %d) answers again; back to coordinated "
                     "decisions (%d degraded so far)", term[0], term[1],
                     sum(self.degraded.values()))
            self._degraded_why = None

    def _degrade(self, call: str, why: str) -> None:
        self.degraded[call] += 1
        if self._degraded_why is None:
            log.warning("coordinator unavailable (%s): %s decided locally from this node's "
                        "view; degraded until it answers", why, call)
        self._degraded_why = why

    def _failed(self, term: Term, exc: RpcFailure) -> None:
        self._down_until[term] = time.monotonic() + self.timing.down_for_s

    # -- calls ----------------------------------------------------------------------------

    async def admit(self, request_id: str, model: str | None,
                    exclude: Sequence[str]) -> Admission | None:
        """The coordinator's admission, or None: decide locally (counted as degraded)."""
        term = self._term()
        if term is None:
            self._degrade("admit", "no coordinator elected")
            return None
        if self._down_until.get(term, 0.0) > time.monotonic():
            self._degrade("admit", f"coordinator at {term[0]} did not answer recently")
            return None
        ask = _Ask(request_id, model, exclude, time.monotonic(),
                   asyncio.get_running_loop().create_future())
        self._asks.setdefault(term, []).append(ask)
        self._send_asks(term)
        try:
            admission = await ask.answer
        except RpcFailure as exc:
            self._degrade("admit", str(exc))
            return None
        self.decision_seconds["admit"].observe(time.monotonic() - ask.asked)
        self._answered("admit", term)
        return admission

    def _send_asks(self, term: Term) -> None:
        """Start calls for the admissions waiting on `term`, as many as may be in flight."""
        waiting = self._asks.get(term)
        # An earlier release: one admission per call, up to `admit_batch` calls at once.
        single = term in self._single
        limit = self.timing.admit_batch if single else self.timing.admit_calls
        while waiting and self._admitting[term] < limit:
            size = 1 if single else self.timing.admit_batch
            batch, waiting[:] = waiting[:size], waiting[size:]
            self._admitting[term] += 1
            task = asyncio.create_task(self._admit_call(term, batch))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        if not waiting:
            self._asks.pop(term, None)

    async def _admit_call(self, term: Term, batch: list[_Ask]) -> None:
        client = self._client(term[0])
        deadline = self.timing.admit_deadline_s
        failure: RpcFailure | None = None
        answers: list[Admission] = []
        try:
            if len(batch) == 1:
                a = batch[0]
                got = [await client.admit(a.request_id, a.model, self.node, a.exclude,
                                          deadline)]
            else:
                got = await client.admit_many(
                    [(a.request_id, a.model, a.exclude) for a in batch], self.node, deadline)
            self._check_epoch(term, got[0].epoch)
            answers = got
        except RpcFailure as exc:
            failure = exc
        except Exception as exc:  # never leave an admission waiting (then decided locally)
            failure = RpcFailure(term[0], "Admit", "UNKNOWN", repr(exc))
        finally:
            self._admitting[term] -= 1
            if not self._admitting[term]:
                del self._admitting[term]
            if not answers:  # failed, or cancelled (the link closes)
                failure = failure or RpcFailure(term[0], "Admit", "CANCELLED",
                                                "the gateway's call was cancelled")
                # The coordinator is down for `down_for_s`: the admissions waiting behind
                # this call fail with it (their callers decide locally), not queue for it.
                self._failed(term, failure)
                for a in (*batch, *self._asks.pop(term, ())):
                    if not a.answer.done():
                        a.answer.set_exception(failure)
        if not answers:
            return
        self.admit_calls["calls"] += 1
        self.admit_calls["admissions"] += len(answers)
        for a, admission in zip(batch, answers, strict=False):
            if not a.answer.done():  # its caller may have given up meanwhile
                a.answer.set_result(admission)
        if len(answers) < len(batch):  # an earlier release: the rest one per call
            log.info("coordinator at %s (epoch %d) answers one admission per call",
                     term[0], term[1])
            self._single.add(term)
            self._asks.setdefault(term, [])[:0] = batch[len(answers):]
        self._send_asks(term)

    async def recover(self, ask: RecoverAsk) -> Recovery | None:
        """The coordinator's routing for an interrupted request, retried against whichever
        coordinator the view names for up to `coordinator_wait_s`; None: route locally."""
        deadline = time.monotonic() + self.timing.coordinator_wait_s
        first: Term | None = None
        last = "no coordinator elected"
        while True:
            term = self._term()
            if term is not None:
                first = first or term
                try:
                    asked = time.monotonic()
                    recovery = await self._client(term[0]).recover(
                        ask, self.timing.recover_deadline_s)
                    self.decision_seconds["recover"].observe(time.monotonic() - asked)
                    self._check_epoch(term, recovery.epoch)
                except RpcFailure as exc:
                    self._failed(term, exc)
                    last = str(exc)
                else:
                    if term != first:
                        self.coordinator_changes += 1
                        log.info("Recover of %s answered by the new coordinator at %s (epoch "
                                 "%d) after %s (epoch %d) failed", ask.request_id, term[0],
                                 term[1], first[0], first[1])
                    self._answered("recover", term)
                    return recovery
            if time.monotonic() >= deadline:
                self._degrade("recover", last)
                return None
            await asyncio.sleep(self.timing.retry_pause_s)

    def finish(self, request_id: str) -> None:
        """Tell the coordinator a request ended: queued, sent with others in one batch
        within `finish_delay_s` (never on the request's path; a lost batch costs the
        coordinator nothing but a few stale counts until they expire)."""
        self._finished.append(request_id)
        if len(self._finished) >= self.timing.finish_batch:
            self._send_finished()
        elif self._flush is None:
            loop = asyncio.get_running_loop()
            self._flush = loop.call_later(self.timing.finish_delay_s, self._send_finished)

    def _send_finished(self) -> None:
        if self._flush is not None:
            self._flush.cancel()
            self._flush = None
        batch, self._finished = self._finished, []
        term = self._term()
        if not batch:
            return
        if term is None or self._down_until.get(term, 0.0) > time.monotonic():
            self.finishes["dropped"] += len(batch)
            return

        async def send() -> None:
            client = self._client(term[0])
            try:
                if len(batch) == 1:  # also understood by a coordinator without batches
                    _, known = await client.finish(batch[0], self.timing.admit_deadline_s)
                    count = int(known)
                else:
                    _, count = await client.finish_many(batch, self.timing.admit_deadline_s)
            except RpcFailure:
                self.finishes["dropped"] += len(batch)
                return
            self.finishes["batches"] += 1
            self.finishes["sent"] += len(batch)
            self.finishes["known"] += count

        task = asyncio.create_task(send())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def close(self) -> None:
        self._send_finished()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        for client in self._clients.values():
            await client.close()
        self._clients.clear()

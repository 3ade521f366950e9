"""The cluster store: LUMEN's small interface over etcd v3.

Everything above this module speaks `Store`; only `EtcdStore` knows the client library
(etcd-sdk-python, imported as `pyetcd`). Endpoint rotation, retries and timeouts are ours:
pyetcd's own failover marks an endpoint failed for five minutes, which is far too long for
a daemon that must renew a lease every few seconds.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar
from urllib.parse import urlsplit

import grpc

from lumend.cluster.channels import CHANNEL_OPTIONS, ChannelPool, Lease

log = logging.getLogger(__name__)

T = TypeVar("T")

# gRPC codes after which another endpoint (or the same one, a moment later) may succeed.
_TRANSIENT_CODES = frozenset(
    {
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.DEADLINE_EXCEEDED,
        grpc.StatusCode.INTERNAL,
        grpc.StatusCode.UNKNOWN,
        grpc.StatusCode.CANCELLED,
    }
)


@dataclass(frozen=True)
class KeyValue:
    key: str
    value: bytes
    create_revision: int
    mod_revision: int
    lease: int


@dataclass(frozen=True)
class StoreStatus:
    """One etcd member's health, as its Maintenance API reports it."""

    endpoint: str
    db_size_bytes: int
    revision: int
    alarms: tuple[str, ...]  # e.g. ("NOSPACE",), cluster-wide


@dataclass(frozen=True)
class Snapshot:
    """All keys under a prefix, read at one revision. `store`: etcd's own health (database
    size, alarms) read alongside, where the read asked for it (`get_prefix`): a NOSPACE
    alarm cannot be written to any key, so readers learn of it this way."""

    kvs: list[KeyValue]
    revision: int
    store: StoreStatus | None = None


@dataclass(frozen=True)
class CreateRevisionIs:
    """Compare: the key's create revision equals `revision` (0 means the key is absent)."""

    key: str
    revision: int


@dataclass(frozen=True)
class ModRevisionIs:
    """Compare: the key's last modification is at `revision` (0 means the key is absent):
    a read-modify-write conditional on nothing having written the key since the read."""

    key: str
    revision: int


Compare = CreateRevisionIs | ModRevisionIs


@dataclass(frozen=True)
class Put:
    key: str
    value: bytes
    lease: int | None = None


@dataclass(frozen=True)
class Delete:
    key: str


@dataclass(frozen=True)
class DeleteRange:
    """Delete every key in [start, end): one operation however many keys it removes."""

    start: str
    end: str


Op = Put | Delete | DeleteRange

# etcd refuses a transaction with more than --max-txn-ops operations (128 by default) in
# either branch. Everything LUMEN writes in one transaction stays at or under this.
MAX_TXN_OPS = 100

# The alarm etcd raises when its backend reaches --quota-backend-bytes: it then refuses
# every write but deletes and compaction until an operator clears it (docs/operator-guide.md).
NOSPACE = "NOSPACE"
# The command that clears a NOSPACE alarm (docs/operator-guide.md, "etcd hygiene").
NOSPACE_FIX = (
    "compact and defragment etcd, then disarm the alarm: `rev=$(etcdctl endpoint status "
    "-w json | grep -o '\"revision\":[0-9]*' | head -1 | cut -d: -f2) && etcdctl compact "
    "$rev && etcdctl defrag --cluster && etcdctl alarm disarm` (with ETCDCTL_ENDPOINTS and "
    "the TLS flags of your cluster; if the live data alone fills the quota, raise "
    "--quota-backend-bytes first; docs/operator-guide.md, etcd hygiene)"
)


@dataclass(frozen=True)
class TxnResult:
    succeeded: bool
    revision: int
    # Values read by the failure branch's `read_on_failure` keys (absent keys are omitted).
    read: dict[str, KeyValue] = field(default_factory=dict)


class WatchHandle:
    """A live watch; `alive` turns False when its stream breaks (the owner re-arms it)."""

    def __init__(self) -> None:
        self.alive = True
        self._cancel: Callable[[], None] | None = None

    def cancel(self) -> None:
        self.alive = False
        if self._cancel is not None:
            try:
                self._cancel()
            except Exception:  # the stream may already be gone; nothing is left to cancel
                log.debug("cancelling a watch failed", exc_info=True)


class StoreError(Exception):
    """The store answered, but not as asked (a bug or a misconfigured server)."""


class StoreConfigError(StoreError):
    """The client's own settings cannot work (an https endpoint without TLS files)."""


class CommitUnknown(StoreError):
    """A transaction was sent but its answer was lost: it may or may not have been applied.

    Raised only for transactions marked `idempotent=False`; the caller must read back what
    the transaction would have written instead of sending it again."""

    def __init__(self, what: str, endpoint: str, last: str) -> None:
        self.endpoint = endpoint
        self.last = last
        super().__init__(
            f"etcd {what} on {endpoint}: the answer was lost ({last}); it may have been "
            "applied, so it is read back rather than sent again"
        )


class StoreUnavailable(StoreError):
    """No etcd endpoint answered within the retry budget."""

    def __init__(self, endpoints: Sequence[str], attempts: int, elapsed_s: float, last: str):
        self.endpoints = list(endpoints)
        self.attempts = attempts
        self.elapsed_s = elapsed_s
        self.last = last
        super().__init__(
            f"etcd unreachable at {', '.join(self.endpoints)} "
            f"({attempts} attempts over {elapsed_s:.1f} s; last error: {last}); "
            + _unavailable_hint(last, self.endpoints)
        )


# What gRPC reports when a TLS handshake fails on either side: a server refusing the client
# certificate ends the handshake with an alert the client sees only as corrupted data.
_TLS_MARKERS = ("TSI_", "handshake", "SSL", "CERTIFICATE")


def _unavailable_hint(last: str, endpoints: Sequence[str]) -> str:
    if any(marker in last for marker in _TLS_MARKERS):
        return (
            "etcd refused the TLS handshake: the client certificate ([etcd] cert and key, "
            "lumenctl --cert/--key) must be signed by the CA that etcd trusts "
            "(--trusted-ca-file), and ca_cert (lumenctl --ca-cert) must be the CA that "
            "signed etcd's server certificate"
        )
    if "Socket closed" in last and any(e.startswith("http://") for e in endpoints):
        return (
            "etcd closed the connection at once, as an etcd that serves TLS does to a "
            "plaintext client: if it does, use https:// endpoints with ca_cert, cert and key "
            "(lumenctl --ca-cert/--cert/--key); else check `systemctl status etcd`"
        )
    hint = (
        "check that etcd runs there (`systemctl status etcd`) and that the endpoints "
        "are right (--endpoints / LUMEN_ENDPOINTS / [etcd] endpoints)"
    )
    if any(marker in last for marker in _TIMEOUT_MARKERS):
        # A down or black-holed etcd times out too; so does a round trip past the timeout.
        hint += (
            "; the calls timed out: if `etcdctl endpoint status` from this host answers "
            "(slowly), the round trip to etcd is too long for [etcd] request_timeout_s: "
            "raise it (below lease_ttl_s / 2)"
        )
    return hint


_TIMEOUT_MARKERS = ("Deadline Exceeded", "DEADLINE_EXCEEDED", "timed out", "timeout")


class Store(Protocol):
    """What LUMEN needs from a consistent key-value store with leases."""

    @property
    def endpoints(self) -> list[str]: ...

    async def get(self, key: str) -> KeyValue | None: ...

    async def get_prefix(self, prefix: str) -> Snapshot:
        """All keys under `prefix` at one revision, with etcd's status and alarms."""
        ...

    async def read_prefixes(self, prefixes: Sequence[str]) -> Snapshot:
        """All keys under any of `prefixes`, read atomically at one revision."""
        ...

    async def put(self, key: str, value: bytes, lease: int | None = None) -> int: ...

    async def delete(self, key: str) -> bool: ...

    async def txn(
        self,
        compares: Sequence[Compare],
        success: Sequence[Op],
        read_on_failure: Sequence[str] = (),
        *,
        idempotent: bool = True,
    ) -> TxnResult:
        """Apply `success` if every compare holds. An `idempotent` transaction is retried
        on a lost answer like any call; one that is not raises `CommitUnknown` instead (a
        claim that may have committed must be read back, not sent again)."""
        ...

    async def keys(self, prefix: str, *, limit: int = 0, newest_first: bool = False
                   ) -> list[str]:
        """The keys (no values) under `prefix` in key order, or reversed; `limit` 0: all."""
        ...

    async def status(self) -> StoreStatus:
        """The answering member's database size and revision, and the cluster's alarms."""
        ...

    async def compact(self, revision: int) -> None:
        """Drop the history of every key before `revision` (etcd compaction)."""
        ...

    async def grant_lease(self, ttl_s: int) -> int: ...

    async def watch_key(self, key: str, on_change: Callable[[], None]) -> WatchHandle:
        """Call `on_change` (from another thread) whenever `key` changes, and once more if
        the watch breaks; the handle then reads `alive == False`."""
        ...

    async def keepalive(self, lease: int) -> int:
        """Renew `lease` once; returns the remaining TTL in seconds, 0 when it has expired."""
        ...

    async def revoke_lease(self, lease: int) -> None: ...

    async def close(self) -> None: ...


@dataclass(frozen=True)
class EndpointSpec:
    url: str
    host: str
    port: int
    secure: bool


def parse_endpoint(url: str) -> EndpointSpec:
    """`http://host:port` -> EndpointSpec; a bare `host:port` is taken as http."""
    text = url.strip()
    if "://" not in text:
        text = "http://" + text
    parts = urlsplit(text)
    if parts.scheme not in ("http", "https") or not parts.hostname or parts.port is None:
        raise ValueError(
            f"etcd endpoint {url!r} is not of the form http://HOST:PORT or https://HOST:PORT"
        )
    return EndpointSpec(text, parts.hostname, parts.port, parts.scheme == "https")


@dataclass(frozen=True)
class TlsFiles:
    ca_cert: str | None = None
    cert: str | None = None
    key: str | None = None


class EtcdStore:
    """`Store` over etcd v3 (gRPC), with our own endpoint rotation and bounded retries.

    Each call tries the current endpoint; on a connection error or timeout it moves to the
    next endpoint and retries until `retry_budget_s` is spent, then raises
    `StoreUnavailable` naming every endpoint it tried. Calls run in worker threads so the
    asyncio loop never blocks on the network.
    """

    def __init__(
        self,
        endpoints: Sequence[str],
        *,
        request_timeout_s: float = 2.0,
        retry_budget_s: float | None = None,
        tls: TlsFiles | None = None,
    ) -> None:
        if not endpoints:
            raise ValueError("at least one etcd endpoint is required")
        self._specs = [parse_endpoint(e) for e in endpoints]
        self._timeout = request_timeout_s
        self._budget = (
            retry_budget_s
            if retry_budget_s is not None
            else request_timeout_s * max(2, len(self._specs))
        )
        self._tls = tls or TlsFiles()
        self._channels = ChannelPool(self._new_client)
        self._current = 0
        # A call whose thread has not returned this long after its deadline is abandoned
        # (a wedged grpc call must not wedge the HA loop or the lease renewal with it).
        self._abandon_after_s = 4 * request_timeout_s + 1.0

    @property
    def endpoints(self) -> list[str]:
        return [s.url for s in self._specs]

    # -- plumbing -------------------------------------------------------------------------

    def _new_client(self, index: int) -> Any:
        import pyetcd  # deferred: keeps `import lumend` light

        spec = self._specs[index]
        creds = None
        if spec.secure:
            creds = self._secure_creds(spec.url)
        # time_retry=0: never let the library park an endpoint; rotation is ours.
        endpoint = pyetcd.Endpoint(spec.host, spec.port, secure=spec.secure, creds=creds,
                                   time_retry=0.0, opts=list(CHANNEL_OPTIONS))
        return pyetcd.MultiEndpointEtcd3Client(endpoints=[endpoint], timeout=self._timeout)

    def _secure_creds(self, url: str) -> Any:
        import pyetcd

        tls = self._tls
        if not tls.ca_cert:
            raise StoreConfigError(
                f"{url} is an https endpoint but no CA certificate is given: set [etcd] "
                "ca_cert, cert and key (lumenctl --ca-cert, --cert, --key), or use http://"
            )
        try:
            # pyetcd's argument order: CA, client key, client certificate.
            return pyetcd.MultiEndpointEtcd3Client.get_secure_creds(tls.ca_cert, tls.key,
                                                                    tls.cert)
        except OSError as exc:
            raise StoreConfigError(
                f"cannot read the etcd TLS file {exc.filename}: {exc.strerror}; fix [etcd] "
                "ca_cert, cert and key (lumenctl --ca-cert, --cert, --key)"
            ) from exc

    async def _call(self, what: str, fn: Callable[[Any], T], *, idempotent: bool = True) -> T:
        """Run `fn(client)` with endpoint rotation. A call that is not `idempotent` is not
        sent again once it may have reached etcd: a lost answer raises `CommitUnknown`."""
        import pyetcd.exceptions as etcd_errors

        transient = (
            etcd_errors.ConnectionFailedError,
            etcd_errors.ConnectionTimeoutError,
            etcd_errors.InternalServerError,
            # A watch etcd did not confirm in time (a member without quorum, a black hole);
            # it used to escape the HA loop and stop lumend.
            etcd_errors.WatchTimedOut,
            etcd_errors.NoServerAvailableError,
            ValueError,  # pyetcd: "Trying to use a failed node"
        )
        started = time.monotonic()
        attempts = 0
        last = ""
        while True:
            index = self._current
            attempts += 1
            try:
                with self._channels.lend(index) as lease:
                    try:
                        result = await self._in_thread(fn, lease)
                        self._channels.succeeded(lease)
                        return result
                    except grpc.RpcError as exc:
                        if exc.code() not in _TRANSIENT_CODES:
                            raise StoreError(f"etcd {what}: {_describe(exc)}") from exc
                        last = f"{self._specs[index].url}: {_describe(exc)}"
                        if not idempotent and not _surely_unsent(exc):
                            self._rotate(lease)
                            raise CommitUnknown(what, self._specs[index].url, last) from exc
                    except (*transient, _Abandoned) as exc:
                        last = f"{self._specs[index].url}: {_describe(exc)}"
                        log.debug("etcd %s failed on %s (attempt %d)", what, last, attempts)
                        if not idempotent and not _surely_unsent(exc):
                            self._rotate(lease)
                            raise CommitUnknown(what, self._specs[index].url, last) from exc
                    self._rotate(lease)
            except transient as exc:  # the channel could not even be made: nothing was sent
                last = f"{self._specs[index].url}: {_describe(exc)}"
                self._current = (index + 1) % len(self._specs)
            elapsed = time.monotonic() - started
            if elapsed >= self._budget:
                raise StoreUnavailable(self.endpoints, attempts, elapsed, last)
            if attempts % len(self._specs) == 0:
                # Every endpoint failed once this round: pause before the next round.
                await asyncio.sleep(min(0.2 * attempts, 1.0, self._budget - elapsed))

    async def _in_thread(self, fn: Callable[[Any], T], lease: Lease) -> T:
        """`fn(client)` in a worker thread. A thread that has not returned long after its
        deadline is abandoned with its channel (`_Abandoned`, a transient failure)."""
        call = asyncio.ensure_future(asyncio.to_thread(fn, lease.client))
        try:
            done, _ = await asyncio.wait({call}, timeout=self._abandon_after_s)
        except asyncio.CancelledError:
            self._channels.keep_while(lease, call)  # the thread goes on with the channel
            call.add_done_callback(_quiet)
            raise
        if call in done:
            return call.result()
        call.add_done_callback(_quiet)
        self._channels.abandon(lease)
        log.error("an etcd call on %s did not return %.0f s after its deadline; its channel "
                  "is abandoned", self._specs[lease.index].url, self._abandon_after_s)
        raise _Abandoned(f"no answer within {self._abandon_after_s:.0f} s (call abandoned)")

    def _rotate(self, lease: Lease) -> None:
        """Count the failure against the channel (retired on the second in a row: a fresh
        one, a fresh connection, replaces it) and move on to the next endpoint."""
        self._channels.failed(lease)
        self._current = (lease.index + 1) % len(self._specs)

    # -- Store ----------------------------------------------------------------------------

    async def get(self, key: str) -> KeyValue | None:
        def op(c: Any) -> KeyValue | None:
            value, meta = c.get(key)
            return None if value is None else _kv(value, meta)

        return await self._call(f"get {key}", op)

    async def get_prefix(self, prefix: str) -> Snapshot:
        def op(c: Any) -> Snapshot:
            response = c.get_prefix_response(prefix)
            kvs = [
                KeyValue(
                    kv.key.decode(), bytes(kv.value), kv.create_revision, kv.mod_revision, kv.lease
                )
                for kv in response.kvs
            ]
            return Snapshot(kvs, response.header.revision, self._status_if_allowed(c))

        return await self._call(f"get prefix {prefix}", op)

    async def read_prefixes(self, prefixes: Sequence[str]) -> Snapshot:
        def op(c: Any) -> Snapshot:
            from pyetcd.utils import prefix_range_end

            gets = [c.transactions.get(p, prefix_range_end(p.encode())) for p in prefixes]
            _, responses = c.transaction(compare=[], success=gets, failure=[])
            kvs: list[KeyValue] = []
            revision = 0
            for rows in responses:
                for value, meta in rows:
                    kvs.append(_kv(value, meta))
                    revision = int(meta.response_header.revision)
            if revision == 0:  # nothing matched: ask for the header revision alone
                revision = _revision_of(c)
            return Snapshot(sorted(kvs, key=lambda kv: kv.key), revision)

        return await self._call("read " + ", ".join(prefixes), op)

    async def put(self, key: str, value: bytes, lease: int | None = None) -> int:
        def op(c: Any) -> int:
            return int(c.put(key, value, lease=lease).header.revision)

        return await self._call(f"put {key}", op)

    async def delete(self, key: str) -> bool:
        return await self._call(f"delete {key}", lambda c: bool(c.delete(key)))

    async def txn(
        self,
        compares: Sequence[Compare],
        success: Sequence[Op],
        read_on_failure: Sequence[str] = (),
        *,
        idempotent: bool = True,
    ) -> TxnResult:
        if len(success) > MAX_TXN_OPS or len(read_on_failure) > MAX_TXN_OPS:
            raise StoreError(
                f"a transaction of {len(success)} operations is over LUMEN's limit of "
                f"{MAX_TXN_OPS} (etcd refuses more than --max-txn-ops, 128 by default); "
                "this is a bug: the caller must split it"
            )

        def op(c: Any) -> TxnResult:
            t = c.transactions
            compare = [(t.create(cmp.key) if isinstance(cmp, CreateRevisionIs)
                        else t.mod(cmp.key)) == cmp.revision for cmp in compares]
            ops = [_txn_op(t, o) for o in success]
            failure = [t.get(k) for k in read_on_failure]
            succeeded, responses = c.transaction(compare=compare, success=ops, failure=failure)
            read: dict[str, KeyValue] = {}
            revision = 0
            if not succeeded:
                for rows in responses:
                    for value, meta in rows:
                        kv = _kv(value, meta)
                        read[kv.key] = kv
                        revision = max(revision, int(meta.response_header.revision))
            else:
                for response in responses:
                    header = getattr(response, "header", None)
                    if header is None:
                        inner = getattr(response, response.WhichOneof("response"))
                        header = inner.header
                    revision = max(revision, int(header.revision))
            return TxnResult(bool(succeeded), revision, read)

        return await self._call("transaction", op, idempotent=idempotent)

    async def keys(self, prefix: str, *, limit: int = 0, newest_first: bool = False
                   ) -> list[str]:
        def op(c: Any) -> list[str]:
            response = c.get_prefix_response(
                prefix, keys_only=True, limit=limit or None,
                sort_order="descend" if newest_first else "ascend")
            return [kv.key.decode() for kv in response.kvs]

        return await self._call(f"list keys {prefix}", op)

    async def status(self) -> StoreStatus:
        return await self._call("status", self._status)

    def _status_if_allowed(self, c: Any) -> StoreStatus | None:
        """The health part of a whole-prefix read, best effort: etcd refusing it (a client
        without the permission, an old member) must not fail the read of the keys."""
        try:
            return self._status(c)
        except grpc.RpcError as exc:
            if exc.code() in _TRANSIENT_CODES:
                raise  # the member is gone: the whole read moves to the next one
            log.debug("etcd status/alarms not readable: %s", _describe(exc))
            return None

    def _status(self, c: Any) -> StoreStatus:
        from pyetcd import etcdrpc

        stub = c.maintenancestub
        status = stub.Status(etcdrpc.StatusRequest(), self._timeout,
                             credentials=c.call_credentials, metadata=c.metadata)
        request = etcdrpc.AlarmRequest(action=etcdrpc.AlarmRequest.GET, memberID=0,
                                       alarm=etcdrpc.NONE)
        alarms = stub.Alarm(request, self._timeout, credentials=c.call_credentials,
                            metadata=c.metadata).alarms
        names = sorted({etcdrpc.AlarmType.Name(a.alarm) for a in alarms})
        return StoreStatus(self._specs[self._current].url, int(status.dbSize),
                           int(status.header.revision), tuple(names))

    async def compact(self, revision: int) -> None:
        def op(c: Any) -> None:
            from pyetcd import etcdrpc

            try:
                c.kvstub.Compact(etcdrpc.CompactionRequest(revision=revision), self._timeout,
                                 credentials=c.call_credentials, metadata=c.metadata)
            except grpc.RpcError as exc:
                # Compacted already (by auto-compaction or another coordinator): done.
                if exc.code() == grpc.StatusCode.OUT_OF_RANGE:
                    return
                raise

        await self._call(f"compact to revision {revision}", op)

    async def grant_lease(self, ttl_s: int) -> int:
        return await self._call(f"grant lease ttl={ttl_s}", lambda c: int(c.lease(ttl_s).id))

    async def watch_key(self, key: str, on_change: Callable[[], None]) -> WatchHandle:
        handle = WatchHandle()

        def callback(response: Any) -> None:
            if response is None or isinstance(response, BaseException):
                handle.alive = False
            on_change()

        def op(c: Any) -> None:
            watch_id = c.add_watch_callback(key, callback)
            handle._cancel = lambda: c.cancel_watch(watch_id)

        await self._call(f"watch {key}", op)
        return handle

    async def keepalive(self, lease: int) -> int:
        def op(c: Any) -> int:
            ttl = 0
            for response in c.refresh_lease(lease):
                ttl = int(response.TTL)
            return max(ttl, 0)

        return await self._call("lease keepalive", op)

    async def revoke_lease(self, lease: int) -> None:
        try:
            await self._call("revoke lease", lambda c: c.revoke_lease(lease))
        except StoreError as exc:
            # An already expired lease is not an error when we are letting it go.
            if "not found" not in str(exc).lower():
                raise

    async def close(self) -> None:
        await asyncio.to_thread(self._channels.drain, 2.0)


class _Abandoned(Exception):
    """A call's thread did not return long after its deadline (see `EtcdStore._in_thread`)."""


def _quiet(call: asyncio.Future[Any]) -> None:
    """Retrieve an abandoned call's outcome whenever it comes, so none is logged as lost."""
    if not call.cancelled():
        call.exception()


def _txn_op(t: Any, o: Op) -> Any:
    if isinstance(o, Put):
        return t.put(o.key, o.value, lease=o.lease)
    if isinstance(o, DeleteRange):
        return t.delete(o.start, range_end=o.end)
    return t.delete(o.key)


def _surely_unsent(exc: BaseException) -> bool:
    """Whether a failed call certainly never reached etcd (the connection was refused), so
    that sending it again cannot apply it twice. Anything else (a deadline, a reset
    connection, an internal error) may have been applied."""
    if isinstance(exc, ValueError):  # pyetcd refused to use the endpoint before sending
        return True
    cause = exc if isinstance(exc, grpc.RpcError) else exc.__context__
    if not isinstance(cause, grpc.RpcError) or not hasattr(cause, "code"):
        return False
    details = (cause.details() or "").lower()
    return cause.code() == grpc.StatusCode.UNAVAILABLE and (
        "connection refused" in details or "failed to connect" in details)


def _revision_of(client: Any) -> int:
    """The store's current revision (a range read of one unlikely key returns the header)."""
    return int(client.get_response("\0").header.revision)


def _kv(value: bytes, meta: Any) -> KeyValue:
    return KeyValue(
        key=meta.key.decode(),
        value=bytes(value),
        create_revision=int(meta.create_revision),
        mod_revision=int(meta.mod_revision),
        lease=int(meta.lease_id),
    )


def _describe(exc: BaseException) -> str:
    if isinstance(exc, grpc.RpcError) and hasattr(exc, "code"):
        return f"{exc.code().name}: {exc.details()}"
    text = str(exc) or type(exc).__name__
    cause = exc.__context__  # pyetcd raises its own exceptions inside `except RpcError`
    if isinstance(cause, grpc.RpcError) and hasattr(cause, "details"):
        text += f" ({cause.details()})"
    return text

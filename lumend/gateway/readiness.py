"""Per-node readiness for load balancers (`GET /ready`), and refusing new requests while the
node drains or stops.

`/health` answers for the cluster (is any worker serving anywhere); `/ready` answers for this
node's gateway: should a load balancer send it new requests? Not while lumend stops (SIGTERM:
it drains its streams, then stops its engines), not while an operator drains the node
(`lumenctl drain NODE`), not before the node is registered with the cluster, and not while
no worker in the cluster serves. The state is one explicit machine:

    serving --drain()--> draining --stop()--> stopping
    serving --stop()---> stopping

`draining` and `stopping` are not left: a stopping lumend exits, and a drain of the gateway is
only the first step of a stop. An operator's node drain is read from the cluster view, not
kept here, so an undrain makes the node ready again by itself.

While the phase is not `serving`, new completion requests get 503 with Retry-After (a load
balancer or client retries them on another node); requests already admitted go on. `/ready`
and the refusal need no API key: the check runs before the gateway's authentication.
"""

from __future__ import annotations

import enum
import weakref
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from lumend.cluster.view import ClusterView

READY_PATH = "/ready"
COMPLETION_PATHS = frozenset({"/v1/completions", "/v1/chat/completions"})
RETRY_AFTER_S = 1


class Phase(enum.Enum):
    serving = "serving"
    draining = "draining"  # lumend is stopping: no new requests, streams in flight finish
    stopping = "stopping"  # streams are done (or drain_s passed): engines are being stopped


# The transitions, in one place: (from, to) pairs that are allowed.
TRANSITIONS = frozenset({
    (Phase.serving, Phase.draining),
    (Phase.serving, Phase.stopping),
    (Phase.draining, Phase.stopping),
})


class NodeReadiness:
    """Whether this node's gateway should get new requests, and why not."""

    def __init__(self, node: str, view: Callable[[], ClusterView | None]) -> None:
        self.node = node
        self._view = view
        self.phase = Phase.serving
        self.refused = 0  # requests refused because the node was draining or stopping

    def _move(self, to: Phase) -> bool:
        if (self.phase, to) not in TRANSITIONS:
            return False
        self.phase = to
        return True

    def drain(self) -> bool:
        """Stop admitting (lumend got SIGTERM). False when already draining or stopping."""
        return self._move(Phase.draining)

    def stop(self) -> bool:
        """The engines are being stopped. False when already stopping."""
        return self._move(Phase.stopping)

    @property
    def admitting(self) -> bool:
        return self.phase is Phase.serving

    def reason(self) -> str | None:
        """None when ready; otherwise one sentence saying why not."""
        if self.phase is Phase.draining:
            return "lumend is stopping: draining the streams in flight"
        if self.phase is Phase.stopping:
            return "lumend is stopping its engines"
        view = self._view()
        if view is None:
            return "the node has not read the cluster from etcd yet"
        if self.node not in view.nodes:
            return "the node is not registered in etcd"
        drains = [i for i in view.node_intents(self.node) if i.kind == "drain"]
        if drains:
            by = f" by {drains[0].requested_by}" if drains[0].requested_by else ""
            return f"the node is drained{by} (lumenctl undrain {self.node} to bring it back)"
        if not any(w.state == "serving" for w in view.workers.values()):
            return "no worker in the cluster is serving"
        return None

    def document(self) -> tuple[int, dict[str, Any]]:
        reason = self.reason()
        doc: dict[str, Any] = {"node": self.node, "ready": reason is None,
                               "phase": self.phase.value}
        if reason is not None:
            doc["reason"] = reason
        return (200 if reason is None else 503), doc

    async def handle(self, _: web.Request) -> web.Response:
        status, doc = self.document()
        return web.json_response(doc, status=status)

    @web.middleware
    async def middleware(self, request: web.Request,
                         handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
                         ) -> web.StreamResponse:
        if request.path == READY_PATH and request.method in ("GET", "HEAD"):
            return await self.handle(request)
        if (not self.admitting and request.method == "POST"
                and request.path in COMPLETION_PATHS):
            self.refused += 1
            message = (f"node {self.node} is stopping and admits no new requests; send it to "
                       "another node (GET /ready tells a load balancer)")
            return web.json_response(
                {"error": {"message": message, "type": "unavailable", "param": None,
                           "code": "node_stopping"}},
                status=503, headers={"Retry-After": str(RETRY_AFTER_S)})
        return await handler(request)


_attached: weakref.WeakKeyDictionary[object, NodeReadiness] = weakref.WeakKeyDictionary()


def attach(gateway: object, readiness: NodeReadiness) -> None:
    """Make `readiness` the one `install` puts in front of this gateway's app."""
    _attached[gateway] = readiness


def readiness_of(gateway: object) -> NodeReadiness | None:
    return _attached.get(gateway)


def install(app: web.Application, gateway: object) -> None:
    """Called by the gateway when it builds its app: `/ready`, and the refusal of new
    requests while stopping, in front of every other middleware (authentication included).
    A gateway without attached readiness (tests, tools) gets none of this."""
    readiness = _attached.get(gateway)
    if readiness is None:
        return
    app.middlewares.insert(0, readiness.middleware)
    app.router.add_get(READY_PATH, readiness.handle)

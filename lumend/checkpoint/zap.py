"""Authentication of peers on sockets secured with the cluster's CURVE keys (the checkpoint
holder and the draft server): a ZAP handler (RFC 27) that admits only the cluster's client
public key, and a monitor of failed handshakes (peers without CURVE, or expecting another
server key, never reach ZAP). Both report each refusal to the server's own counter."""

from __future__ import annotations

from collections.abc import Callable

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message
from zmq.utils.z85 import encode as z85_encode

ZAP_ENDPOINT = "inproc://zeromq.zap.01"  # fixed by the ZAP specification (RFC 27)
HANDSHAKE_FAILED = zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL

Refuse = Callable[[str], None]  # called with what was wrong, once per refused peer


class ZapBindError(Exception):
    """Another ZAP handler already serves this ZeroMQ context."""


def bind_zap(context: zmq.asyncio.Context) -> zmq.asyncio.Socket:
    zap = context.socket(zmq.REP)
    zap.setsockopt(zmq.LINGER, 0)
    try:
        zap.bind(ZAP_ENDPOINT)
    except zmq.ZMQError as exc:
        zap.close(0)
        raise ZapBindError(f"cannot serve ZAP authentication ({exc}): another ZAP handler "
                           "already runs in this ZeroMQ context; give each secure server a "
                           "context of its own") from exc
    return zap


async def serve_zap(zap: zmq.asyncio.Socket, allowed: bytes, refuse: Refuse) -> None:
    """Answer ZAP requests until cancelled: CURVE with `allowed` as client key, or refused."""
    while True:
        request = await zap.recv_multipart()
        # version, request id, domain, address, identity, mechanism, credentials...
        version, request_id, _, address, _, mechanism, key = [*request, *[b""] * 7][:7]
        if version != b"1.0" or len(request) < 6:
            status, text = b"500", b"malformed ZAP request"
        elif mechanism == b"CURVE" and key == allowed:
            status, text = b"200", b"OK"
        else:
            status, text = b"400", b"not the cluster's client key"
            shown = (f"client key {z85_encode(key).decode()}" if len(key) == 32
                     else f"mechanism {mechanism.decode(errors='replace')}")
            refuse(f"peer {address.decode(errors='replace')} presented {shown}, not the "
                   "cluster's client key (check that its node has this cluster's "
                   "[checkpoint] keys file)")
        await zap.send_multipart([b"1.0", request_id, status, text, b"", b""])


async def watch_handshakes(monitor: zmq.asyncio.Socket, refuse: Refuse) -> None:
    """Report failed CURVE handshakes on a socket's monitor until cancelled."""
    while True:
        event = parse_monitor_message(await monitor.recv_multipart())
        if event["event"] & HANDSHAKE_FAILED:
            refuse("a peer failed the CURVE handshake on "
                   f"{event['endpoint'].decode(errors='replace')} (no CURVE, or not this "
                   "cluster's server key: check its [checkpoint] keys file)")

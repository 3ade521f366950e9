"""GMS wire protocol: 4-byte big-endian length + msgpack map; fds ride along via SCM_RIGHTS.

Requests carry `op` and `id`; replies echo `id` with `ok` and either the op's fields or
`error`. An `export` reply carries exactly one file descriptor in the same `sendmsg`.
"""

from __future__ import annotations

import array
import hashlib
import socket
import struct
from typing import Any, Literal

import msgspec

MAX_FRAME = 1 << 20
HEADER = struct.Struct(">I")
PROTOCOL_VERSION = 1

Tag = Literal["weights", "kv_cache"]
Role = Literal["writer", "reader", "auto"]


class FrameError(Exception):
    """A frame that is not valid GMS protocol; the connection carrying it is closed."""


TensorKind = Literal["param", "buffer", "attr"]


class TensorMeta(msgspec.Struct, frozen=True, kw_only=True):
    """Where a named tensor lives. `stride` (in elements) is None for a contiguous tensor;
    `kind` says how a reader re-attaches it to its module (parameter, buffer, attribute)."""

    name: str
    allocation: int
    offset: int
    shape: list[int]
    dtype: str
    stride: list[int] | None = None
    kind: TensorKind = "param"


def element_extent(shape: list[int], stride: list[int] | None) -> int:
    """Elements spanned by a tensor from its first element (its storage footprint)."""
    if any(d == 0 for d in shape):
        return 0
    if stride is None:
        n = 1
        for d in shape:
            n *= d
        return n
    if len(stride) != len(shape):
        raise ValueError(f"stride {stride} does not match shape {shape}")
    return 1 + sum((d - 1) * s for d, s in zip(shape, stride, strict=True))


class Hello(msgspec.Struct, frozen=True, tag="hello", kw_only=True):
    id: int
    version: int
    role: Role
    timeout_s: float = 30.0


class Allocate(msgspec.Struct, frozen=True, tag="allocate", kw_only=True):
    id: int
    tag: Tag
    size: int


class Export(msgspec.Struct, frozen=True, tag="export", kw_only=True):
    id: int
    allocation: int


class PutTensor(msgspec.Struct, frozen=True, tag="put_tensor", kw_only=True):
    id: int
    tensor: TensorMeta


class Commit(msgspec.Struct, frozen=True, tag="commit", kw_only=True):
    id: int


class Layout(msgspec.Struct, frozen=True, tag="layout", kw_only=True):
    id: int


class Stats(msgspec.Struct, frozen=True, tag="stats", kw_only=True):
    id: int


Request = Hello | Allocate | Export | PutTensor | Commit | Layout | Stats

_request_decoder = msgspec.msgpack.Decoder(Request)
_encoder = msgspec.msgpack.Encoder()


def decode_request(payload: bytes) -> Request:
    try:
        return _request_decoder.decode(payload)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise FrameError(f"malformed request: {exc}") from exc


def encode(message: msgspec.Struct | dict[str, Any]) -> bytes:
    body = _encoder.encode(message)
    return HEADER.pack(len(body)) + body


def decode_reply(payload: bytes) -> dict[str, Any]:
    try:
        reply = msgspec.msgpack.decode(payload)
    except msgspec.DecodeError as exc:
        raise FrameError(f"malformed reply: {exc}") from exc
    if not isinstance(reply, dict):
        raise FrameError("malformed reply: not a map")
    return reply


def layout_hash(allocations: dict[int, tuple[str, int]], tensors: list[TensorMeta]) -> str:
    """A digest of the published layout (allocation sizes and tags, tensor placement).

    Readers recompute it from what they received; a mismatch means a torn or stale layout.
    """
    h = hashlib.sha256()
    for alloc_id in sorted(allocations):
        tag, size = allocations[alloc_id]
        h.update(f"a{alloc_id}:{tag}:{size};".encode())
    for t in sorted(tensors, key=lambda t: t.name):
        h.update(msgspec.msgpack.encode(t))
    return h.hexdigest()


# -- blocking socket helpers (clients and tests) -----------------------------------------


def send_frame(sock: socket.socket, message: msgspec.Struct | dict[str, Any],
               fds: list[int] | None = None) -> None:
    data = encode(message)
    if fds:
        sock.sendmsg([data], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))])
    else:
        sock.sendall(data)


def recv_frame(sock: socket.socket) -> tuple[bytes, list[int]]:
    """One frame and any fds that arrived with it (reads exactly the frame, never beyond)."""
    fds: list[int] = []
    (length,) = HEADER.unpack(_recv_exact(sock, HEADER.size, fds))
    if length > MAX_FRAME:
        raise FrameError(f"frame of {length} bytes exceeds the {MAX_FRAME}-byte limit")
    return _recv_exact(sock, length, fds), fds


def _recv_exact(sock: socket.socket, n: int, fds: list[int]) -> bytes:
    data = b""
    while len(data) < n:
        msg, anc, _flags, _addr = sock.recvmsg(n - len(data), socket.CMSG_SPACE(4 * 4))
        if not msg:
            raise ConnectionError("GMS connection closed")
        for level, kind, payload in anc:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                fds.extend(array.array("i", payload[: len(payload) - len(payload) % 4]))
        data += msg
    return data

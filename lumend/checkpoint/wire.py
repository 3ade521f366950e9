"""The KV checkpoint wire format: what engines and holders exchange over ZeroMQ.

A message is one or two frames: frame 0 a msgpack `Header`, frame 1 (PUT, and the ACK of a
GET) a KV page sent without copying. Engines talk DEALER -> ROUTER; the holder answers every
request with an ACK or an ERROR carrying the request's `seq`.

This module is the contract engines import: it depends on msgspec only, never on the daemon.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Annotated, Any, Literal

import msgspec

WIRE_VERSION = 1
MAX_HEADER_BYTES = 64 * 1024
DEFAULT_MAX_PAGE_BYTES = 64 * 1024 * 1024

Op = Literal["put", "lookup", "get", "finish", "ack", "error"]
PUT: Op = "put"
LOOKUP: Op = "lookup"
GET: Op = "get"
FINISH: Op = "finish"
ACK: Op = "ack"
ERROR: Op = "error"

# Why a message was refused (the ERROR reply's `reason`, and the holder's counter label).
Reason = Literal[
    "malformed",       # not a header we can decode, a field of the wrong type, a frame too many
    "version",         # a wire version this side does not speak
    "size_mismatch",   # payload length differs from dtype itemsize x page_shape
    "oversized",       # payload (or header) over the limit
    "fingerprint",     # layout fingerprint / model / tp size differ from the checkpoint's
    "unknown_worker",  # the worker named is not one this holder accounts for
    "budget",          # the worker's budget is full: the checkpoint (or this page) is refused
    "evicted",         # the checkpoint was evicted or refused earlier; its pages are gone
    "finished",        # the checkpoint's request finished (FINISH) before this page came
    "missing",         # GET of a page the holder does not have
    "unauthenticated",  # a peer without the cluster's CURVE keys (refused at the handshake)
]
BAD_FRAME_REASONS: tuple[Reason, ...] = (
    "malformed", "version", "size_mismatch", "oversized", "fingerprint", "unknown_worker",
    "unauthenticated",
)

DTYPE_SIZES: dict[str, int] = {
    "float64": 8, "float32": 4, "float16": 2, "bfloat16": 2,
    "float8_e4m3fn": 1, "float8_e5m2": 1, "fp8": 1,
    "int64": 8, "int32": 4, "int16": 2, "int8": 1, "uint8": 1,
}

Name = Annotated[str, msgspec.Meta(max_length=256)]
Count = Annotated[int, msgspec.Meta(ge=0)]


class Header(msgspec.Struct, kw_only=True, frozen=True, omit_defaults=True):
    """Frame 0 of every message. Ops use the fields they need; the rest keep their defaults.

    `block_hash` (and each of `hashes`) is bytes or a hex string; `hash_bytes` normalises it.
    """

    version: int
    op: Op
    seq: Count = 0                       # echoed by the reply (LOOKUP/GET correlation)
    ckpt_id: Name = ""
    request_id: Name = ""
    worker: Name = ""                    # the worker of the holder's node it is charged to
    model: Name = ""
    layout_fingerprint: Name = ""
    tp_rank: Count = 0
    tp_size: Annotated[int, msgspec.Meta(ge=1, le=4096)] = 1
    block_index: Count = 0
    block_hash: Any = b""
    token_count: Count = 0               # tokens of the prefix up to and including this block
    dtype: Annotated[str, msgspec.Meta(max_length=32)] = ""
    page_shape: Annotated[list[Annotated[int, msgspec.Meta(ge=1)]],
                          msgspec.Meta(max_length=8)] = []
    hashes: Annotated[list[Any], msgspec.Meta(max_length=1 << 16)] = []   # LOOKUP: the chain
    reached: Count = 0                   # ACK of PUT: blocks 0..reached-1 held on this rank
    matched: Count = 0                   # ACK of LOOKUP: consecutive blocks complete on all ranks
    reason: Annotated[str, msgspec.Meta(max_length=32)] = ""    # ERROR: a `Reason`
    error: Annotated[str, msgspec.Meta(max_length=1024)] = ""   # ERROR: what was wrong


class _Versioned(msgspec.Struct):
    version: int


class WireError(Exception):
    """A message that cannot be accepted; `reason` is a `Reason`, the text names the field."""

    def __init__(self, reason: Reason, message: str) -> None:
        super().__init__(message)
        self.reason: Reason = reason


class Message(msgspec.Struct, frozen=True):
    header: Header
    payload: memoryview | None = None


_encoder = msgspec.msgpack.Encoder()
_header_decoder = msgspec.msgpack.Decoder(Header)
_version_decoder = msgspec.msgpack.Decoder(_Versioned)


def encode_header(header: Header) -> bytes:
    return _encoder.encode(header)


def frames(header: Header, payload: Any = None) -> list[Any]:
    """The frames of one message; send them with `copy=False` so the page is not copied."""
    encoded = encode_header(header)
    return [encoded] if payload is None else [encoded, payload]


def page_nbytes(dtype: str, page_shape: Sequence[int]) -> int:
    """Bytes of one page; raises WireError naming the field when dtype is unknown."""
    itemsize = DTYPE_SIZES.get(dtype)
    if itemsize is None:
        raise WireError("malformed", f"dtype: unknown dtype {dtype!r}; one of "
                        f"{', '.join(DTYPE_SIZES)}")
    return itemsize * math.prod(page_shape)


def hash_bytes(value: Any, field: str = "block_hash") -> bytes:
    """A block hash as bytes: bytes as they are, a str as hex (vLLM hashes are bytes)."""
    if isinstance(value, bytes | bytearray | memoryview):
        raw = bytes(value)
    elif isinstance(value, str):
        try:
            raw = bytes.fromhex(value)
        except ValueError:
            raise WireError("malformed", f"{field}: not a hex string") from None
    else:
        raise WireError("malformed", f"{field}: expected bytes or a hex string, got "
                        f"{type(value).__name__}")
    if not raw or len(raw) > 256:
        raise WireError("malformed", f"{field}: must be 1..256 bytes, got {len(raw)}")
    return raw


def decode(parts: Sequence[Any], max_page_bytes: int = DEFAULT_MAX_PAGE_BYTES) -> Message:
    """Validate a received message (its frames, without a ROUTER identity).

    Raises WireError with the reason and a message naming the offending field. The payload
    is returned as a memoryview over the received frame (no copy).
    """
    if not parts:
        raise WireError("malformed", "message: no frames")
    if len(parts) > 2:
        raise WireError("malformed", f"message: {len(parts)} frames, at most 2 expected")
    raw = memoryview(parts[0])
    if raw.nbytes > MAX_HEADER_BYTES:
        raise WireError("oversized", f"header: {raw.nbytes} bytes over the "
                        f"{MAX_HEADER_BYTES}-byte limit")
    try:
        version = _version_decoder.decode(raw).version
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise WireError("malformed", f"header: {exc}") from None
    if version != WIRE_VERSION:
        raise WireError("version", f"version: {version} is not spoken here (this side "
                        f"speaks {WIRE_VERSION})")
    try:
        header = _header_decoder.decode(raw)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise WireError("malformed", f"header: {exc}") from None
    payload = memoryview(parts[1]) if len(parts) == 2 else None
    _check_fields(header, payload, max_page_bytes)
    return Message(header, payload)


_REQUIRED: dict[str, tuple[str, ...]] = {
    PUT: ("ckpt_id", "worker", "block_hash", "dtype", "page_shape"),
    LOOKUP: ("ckpt_id",),
    GET: ("ckpt_id", "block_hash"),
    FINISH: ("ckpt_id",),
    ACK: (),
    ERROR: ("reason",),
}
_WITH_PAYLOAD = (PUT, ACK)


def _check_fields(header: Header, payload: memoryview | None, max_page_bytes: int) -> None:
    op = header.op
    for name in _REQUIRED[op]:
        if getattr(header, name) in ("", b"", []):
            raise WireError("malformed", f"{name}: required for {op}")
    if header.tp_rank >= header.tp_size:
        raise WireError("malformed", f"tp_rank: {header.tp_rank} is not below tp_size "
                        f"{header.tp_size}")
    if op in (PUT, GET) or (op == ACK and header.block_hash != b""):
        hash_bytes(header.block_hash)
    for i, h in enumerate(header.hashes):
        hash_bytes(h, f"hashes[{i}]")
    if payload is None:
        if op == PUT:
            raise WireError("malformed", "payload: put needs a page frame")
        return
    if op not in _WITH_PAYLOAD:
        raise WireError("malformed", f"payload: {op} takes no page frame")
    if payload.nbytes > max_page_bytes:
        raise WireError("oversized", f"payload: {payload.nbytes} bytes over the "
                        f"{max_page_bytes}-byte page limit")
    expected = page_nbytes(header.dtype, header.page_shape)
    if payload.nbytes != expected:
        raise WireError("size_mismatch", f"payload: {payload.nbytes} bytes, but dtype "
                        f"{header.dtype} x page_shape {header.page_shape} is {expected}")


def request(op: Op, **fields: Any) -> Header:
    """A header of this wire version."""
    return Header(version=WIRE_VERSION, op=op, **fields)


def error_reply(seq: int, reason: Reason, message: str, **fields: Any) -> Header:
    return Header(version=WIRE_VERSION, op=ERROR, seq=seq, reason=reason,
                  error=message[:1024], **fields)

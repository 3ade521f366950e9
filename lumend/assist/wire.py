"""The draft-assist wire format: what a survivor's engine and a recovering worker's draft
server exchange over ZeroMQ (LUMEN's Algorithm 3).

The survivor (a DEALER) sends one `Round` per decode step for the requests it speculates
on; the drafter (a ROUTER) answers with `Drafts` carrying the round's `seq`. Context travels
append-only: an item's `tokens` are the request's newly committed tokens, to be placed at
offset `base` of its committed context (base 0 with the whole context the first time, and
again after the drafter asked for a resync). A `Release` frees finished requests; it has no
reply. A message the drafter refuses is answered with an `Error` naming the field.

Every message is one frame of msgpack, every field is bounded, and a decode error names the
field. This module is the contract both engines import (the sim engine and vLLM's
proposer): it depends on msgspec only, never on the daemon.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated, Any, Literal

import msgspec

WIRE_VERSION = 1
MAX_K = 16                      # drafted tokens per request per round
MAX_ITEMS = 4096                # requests per round (a batch)
MAX_TOKENS = 1 << 21            # tokens of one item (a whole context on a resync)
MAX_TOKEN_ID = (1 << 31) - 1    # vocabularies are far smaller; ids are never negative
MAX_MESSAGE_BYTES = 64 << 20    # one frame; libzmq drops a larger one before buffering it

# Why a message was refused (an `Error`'s reason, and the drafter's counter label).
Reason = Literal[
    "malformed",        # not msgpack, a field of the wrong type or out of its bounds
    "version",          # a wire version this side does not speak
    "oversized",        # a frame over MAX_MESSAGE_BYTES, or more than one frame
    "model",            # a round for a model this drafter does not draft for
    "unauthenticated",  # a peer without the cluster's CURVE keys (refused at the handshake)
]
REASONS: tuple[Reason, ...] = ("malformed", "version", "oversized", "model", "unauthenticated")

Name = Annotated[str, msgspec.Meta(max_length=256)]
Seq = Annotated[int, msgspec.Meta(ge=0, le=(1 << 63) - 1)]
Token = Annotated[int, msgspec.Meta(ge=0, le=MAX_TOKEN_ID)]
Offset = Annotated[int, msgspec.Meta(ge=0, le=MAX_TOKENS)]
K = Annotated[int, msgspec.Meta(ge=0, le=MAX_K)]


class Update(msgspec.Struct, frozen=True, kw_only=True):
    """Request `request_id`'s committed context is now context[:base] + tokens."""

    request_id: Name
    base: Offset
    tokens: Annotated[list[Token], msgspec.Meta(max_length=MAX_TOKENS)]


class Round(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True, tag="round",
            tag_field="op"):
    """One survivor step: context updates, and k drafts wanted for each item."""

    version: int
    seq: Seq
    k: K
    items: Annotated[list[Update], msgspec.Meta(max_length=MAX_ITEMS)]
    model: Name = ""      # the survivor's model; "" skips the drafter's check
    survivor: Name = ""   # who sends (logs and counters only)


class Release(msgspec.Struct, frozen=True, kw_only=True, tag="release", tag_field="op"):
    """These requests finished (or left the survivor): forget their context."""

    version: int
    request_ids: Annotated[list[Name], msgspec.Meta(max_length=MAX_ITEMS)]


class Draft(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """Drafts for one request. `resync`: the drafter's context does not reach the item's
    base (it never saw the request, or lost updates): send the whole context next round."""

    request_id: Name
    drafts: Annotated[list[Token], msgspec.Meta(max_length=MAX_K)] = []
    resync: bool = False


class Drafts(msgspec.Struct, frozen=True, kw_only=True, tag="drafts", tag_field="op"):
    """The reply to the round `seq`. It may also carry resync items for requests of earlier
    rounds that the drafter applied without drafting (rounds that queued up)."""

    version: int
    seq: Seq
    items: Annotated[list[Draft], msgspec.Meta(max_length=2 * MAX_ITEMS)]


class Error(msgspec.Struct, frozen=True, kw_only=True, tag="error", tag_field="op"):
    version: int
    seq: Seq = 0          # the refused round's seq when it could be read, else 0
    reason: Annotated[str, msgspec.Meta(max_length=32)]
    error: Annotated[str, msgspec.Meta(max_length=1024)] = ""


Message = Round | Release | Drafts | Error
Request = Round | Release
Reply = Drafts | Error


class WireError(Exception):
    """A message that cannot be accepted; `reason` is a `Reason`, the text names the field."""

    def __init__(self, reason: Reason, message: str, seq: int = 0) -> None:
        super().__init__(message)
        self.reason: Reason = reason
        self.seq = seq


class _Versioned(msgspec.Struct):
    version: int


_encoder = msgspec.msgpack.Encoder()
_version_decoder = msgspec.msgpack.Decoder(_Versioned)
_request_decoder = msgspec.msgpack.Decoder(Request)
_reply_decoder = msgspec.msgpack.Decoder(Reply)


def encode(message: Message) -> bytes:
    return _encoder.encode(message)


def round_(seq: int, k: int, items: Sequence[Update], *, model: str = "",
           survivor: str = "") -> Round:
    return Round(version=WIRE_VERSION, seq=seq, k=k, items=list(items), model=model,
                 survivor=survivor)


def release(request_ids: Sequence[str]) -> Release:
    return Release(version=WIRE_VERSION, request_ids=list(request_ids))


def drafts(seq: int, items: Sequence[Draft]) -> Drafts:
    return Drafts(version=WIRE_VERSION, seq=seq, items=list(items))


def error(seq: int, reason: Reason, message: str) -> Error:
    return Error(version=WIRE_VERSION, seq=seq, reason=reason, error=message[:1024])


def decode_request(parts: Sequence[Any]) -> Round | Release:
    """Validate what a survivor sent (the frames after the ROUTER identity)."""
    raw = _one_frame(parts)
    try:
        return _request_decoder.decode(raw)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise WireError("malformed", f"message: {exc}", _seq_of(raw)) from None


def decode_reply(parts: Sequence[Any]) -> Drafts | Error:
    """Validate what a drafter answered."""
    raw = _one_frame(parts)
    try:
        return _reply_decoder.decode(raw)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise WireError("malformed", f"message: {exc}", _seq_of(raw)) from None


def _one_frame(parts: Sequence[Any]) -> memoryview:
    if len(parts) != 1:
        raise WireError("oversized" if len(parts) > 1 else "malformed",
                        f"message: {len(parts)} frames, exactly 1 expected")
    raw = memoryview(parts[0])
    if raw.nbytes > MAX_MESSAGE_BYTES:
        raise WireError("oversized", f"message: {raw.nbytes} bytes over the "
                        f"{MAX_MESSAGE_BYTES}-byte limit")
    try:
        version = _version_decoder.decode(raw).version
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise WireError("malformed", f"message: {exc}", _seq_of(raw)) from None
    if version != WIRE_VERSION:
        raise WireError("version", f"version: {version} is not spoken here (this side "
                        f"speaks {WIRE_VERSION})", _seq_of(raw))
    return raw


def _seq_of(raw: memoryview) -> int:
    """The seq of a message that failed validation, when it can still be read (else 0)."""
    try:
        value = msgspec.msgpack.decode(raw)
    except Exception:
        return 0
    seq = value.get("seq", 0) if isinstance(value, dict) else 0
    return seq if isinstance(seq, int) and 0 <= seq < (1 << 63) else 0

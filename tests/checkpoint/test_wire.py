"""The wire contract: what is accepted, and every refusal naming its field."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from lumend.checkpoint import wire
from lumend.checkpoint.wire import WireError

from .conftest import LAYOUT, PAGE, block_hash, page, put_header


def encode(header: object) -> bytes:
    return msgspec.msgpack.encode(header)


def test_a_put_round_trips_without_copying_the_page() -> None:
    data = bytearray(page(7))
    message = wire.decode(wire.frames(put_header(), data))
    assert message.header == put_header()
    assert message.payload is not None and message.payload.obj is data


def test_a_hex_block_hash_means_the_same_bytes() -> None:
    h = block_hash("c1", 0)
    message = wire.decode(wire.frames(put_header(block_hash=h.hex()), page(1)))
    assert wire.hash_bytes(message.header.block_hash) == h


def field_of(header: dict[str, Any], **changes: Any) -> dict[str, Any]:
    return {**header, **changes}


GOOD = msgspec.to_builtins(put_header(), builtin_types=(bytes,))


@pytest.mark.parametrize(
    ("parts", "reason", "names"),
    [
        ([encode(field_of(GOOD, version=2)), page(0)], "version", "version: 2"),
        ([encode({"op": "put"}), page(0)], "malformed", "version"),
        ([b"\xc1not msgpack"], "malformed", "header"),
        ([encode([1, 2, 3])], "malformed", "header"),
        ([encode(field_of(GOOD, tp_rank="zero")), page(0)], "malformed", "$.tp_rank"),
        ([encode(field_of(GOOD, tp_rank=2, tp_size=2)), page(0)], "malformed", "tp_rank"),
        ([encode(field_of(GOOD, op="delete")), page(0)], "malformed", "$.op"),
        ([encode(field_of(GOOD, page_shape=[0, 4])), page(0)], "malformed", "$.page_shape"),
        ([encode(field_of(GOOD, ckpt_id="")), page(0)], "malformed", "ckpt_id"),
        ([encode(field_of(GOOD, block_hash=7)), page(0)], "malformed", "block_hash"),
        ([encode(field_of(GOOD, block_hash="zz")), page(0)], "malformed", "block_hash"),
        ([encode(field_of(GOOD, dtype="float3")), page(0)], "malformed", "dtype"),
        ([encode(GOOD)], "malformed", "payload"),
        ([encode(GOOD), page(0), b"x"], "malformed", "3 frames"),
        ([encode(GOOD), page(0)[:-1]], "size_mismatch", "payload"),
        ([encode(field_of(GOOD, op="finish")), page(0)], "malformed", "payload"),
        ([encode(field_of(GOOD, hashes=[b"ok", 3])), page(0)], "malformed", "hashes[1]"),
        ([b"\x00" * (wire.MAX_HEADER_BYTES + 1)], "oversized", "header"),
    ],
)
def test_bad_messages_are_refused_naming_the_field(parts: list[Any], reason: str,
                                                    names: str) -> None:
    with pytest.raises(WireError) as caught:
        wire.decode(parts)
    assert caught.value.reason == reason
    assert names in str(caught.value)


def test_oversized_pages_are_refused_before_their_size_is_checked() -> None:
    big = put_header(page_shape=[2, 4, 64 * 4])
    with pytest.raises(WireError) as caught:
        wire.decode(wire.frames(big, bytes(4 * PAGE)), max_page_bytes=PAGE)
    assert caught.value.reason == "oversized"
    # negative control: the same message under a limit it fits is accepted
    assert wire.decode(wire.frames(big, bytes(4 * PAGE)), max_page_bytes=4 * PAGE).payload


def test_page_size_follows_dtype_and_shape() -> None:
    assert wire.page_nbytes("bfloat16", [2, 16, 8, 64]) == 2 * 2 * 16 * 8 * 64
    assert LAYOUT.page_nbytes == PAGE == 1024

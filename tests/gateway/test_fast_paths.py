"""The gateway's per-chunk fast paths give what the general paths give: an engine chunk
decoded into typed structs is the Piece the JSON path makes (and a chunk the structs do not
fit falls back to it), and a text chunk written from the request's template is the bytes
of the chunk built and encoded whole."""

from __future__ import annotations

import json

import msgspec
import pytest

from lumend.gateway.render import Out, Renderer
from lumend.gateway.upstream import StreamBroken, _piece_of, _piece_of_json

CHUNKS = [
    {"id": "cmpl-1", "object": "text_completion", "created": 1, "model": "m",
     "choices": [{"index": 0, "text": " mot", "logprobs": None, "finish_reason": None,
                  "stop_reason": None, "prompt_token_ids": None, "token_ids": [12]}],
     "usage": None},
    {"choices": [{"index": 0, "delta": {"content": "é"}, "token_ids": [1, 2],
                  "finish_reason": "stop", "stop_reason": 7}], "prompt_token_ids": [5, 6]},
    {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}],
     "prompt_token_ids": [3]},
    {"choices": [{"text": None, "delta": {"content": "y"}}]},
    {"choices": [{"text": "a", "prompt_token_ids": None}], "prompt_token_ids": [1]},
    {"choices": [{"text": "b", "prompt_token_ids": [4]}]},
    {"choices": [{"text": "c", "logprobs": {"tokens": ["c"], "token_logprobs": [-0.5]}}]},
    {"choices": [], "prompt_token_ids": [1]},
    {"choices": [], "usage": {"prompt_tokens": 1}},
    {"choices": [{"text": 5}]},  # not a string: the structs do not fit, the JSON path reads it
    {"choices": [{"text": "d", "stop_reason": 1.5}]},
]


@pytest.mark.parametrize("chunk", CHUNKS, ids=range(len(CHUNKS)))
def test_a_typed_chunk_is_the_piece_of_its_json(chunk: dict[str, object]) -> None:
    data = msgspec.json.encode(chunk)
    assert _piece_of(data) == _piece_of_json(data)


@pytest.mark.parametrize("data", [b"[1]", b'{"error": {"message": "boom"}}', b"nope",
                                  b'{"error": "x", "choices": []}'])
def test_a_bad_chunk_breaks_the_stream_as_before(data: bytes) -> None:
    with pytest.raises(StreamBroken) as fast:
        _piece_of(data)
    with pytest.raises(StreamBroken) as general:
        _piece_of_json(data)
    assert str(fast.value) == str(general.value)


OUTS = [Out("東京"), Out("x", (1, 2)), Out("", (3,)), Out('q"\\\n', (4,)), Out("😀", (5,)),
        Out("z", (6,), [{"token": "z", "logprob": -1.0, "bytes": [122], "top_logprobs": []}]),
        Out("", (7,), finish_reason="length"), Out("end", (8,), finish_reason="stop",
                                                      stop_reason="end")]


@pytest.mark.parametrize("chat", [False, True], ids=["completion", "chat"])
@pytest.mark.parametrize("want_ids", [False, True], ids=["text", "ids"])
@pytest.mark.parametrize("logprobs", [False, True], ids=["plain", "logprobs"])
@pytest.mark.parametrize("echo", [None, "prompt "], ids=["no-echo", "echo"])
def test_template_events_are_the_encoded_chunks(chat: bool, want_ids: bool, logprobs: bool,
                                                echo: str | None) -> None:
    fast = Renderer("cmpl-ab\"c", 17, "model/ü", chat, want_ids, logprobs, echo)
    whole = Renderer("cmpl-ab\"c", 17, "model/ü", chat, want_ids, logprobs, echo)
    for out in OUTS:
        expected = [b"data: " + msgspec.json.encode(c) + b"\n\n"
                    for c in whole.chunks(out, [9, 10])]
        got = fast.events(out, [9, 10])
        assert got == expected, out
        for event in got:
            json.loads(event[6:])
    assert fast.text_offset == whole.text_offset

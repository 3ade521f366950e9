"""The gateway's request semantics: stop strings across pieces, the engine requests that
start and resume a request, and the fields refused up front (through a real gateway)."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import pytest

from lumenctl.localcluster import free_ports
from lumend.gateway.request import RequestError, parse_request
from lumend.gateway.server import Gateway
from lumend.gateway.stops import StopScan


def feed_all(scan: StopScan, pieces: list[str]) -> str:
    out = "".join(scan.feed(p) for p in pieces)
    return out + ("" if scan.matched else scan.flush())


@pytest.mark.parametrize("pieces", [["hello wor", "ld STOP here"], ["hello world S", "TOP"],
                                    ["hello world ST", "O", "P and more"], ["hello world STOP"]])
def test_a_stop_string_is_found_however_the_text_is_split(pieces: list[str]) -> None:
    scan = StopScan(("STOP",))
    assert feed_all(scan, pieces) == "hello world "
    assert scan.matched == "STOP"


def test_text_that_only_began_a_stop_string_is_released() -> None:
    scan = StopScan(("STOP",))
    assert feed_all(scan, ["a ST", "OR", "Y"]) == "a STORY"
    assert scan.matched is None
    scan = StopScan(("STOP",), include_stop=True)
    assert feed_all(scan, ["x", "STOP", "y"]) == "xSTOP"


def test_the_earliest_of_several_stop_strings_wins() -> None:
    scan = StopScan(("world", "lo"))
    assert feed_all(scan, ["hello world"]) == "hel"
    assert scan.matched == "lo"


def test_no_limit_is_sent_when_the_client_gave_none() -> None:
    """The engine's default applies: for chat the context left, which a resume (sent as a
    completion, whose default is 16) must then ask for; for completions vLLM's 16."""
    req = parse_request({"messages": [{"role": "user", "content": "hi"}]}, chat=True)
    assert "max_tokens" not in req.first_body()
    assert req.resume_body([1, 2, 3], produced=2, max_model_len=100)["max_tokens"] == 97
    completion = parse_request({"prompt": "hi"}, chat=False)
    assert completion.resume_body([1, 2, 3], produced=2)["max_tokens"] == 14
    limited = parse_request({"messages": [{"role": "user", "content": "hi"}],
                             "max_completion_tokens": 10, "stop": ["x"], "echo": True},
                            chat=True)
    assert limited.first_body()["max_tokens"] == 10
    resume = limited.resume_body([5, 6, 7, 8], produced=3)
    assert resume["max_tokens"] == 7 and resume["prompt"] == [5, 6, 7, 8]
    assert "stop" not in resume and "messages" not in resume  # stops are the gateway's


def test_sampling_parameters_are_sent_again_on_resume() -> None:
    body = {"prompt": "p", "max_tokens": 9, "temperature": 0.7, "top_p": 0.9, "seed": 3,
            "logprobs": 2, "min_tokens": 5}
    resume = parse_request(body, chat=False).resume_body([1, 2], produced=2)
    assert {k: resume[k] for k in ("temperature", "top_p", "seed", "logprobs")} == {
        "temperature": 0.7, "top_p": 0.9, "seed": 3, "logprobs": 2}
    assert resume["min_tokens"] == 3 and resume["max_tokens"] == 7


@pytest.mark.parametrize(("body", "param"), [
    ({"prompt": "p", "n": 2}, "n"), ({"prompt": "p", "best_of": 3}, "best_of"),
    ({"prompt": "p", "echo": True, "logprobs": 1}, "echo"),
    ({"prompt": "p", "max_tokens": 0}, "max_tokens"), ({"prompt": [1, 2]}, "prompt"),
    ({"prompt": "p", "stop": [""]}, "stop"),
])
def test_fields_without_resume_semantics_are_refused(body: dict[str, Any], param: str) -> None:
    with pytest.raises(RequestError) as caught:
        parse_request(body, chat=False)
    assert caught.value.param == param


def test_the_gateway_answers_refused_fields_with_a_400_naming_them() -> None:
    async def scenario() -> list[tuple[int, dict[str, Any]]]:
        gateway = Gateway(lambda: None)
        listen = f"127.0.0.1:{free_ports(1)[0]}"
        await gateway.start(listen)
        try:
            async with aiohttp.ClientSession() as session:
                out = []
                for path, body in (
                        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                                                  "tools": [{"type": "function"}]}),
                        ("/v1/completions", {"prompt": "x", "n": 3, "stream": True})):
                    async with session.post(f"http://{listen}{path}", json=body) as r:
                        out.append((r.status, await r.json()))
                return out
        finally:
            await gateway.stop()

    for status, doc in asyncio.run(scenario()):
        assert status == 400
        assert doc["error"]["param"] in ("tools", "n")
        assert doc["error"]["type"] == "invalid_request_error"

"""The sim engine speaks vLLM 0.32's OpenAI fields, over HTTP, from real engine processes:
token ids in and out (`return_token_ids`), the byte-level BPE-like tokenizer (characters
split over tokens, text held back, non-canonical ids), multi-token chunks, vLLM's limits
and error bodies, stop strings and tokens, echo, usage, logprobs and seeded sampling."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from lumenctl.localcluster import free_ports, stop_process
from lumend.checkpoint.holder import HolderConfig
from lumend.engine.sim_core import BLOCK_SIZE, TokenModel, block_hashes
from lumend.engine.sim_tokenizer import BpeVocabulary, decode, utf8_tail
from tests.checkpoint.conftest import RunningHolder

PROMPT = "stream résumé 你好 🚀 across failures"
BPE = TokenModel(BpeVocabulary())
BPE_MAX_MODEL_LEN = 256


@dataclass
class Engine:
    url: str
    proc: subprocess.Popen[bytes]

    def call(self, path: str, body: dict[str, Any] | None = None) -> tuple[int, Any]:
        data = json.dumps(body).encode() if body is not None else None
        request = urllib.request.Request(self.url + path, data=data,
                                         headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=60) as r:
                return r.status, json.load(r)
        except urllib.error.HTTPError as exc:
            return exc.code, json.loads(exc.read())

    def ok(self, path: str, body: dict[str, Any]) -> Any:
        status, reply = self.call(path, body)
        assert status == 200, reply
        return reply

    def stream(self, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
        """Every `data:` message of a streamed reply, [DONE] checked and dropped."""
        request = urllib.request.Request(self.url + path,
                                         data=json.dumps({**body, "stream": True}).encode(),
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=60) as r:
            lines = [raw.decode().strip() for raw in r]
        data = [line[6:] for line in lines if line.startswith("data: ")]
        assert data and data[-1] == "[DONE]", lines[-3:]
        return [json.loads(d) for d in data[:-1]]

    def tokens(self, text: str) -> list[int]:
        return list(self.ok("/tokenize", {"prompt": text})["tokens"])


def start_engine(tmp: Path, name: str, *args: str) -> Engine:
    port = free_ports(1)[0]
    with (tmp / f"{name}.log").open("ab") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "lumend.engine.sim_server", "--engine-id", name,
             "--port", str(port), "--time-scale", "0.05", *args],
            stdout=log, stderr=subprocess.STDOUT)
    return Engine(f"http://127.0.0.1:{port}", proc)


def wait_active(engine: Engine) -> None:
    deadline = time.monotonic() + 60
    while True:
        assert engine.proc.poll() is None, "the sim engine exited"
        try:
            with urllib.request.urlopen(engine.url + "/lumen/engine", timeout=2) as r:
                if json.load(r)["state"] == "active":
                    return
        except OSError:
            pass
        assert time.monotonic() < deadline, "the sim engine never became active"
        time.sleep(0.05)


@dataclass
class Engines:
    byte: Engine  # the default: one ASCII byte per token, one token per chunk
    bpe: Engine  # byte-level BPE-like, 1..4 tokens per chunk, a 256-token context
    eos: Engine  # byte-level BPE-like, EOS about once per 8 tokens


@pytest.fixture(scope="module")
def engines(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engines]:
    tmp = tmp_path_factory.mktemp("sim-openai")
    started = [start_engine(tmp, "byte"),
               start_engine(tmp, "bpe", "--tokenizer", "bpe", "--tokens-per-chunk", "4",
                            "--max-model-len", str(BPE_MAX_MODEL_LEN)),
               start_engine(tmp, "eos", "--tokenizer", "bpe", "--eos-every", "8")]
    try:
        for engine in started:
            wait_active(engine)
        yield Engines(*started)
    finally:
        for engine in started:
            stop_process(engine.proc)


def ids_of(chunks: list[dict[str, Any]]) -> list[int]:
    return [t for c in chunks for choice in c["choices"] for t in choice.get("token_ids") or []]


def text_of(chunks: list[dict[str, Any]], chat: bool = False) -> str:
    if chat:
        return "".join(c["choices"][0]["delta"].get("content", "") for c in chunks
                       if c["choices"])
    return "".join(c["choices"][0]["text"] for c in chunks if c["choices"])


# -- 1. token ids in and out --------------------------------------------------------------


def test_completions_return_token_ids_streamed_and_not(engines: Engines) -> None:
    e = engines.bpe
    prompt_ids = e.tokens(PROMPT)
    body = {"prompt": PROMPT, "max_tokens": 40, "return_token_ids": True}
    chunks = e.stream("/v1/completions", body)
    first, rest = chunks[0]["choices"][0], [c["choices"][0] for c in chunks[1:]]
    assert first["prompt_token_ids"] == prompt_ids
    assert all(c["prompt_token_ids"] is None for c in rest)
    assert all(c["token_ids"] for c in [first, *rest]), "every chunk names its tokens"
    whole = e.ok("/v1/completions", body)["choices"][0]
    assert whole["prompt_token_ids"] == prompt_ids
    assert ids_of(chunks) == whole["token_ids"] == BPE.reference(0, prompt_ids, 40)
    assert text_of(chunks) == whole["text"]

    # Without the flag vLLM sends the fields as null; so does the sim engine.
    plain = e.stream("/v1/completions", {"prompt": PROMPT, "max_tokens": 8})
    assert all(c["choices"][0]["token_ids"] is None
               and c["choices"][0]["prompt_token_ids"] is None for c in plain)
    assert e.ok("/v1/completions", {"prompt": PROMPT, "max_tokens": 8}
                )["choices"][0]["token_ids"] is None


def test_chat_return_token_ids_streamed_and_not(engines: Engines) -> None:
    e = engines.bpe
    messages = [{"role": "user", "content": PROMPT}]
    prompt_ids = e.ok("/tokenize", {"messages": messages})["tokens"]
    assert prompt_ids == e.tokens(f"user: {PROMPT}\nassistant: ")
    body = {"messages": messages, "max_tokens": 30, "return_token_ids": True}
    chunks = e.stream("/v1/chat/completions", body)
    role = chunks[0]
    assert role["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert role["prompt_token_ids"] == prompt_ids
    assert all("prompt_token_ids" not in c for c in chunks[1:])
    streamed = ids_of(chunks[1:])
    whole = e.ok("/v1/chat/completions", body)
    assert whole["prompt_token_ids"] == prompt_ids
    assert whole["choices"][0]["token_ids"] == streamed == BPE.reference(0, prompt_ids, 30)
    assert text_of(chunks, chat=True) == whole["choices"][0]["message"]["content"]
    plain = e.stream("/v1/chat/completions", {"messages": messages, "max_tokens": 4})
    assert plain[0]["prompt_token_ids"] is None
    assert all(c["choices"][0]["token_ids"] is None for c in plain[1:])


def test_a_token_id_prompt_continues_a_stream_exactly(engines: Engines) -> None:
    e = engines.bpe
    prompt_ids = e.tokens(PROMPT)
    full = e.ok("/v1/completions", {"prompt": PROMPT, "max_tokens": 60,
                                    "return_token_ids": True})["choices"][0]["token_ids"]
    resumed = e.ok("/v1/completions", {"prompt": prompt_ids + full[:25], "max_tokens": 35,
                                       "return_token_ids": True})["choices"][0]
    assert resumed["token_ids"] == full[25:]
    assert resumed["prompt_token_ids"] == prompt_ids + full[:25]


# -- 2. the byte-level tokenizer ----------------------------------------------------------


def test_bpe_text_is_multibyte_and_held_back_mid_character(engines: Engines) -> None:
    e = engines.eos  # one token per chunk: every split character shows
    chunks = e.stream("/v1/completions", {"prompt": PROMPT, "max_tokens": 200,
                                          "return_token_ids": True, "ignore_eos": True})
    ids = ids_of(chunks)
    text = text_of(chunks)
    empty = [c for c in chunks if not c["choices"][0]["text"]]
    assert len(empty) >= 10, "characters split over tokens hold their text back"
    assert all(c["choices"][0]["token_ids"] for c in empty)
    assert sum(ord(ch) > 0x7F for ch in text) > len(text) // 3, text
    assert any(len(ch.encode()) == 4 for ch in text), "emoji"
    assert any(len(ch.encode()) == 3 for ch in text), "CJK"
    # The text is the decoded ids, less an incomplete character at the very end.
    whole = decode(BPE.vocab, ids)
    cut = len(utf8_tail(b"".join(BPE.vocab.token_bytes(t) for t in ids)))
    assert text == (whole[:-1] if cut else whole)


def test_bpe_ids_are_not_the_encoding_of_their_text(engines: Engines) -> None:
    e = engines.bpe
    differ = 0
    for i in range(10):
        reply = e.ok("/v1/completions", {"prompt": f"{PROMPT} {i}", "max_tokens": 48,
                                         "return_token_ids": True})["choices"][0]
        differ += e.tokens(reply["text"]) != reply["token_ids"]
    assert differ >= 9, f"only {differ} of 10 outputs were non-canonical"


def test_resuming_from_text_diverges_where_resuming_from_ids_does_not(
        engines: Engines) -> None:
    e = engines.bpe
    prompt_ids = e.tokens(PROMPT)
    full = e.ok("/v1/completions", {"prompt": PROMPT, "max_tokens": 80,
                                    "return_token_ids": True})["choices"][0]
    k = next(i for i in range(30, 60) if not utf8_tail(
        b"".join(BPE.vocab.token_bytes(t) for t in full["token_ids"][:i])))
    sent = decode(BPE.vocab, full["token_ids"][:k])
    by_ids = e.ok("/v1/completions", {"prompt": prompt_ids + full["token_ids"][:k],
                                      "max_tokens": 80 - k})["choices"][0]["text"]
    by_text = e.ok("/v1/completions", {"prompt": PROMPT + sent,
                                       "max_tokens": 80 - k})["choices"][0]["text"]
    assert sent + by_ids == full["text"]
    assert sent + by_text != full["text"], "text re-encodes to other ids: it must diverge"


def test_ids_resumed_mid_character_re_emit_the_context_as_vllm_does(engines: Engines) -> None:
    # tokenizers' DecodeStream, primed with ids that end inside a character, returns the
    # whole decoded context with the first complete character (vLLM passes it on).
    e = engines.eos
    prompt_ids = e.tokens(PROMPT)
    full = e.ok("/v1/completions", {"prompt": PROMPT, "max_tokens": 60, "ignore_eos": True,
                                    "return_token_ids": True})["choices"][0]["token_ids"]
    k = next(i for i in range(5, 60) if utf8_tail(
        b"".join(BPE.vocab.token_bytes(t) for t in full[:i])))
    chunks = e.stream("/v1/completions", {"prompt": prompt_ids + full[:k], "max_tokens": 8,
                                          "ignore_eos": True})
    first_text = next(c["choices"][0]["text"] for c in chunks if c["choices"][0]["text"])
    assert first_text.startswith(PROMPT + decode(BPE.vocab, full[:k])[:-1])
    # Negative control: at a character boundary only the new text comes.
    j = max(i for i in range(1, k) if not utf8_tail(
        b"".join(BPE.vocab.token_bytes(t) for t in full[:i])))
    clean = e.stream("/v1/completions", {"prompt": prompt_ids + full[:j], "max_tokens": 8,
                                         "ignore_eos": True})
    assert not text_of(clean).startswith(PROMPT)


# -- 3. multi-token chunks ----------------------------------------------------------------


def test_chunks_carry_one_to_k_tokens(engines: Engines) -> None:
    chunks = engines.bpe.stream("/v1/completions", {"prompt": PROMPT, "max_tokens": 100,
                                                    "return_token_ids": True})
    sizes = [len(c["choices"][0]["token_ids"]) for c in chunks]
    assert sum(sizes) == 100 and max(sizes) <= 4 and min(sizes) >= 1
    assert len(set(sizes)) > 1, sizes
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])
    # Negative control: the default engine streams one token per chunk.
    single = engines.byte.stream("/v1/completions", {"prompt": PROMPT, "max_tokens": 20,
                                                     "return_token_ids": True})
    assert [len(c["choices"][0]["token_ids"]) for c in single] == [1] * 20


# -- 4. limits and errors -----------------------------------------------------------------


def test_default_limits_follow_vllm(engines: Engines) -> None:
    e = engines.bpe
    models = e.call("/v1/models")[1]
    assert models["data"][0]["max_model_len"] == BPE_MAX_MODEL_LEN
    # /v1/completions defaults to 16 tokens; chat to the rest of the context.
    plain = e.ok("/v1/completions", {"prompt": PROMPT})
    assert plain["usage"]["completion_tokens"] == 16
    messages = [{"role": "user", "content": PROMPT}]
    chat = e.ok("/v1/chat/completions", {"messages": messages, "return_token_ids": True})
    prompt_len = len(chat["prompt_token_ids"])
    assert chat["usage"]["completion_tokens"] == BPE_MAX_MODEL_LEN - prompt_len
    assert chat["choices"][0]["finish_reason"] == "length"
    capped = e.ok("/v1/chat/completions", {"messages": messages, "max_tokens": 50,
                                           "max_completion_tokens": 7})
    assert capped["usage"]["completion_tokens"] == 7
    # prompt + max_tokens past the context: cut to what fits, as vLLM does.
    over = e.ok("/v1/completions", {"prompt": PROMPT, "max_tokens": BPE_MAX_MODEL_LEN - 1})
    assert over["usage"]["total_tokens"] == BPE_MAX_MODEL_LEN
    assert engines.byte.call("/v1/models")[1]["data"][0]["max_model_len"] == 131072


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/v1/completions", {"prompt": "x", "max_tokens": 300}, "max_tokens"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "max_completion_tokens": 257}, "max_completion_tokens"),
    ("/v1/completions", {"prompt": list(range(300))}, "input_tokens"),
    ("/v1/completions", {"prompt": "ab" * 300}, "input_tokens"),
    ("/v1/completions", {"prompt": "ab" * 1000}, "input_text"),
    ("/v1/completions", {"prompt": [65] * BPE_MAX_MODEL_LEN}, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ("/v1/completions", {"prompt": [100000]}, "prompt"),
    ("/v1/completions", {"prompt": "x", "logprobs": 21}, "logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "top_logprobs": 2}, "top_logprobs"),
    ("/v1/completions", {"prompt": "x", "n": 2}, "n"),
])
def test_bad_requests_get_vllms_400_before_any_stream(
        engines: Engines, path: str, body: dict[str, Any], param: str) -> None:
    for stream in (False, True):
        status, reply = engines.bpe.call(path, {**body, "stream": stream})
        assert status == 400, reply
        assert set(reply) == {"error"}
        error = reply["error"]
        assert error["type"] == "BadRequestError" and error["code"] == 400
        assert error["param"] == param and error["message"], error


def test_context_error_messages_are_vllms(engines: Engines) -> None:
    _, reply = engines.bpe.call("/v1/completions", {"prompt": list(range(300))})
    assert reply["error"]["message"] == (
        "This model's maximum context length is 256 tokens. However, your prompt contains "
        "300 input tokens, which exceeds this limit even without any output tokens. Please "
        "reduce the length of the input prompt. (parameter=input_tokens, value=300)")
    _, reply = engines.bpe.call("/v1/completions", {"prompt": "x", "max_tokens": 300})
    assert reply["error"]["message"] == (
        "max_tokens=300 cannot be greater than max_model_len=256. Please request fewer "
        "output tokens. (parameter=max_tokens, value=300)")


# -- 5. finish reasons --------------------------------------------------------------------


def test_a_stop_string_ends_the_text_before_it(engines: Engines) -> None:
    e = engines.bpe
    full = e.ok("/v1/completions", {"prompt": PROMPT, "max_tokens": 80})["choices"][0]["text"]
    stop = full[30:32]
    expected = full[:full.find(stop)]
    chunks = e.stream("/v1/completions", {"prompt": PROMPT, "max_tokens": 80,
                                          "stop": ["never-there", stop],
                                          "return_token_ids": True})
    last = chunks[-1]["choices"][0]
    assert text_of(chunks) == expected
    assert (last["finish_reason"], last["stop_reason"]) == ("stop", stop)
    assert len(ids_of(chunks)) < 80
    whole = e.ok("/v1/chat/completions", {"messages": [{"role": "user", "content": "q"}],
                                          "max_tokens": 80})
    text = whole["choices"][0]["message"]["content"]
    stopped = e.ok("/v1/chat/completions", {"messages": [{"role": "user", "content": "q"}],
                                            "max_tokens": 80, "stop": text[20:22]})
    assert stopped["choices"][0]["message"]["content"] == text[:text.find(text[20:22])]
    assert stopped["choices"][0]["finish_reason"] == "stop"


def test_stop_token_ids_and_eos(engines: Engines) -> None:
    e = engines.bpe
    ids = e.ok("/v1/completions", {"prompt": PROMPT, "max_tokens": 30,
                                   "return_token_ids": True})["choices"][0]["token_ids"]
    stop_id = ids[12]
    chunks = e.stream("/v1/completions", {"prompt": PROMPT, "max_tokens": 30,
                                          "stop_token_ids": [stop_id],
                                          "return_token_ids": True})
    last = chunks[-1]["choices"][0]
    assert ids_of(chunks) == ids[:ids.index(stop_id) + 1], "the stop token is reported"
    assert (last["finish_reason"], last["stop_reason"]) == ("stop", stop_id)

    eos = engines.eos
    ended = eos.ok("/v1/completions", {"prompt": PROMPT, "max_tokens": 400,
                                       "return_token_ids": True})
    choice = ended["choices"][0]
    assert choice["token_ids"][-1] == BPE.vocab.eos_id
    assert (choice["finish_reason"], choice["stop_reason"]) == ("stop", None)
    assert ended["usage"]["completion_tokens"] == len(choice["token_ids"]) < 400
    # Negative control: ignore_eos runs to max_tokens through the same first tokens.
    ignored = eos.ok("/v1/completions", {"prompt": PROMPT, "max_tokens": 400,
                                         "return_token_ids": True, "ignore_eos": True})
    assert ignored["choices"][0]["finish_reason"] == "length"
    assert ignored["choices"][0]["token_ids"][:len(choice["token_ids"]) - 1] == \
        choice["token_ids"][:-1]


# -- 6. echo ------------------------------------------------------------------------------


def test_echo(engines: Engines) -> None:
    e = engines.bpe
    plain = e.ok("/v1/completions", {"prompt": PROMPT, "max_tokens": 12})["choices"][0]
    echoed = e.ok("/v1/completions", {"prompt": PROMPT, "max_tokens": 12, "echo": True})
    assert echoed["choices"][0]["text"] == PROMPT + plain["text"]
    chunks = e.stream("/v1/completions", {"prompt": PROMPT, "max_tokens": 12, "echo": True})
    assert chunks[0]["choices"][0]["text"].startswith(PROMPT)
    assert chunks[0]["choices"][0]["prompt_token_ids"] == e.tokens(PROMPT)
    assert text_of(chunks) == PROMPT + plain["text"]
    # With return_token_ids vLLM leaves the prompt text out.
    ids = e.stream("/v1/completions", {"prompt": PROMPT, "max_tokens": 12, "echo": True,
                                       "return_token_ids": True})
    assert text_of(ids) == plain["text"]
    messages = [{"role": "user", "content": "go on"},
                {"role": "assistant", "content": "Once upon"}]
    chat = e.stream("/v1/chat/completions", {"messages": messages, "max_tokens": 5,
                                             "echo": True})
    assert chat[1]["choices"][0]["delta"] == {"content": "Once upon"}
    assert "token_ids" not in chat[1]["choices"][0]


# -- 7. usage -----------------------------------------------------------------------------


def test_usage(engines: Engines) -> None:
    e = engines.bpe
    for path, body in (("/v1/completions", {"prompt": PROMPT}),
                       ("/v1/chat/completions",
                        {"messages": [{"role": "user", "content": PROMPT}]})):
        chunks = e.stream(path, {**body, "max_tokens": 21, "return_token_ids": True,
                                 "stream_options": {"include_usage": True}})
        final = chunks[-1]
        prompt_ids = (chunks[0]["choices"][0]["prompt_token_ids"] if "prompt" in body
                      else chunks[0]["prompt_token_ids"])
        assert final["choices"] == []
        assert final["usage"] == {"prompt_tokens": len(prompt_ids), "completion_tokens": 21,
                                  "total_tokens": len(prompt_ids) + 21}
        assert len(ids_of(chunks[:-1])) == 21
        assert "system_fingerprint" not in chunks[-2], "the usage chunk is the last message"
        plain = e.stream(path, {**body, "max_tokens": 5})
        assert all(c["choices"] and "usage" not in c for c in plain)
        assert e.ok(path, {**body, "max_tokens": 5})["usage"]["completion_tokens"] == 5


# -- 8. logprobs --------------------------------------------------------------------------


def test_completion_logprobs_are_deterministic_and_continue_on_resume(
        engines: Engines) -> None:
    e = engines.bpe
    body = {"prompt": PROMPT, "max_tokens": 40, "logprobs": 2, "return_token_ids": True}
    chunks = e.stream("/v1/completions", body)
    tokens, token_logprobs, offsets = [], [], []
    for c in chunks:
        lp = c["choices"][0]["logprobs"]
        assert len(lp["tokens"]) == len(c["choices"][0]["token_ids"])
        assert all(1 <= len(top) <= 3 for top in lp["top_logprobs"])
        tokens += lp["tokens"]
        token_logprobs += lp["token_logprobs"]
        offsets += lp["text_offset"]
    assert offsets == [sum(len(t) for t in tokens[:i]) for i in range(len(tokens))]
    assert all(isinstance(v, float) and v < 0 for v in token_logprobs)
    whole = e.ok("/v1/completions", body)["choices"][0]
    assert whole["logprobs"]["token_logprobs"] == token_logprobs
    ids = whole["token_ids"]
    resumed = e.ok("/v1/completions", {**body, "prompt": e.tokens(PROMPT) + ids[:15],
                                       "max_tokens": 25})["choices"][0]
    assert resumed["logprobs"]["token_logprobs"] == token_logprobs[15:]
    echoed = e.ok("/v1/completions", {**body, "echo": True})["choices"][0]
    n_prompt = len(e.tokens(PROMPT))
    assert echoed["logprobs"]["token_logprobs"][0] is None
    assert len(echoed["logprobs"]["tokens"]) == n_prompt + 40
    assert echoed["prompt_logprobs"][0] is None and len(echoed["prompt_logprobs"]) == n_prompt


def test_chat_logprobs(engines: Engines) -> None:
    e = engines.bpe
    body = {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": 12,
            "logprobs": True, "top_logprobs": 3}
    whole = e.ok("/v1/chat/completions", body)["choices"][0]["logprobs"]["content"]
    assert len(whole) == 12
    for entry in whole:
        assert set(entry) == {"token", "logprob", "bytes", "top_logprobs"}
        assert entry["bytes"] == list(entry["token"].encode())
        assert len(entry["top_logprobs"]) == 3
        assert entry["top_logprobs"][0]["logprob"] == entry["logprob"]  # the chosen first
    chunks = e.stream("/v1/chat/completions", body)
    streamed = [x for c in chunks[1:] for x in c["choices"][0]["logprobs"]["content"]]
    assert streamed == whole
    assert chunks[0]["choices"][0]["logprobs"] is None


# -- 9. sampling --------------------------------------------------------------------------


def test_sampling_is_seeded_or_fresh(engines: Engines) -> None:
    e = engines.bpe
    body = {"prompt": PROMPT, "max_tokens": 40, "temperature": 1.0,
            "return_token_ids": True}
    greedy = BPE.reference(0, e.tokens(PROMPT), 40)

    def ids(extra: dict[str, Any]) -> list[int]:
        return list(e.ok("/v1/completions", {**body, **extra})["choices"][0]["token_ids"])

    seeded = ids({"seed": 7})
    assert ids({"seed": 7}) == seeded
    assert ids({"seed": 8}) != seeded
    assert seeded != greedy
    assert ids({}) != ids({}), "unseeded sampling draws fresh randomness"
    assert ids({"temperature": 0}) == greedy


# -- the default vocabulary is what it was ------------------------------------------------


def test_byte_engine_keeps_one_byte_tokens(engines: Engines) -> None:
    from lumend.engine.sim_core import decode as byte_decode
    from lumend.engine.sim_core import encode, reference_completion

    e = engines.byte
    reply = e.ok("/v1/completions", {"prompt": PROMPT, "max_tokens": 50,
                                     "return_token_ids": True})["choices"][0]
    assert reply["prompt_token_ids"] == encode(PROMPT)
    assert reply["token_ids"] == reference_completion(0, encode(PROMPT), 50)
    assert reply["text"] == byte_decode(reply["token_ids"])
    assert e.tokens(reply["text"]) == reply["token_ids"]
    assert e.ok("/detokenize", {"tokens": reply["token_ids"]})["prompt"] == reply["text"]


# -- checkpoints by token ids --------------------------------------------------------------


@pytest.fixture
def holder() -> Iterator[RunningHolder]:
    running = RunningHolder(HolderConfig(listen="127.0.0.1:0", workers=("h0",),
                                         budget_bytes=64 << 20, policy="lru")).start()
    try:
        yield running
    finally:
        running.stop()


def metric(engine: Engine, name: str) -> float:
    with urllib.request.urlopen(engine.url + "/metrics", timeout=5) as r:
        for line in r.read().decode().splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
    raise KeyError(name)


def test_a_bpe_stream_resumed_by_ids_loads_its_checkpoint_and_by_text_would_not(
        engines: Engines, holder: RunningHolder, tmp_path: Path) -> None:
    def plan(mode: str) -> dict[str, Any]:
        return {"lumen": {"ckpt_id": "bpe-1", "holder": holder.endpoint, "worker": "h0",
                          "mode": mode}}

    b = engines.bpe
    prompt_ids = b.tokens(PROMPT)
    reference = BPE.reference(0, prompt_ids, 120)
    a = start_engine(tmp_path, "a", "--tokenizer", "bpe", "--tokens-per-chunk", "4",
                     "--max-model-len", str(BPE_MAX_MODEL_LEN), "--time-scale", "1.0")
    try:
        wait_active(a)
        body = {"prompt": PROMPT, "max_tokens": 120, "stream": True,
                "return_token_ids": True, "kv_transfer_params": plan("save")}
        request = urllib.request.Request(a.url + "/v1/completions",
                                         data=json.dumps(body).encode())
        received: list[int] = []
        with urllib.request.urlopen(request, timeout=60) as response:
            for raw in response:
                line = raw.decode().strip()
                if line.startswith("data: {"):
                    received += json.loads(line[6:])["choices"][0]["token_ids"]
                if len(received) >= 60:
                    a.proc.kill()
                    break
        a.proc.wait(timeout=10)
    finally:
        stop_process(a.proc)
    assert received == reference[:len(received)]

    # By text: the prompt re-encodes to other ids, so the chained block hashes part from
    # the checkpoint's soon after the generated text starts: those would be recomputed.
    by_text = block_hashes(0, b.tokens(PROMPT + decode(BPE.vocab, received)))
    by_ids = block_hashes(0, prompt_ids + received)
    common = next(i for i, (x, y) in enumerate(zip(by_text, by_ids, strict=False)) if x != y)
    assert common < len(by_ids) - 2, (common, len(by_ids))

    # By ids: the blocks are found, loaded, and the stream continues token for token.
    restored = metric(b, "lumen_sim_restored_tokens_total")
    left = 120 - len(received)
    reply = b.ok("/v1/completions", {"prompt": prompt_ids + received, "max_tokens": left,
                                     "return_token_ids": True,
                                     "kv_transfer_params": plan("resume")})
    assert received + reply["choices"][0]["token_ids"] == reference
    assert metric(b, "lumen_sim_restored_tokens_total") - restored >= 2 * BLOCK_SIZE


def test_block_hashes_take_ids_past_a_byte() -> None:
    ids = BPE.vocab.encode("你好 " * 40)
    assert max(ids) > 255
    hashes = block_hashes(0, ids)
    assert len(hashes) == len(ids) // BLOCK_SIZE
    assert block_hashes(0, ids[:BLOCK_SIZE * 2]) == hashes[:2]
    assert block_hashes(0, [ids[0] + 1, *ids[1:]])[1] != hashes[1], "chained"


@pytest.mark.parametrize(("env", "args", "named"), [
    ({"LUMEN_SIM_TOKENIZER": "wordpiece"}, [], "LUMEN_SIM_TOKENIZER"),
    ({}, ["--tokens-per-chunk", "0"], "LUMEN_SIM_TOKENS_PER_CHUNK"),
    ({}, ["--max-model-len", "1"], "LUMEN_SIM_MAX_MODEL_LEN"),
])
def test_bad_model_options_are_refused_by_name(env: dict[str, str], args: list[str],
                                               named: str) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "lumend.engine.sim_server", "--engine-id", "x", "--port", "1",
         *args], env={**os.environ, **env}, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and named in done.stderr, done.stderr


def test_continuous_usage_and_a_stop_string_kept_in_the_output(engines: Engines) -> None:
    e = engines.bpe
    chunks = e.stream("/v1/completions", {
        "prompt": PROMPT, "max_tokens": 30, "return_token_ids": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True}})
    counted = 0
    for chunk in chunks[:-1]:
        counted += len(chunk["choices"][0]["token_ids"])
        assert chunk["usage"]["completion_tokens"] == counted
    assert chunks[-1]["usage"]["completion_tokens"] == counted == 30

    full = e.ok("/v1/completions", {"prompt": PROMPT, "max_tokens": 80})["choices"][0]["text"]
    stop = full[25:27]
    kept = e.ok("/v1/completions", {"prompt": PROMPT, "max_tokens": 80, "stop": stop,
                                    "include_stop_str_in_output": True})["choices"][0]
    assert kept["text"] == full[:full.find(stop) + len(stop)]
    assert kept["stop_reason"] == stop


# -- served model names -------------------------------------------------------------------


def not_found(model: str, served: str) -> dict[str, Any]:
    """vLLM 0.32's body for a model it does not serve."""
    return {"error": {"message": f"The model `{model}` does not exist. Valid aliases: "
                      f"{served}.", "type": "NotFoundError", "param": "model", "code": 404}}


def test_a_request_for_a_model_the_engine_does_not_serve_is_vllms_404(
        engines: Engines) -> None:
    e = engines.byte
    assert e.ok("/v1/completions", {"prompt": "x", "model": "sim-small"})["model"] == "sim-small"
    e.ok("/v1/completions", {"prompt": "x"})  # no model: served, as by vLLM
    for path, body in (("/v1/completions", {"prompt": "x"}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]}),
                       ("/tokenize", {"prompt": "x"}), ("/detokenize", {"tokens": [65]})):
        for stream in (False, True) if path.startswith("/v1") else (False,):
            status, reply = e.call(path, {**body, "model": "gpt-9", "stream": stream})
            assert (status, reply) == (404, not_found("gpt-9", "sim-small")), path


def test_served_model_names_are_listed_answered_and_the_only_names_served(
        tmp_path: Path) -> None:
    e = start_engine(tmp_path, "named", "--served-model-name", "short", "alias")
    try:
        wait_active(e)
        _, models = e.call("/v1/models")
        assert [(m["id"], m["root"]) for m in models["data"]] == [
            ("short", "sim-small"), ("alias", "sim-small")]
        for name in ("short", "alias", None):
            body = {"prompt": "x", "max_tokens": 3} | ({} if name is None else {"model": name})
            assert e.ok("/v1/completions", body)["model"] == "short"  # vLLM: the first name
            chunks = e.stream("/v1/completions", body)
            assert {c["model"] for c in chunks} == {"short"}
        # The model the engine loads is not a name it serves, as with vLLM.
        status, reply = e.call("/v1/completions", {"prompt": "x", "model": "sim-small"})
        assert (status, reply) == (404, not_found("sim-small", "short, alias"))
        with urllib.request.urlopen(e.url + "/metrics", timeout=10) as r:
            assert 'vllm:num_requests_running{model_name="short"}' in r.read().decode()
    finally:
        stop_process(e.proc)

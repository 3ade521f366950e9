"""A client's completion request as the gateway understands it, and the engine requests that
serve it: the first one, and the one that resumes it by token ids after a failure.

Resume semantics per field (docs/operator-guide.md section 15 says the same for operators):
- progress is counted in token ids (`return_token_ids`, asked of every engine), never in
  chunks or characters; a resume is `/v1/completions` with the prompt's ids plus the ids
  generated so far, for chat requests too (the chat template was applied once, by the engine
  that started the request);
- `max_tokens` / `max_completion_tokens`: the engine is asked for the limit minus the tokens
  produced; without a limit none is sent to the engine that starts the request (its own
  default applies, as without LUMEN: vLLM's is 16 tokens for completions, the context left
  for chat), and a resume asks for what is left of that default;
- sampling parameters are sent again unchanged: greedy requests continue token-identical; a
  seeded request restarts its seeded generator at the break, so its continuation is a valid
  sample but not the one an unbroken run would have drawn; so is an unseeded sampled request.
  A resume continues after every id received, those of a character still incomplete at
  the break included (the gateway renders that character's text, see `PendingText`);
- `stop` strings are matched by the gateway on the joined text (the engine never sees them),
  so a stop string spanning the break is found; nothing past it is sent; the ids end where
  vLLM's would, at the token that emits the stop's last character;
- `echo` is done by the gateway (the prompt once, first); `logprobs` / `top_logprobs`
  continue; `stream_options.include_usage`: one usage block for the whole request;
- `n` / `best_of` above 1, beam search, `tools` and `echo` with `logprobs` are refused up
  front (400 naming the field): they have no resume semantics here;
- `response_format` and guided decoding: the engine's grammar cannot start from a prefix, so
  such a request (and one with `presence_penalty` or `frequency_penalty`, which vLLM counts
  over the output only) is recomputed from its start after a failure and the gateway skips the ids
  the client already has, checking they are the same (greedy); when they differ (sampled) the
  stream ends with an error event rather than contradict what the client was sent.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


class RequestError(Exception):
    """A request the gateway refuses, with the OpenAI error's status, type and param."""

    def __init__(self, message: str, param: str | None, status: int = 400,
                 kind: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.param, self.status, self.kind = param, status, kind


# Fields a resume sends again as the client gave them (vLLM's sampling parameters).
_SAMPLING = ("model", "temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty",
             "frequency_penalty", "repetition_penalty", "stop_token_ids", "ignore_eos",
             "skip_special_tokens", "spaces_between_special_tokens", "logit_bias",
             "allowed_token_ids", "bad_words", "user", "priority", "length_penalty",
             "include_stop_str_in_output", "logprob_token_ids", "return_tokens_as_token_ids")
# Grammar-constrained decoding: a grammar cannot be continued from a prefix by the engine.
_GUIDED = ("response_format", "structured_outputs", "guided_json", "guided_regex",
           "guided_choice", "guided_grammar", "guided_whitespace_pattern")
# vLLM's CompletionRequest.max_tokens default (0.32, 0.33); chat's is the context left.
COMPLETION_DEFAULT_MAX_TOKENS = 16
_OUTPUT_PENALTIES = ("presence_penalty", "frequency_penalty")
# Fields the gateway handles itself, never passed upstream as given.
_OWN = ("stream", "stream_options", "stop", "echo", "n", "return_token_ids", "max_tokens",
        "max_completion_tokens", "min_tokens", "kv_transfer_params")


@dataclass(frozen=True)
class ClientRequest:
    body: dict[str, Any]
    chat: bool
    limit: int | None  # max_tokens / max_completion_tokens; None: the engine's default
    min_tokens: int
    stops: tuple[str, ...]
    include_stop: bool
    echo: bool
    stream: bool
    want_ids: bool  # the client asked for return_token_ids
    include_usage: bool
    logprobs: int | None  # top-k per token (0: only the chosen token's); None: not asked
    guided: bool  # recompute from the start after a failure (see the module docstring)

    @property
    def model(self) -> str | None:
        model = self.body.get("model")
        return model if isinstance(model, str) else None

    def prompt_chars(self) -> int:
        if self.chat:
            return sum(len(m["content"]) for m in self.body["messages"])
        return len(self.body["prompt"])

    def left(self, produced: int) -> int | None:
        return None if self.limit is None else self.limit - produced

    def first_body(self) -> dict[str, Any]:
        """The request as the engine that starts it gets it (also a guided restart)."""
        body = {k: v for k, v in self.body.items() if k not in _OWN}
        body.update(stream=True, return_token_ids=True)
        if self.limit is not None:
            body["max_tokens"] = self.limit
        if self.min_tokens:
            body["min_tokens"] = self.min_tokens
        if self.chat:
            body.pop("logprobs", None)
            body.pop("top_logprobs", None)
            if self.logprobs is not None:
                body.update(logprobs=True, top_logprobs=self.logprobs)
        elif self.logprobs is not None:
            body["logprobs"] = self.logprobs
        return body

    def resume_body(self, ids: list[int], produced: int,
                    max_model_len: int | None = None) -> dict[str, Any]:
        """`/v1/completions` continuing after `ids` (prompt ids + generated ids), of which
        `produced` were generated. A chat request without a limit had the context left as
        its limit: that needs the model's `max_model_len`."""
        body: dict[str, Any] = {k: self.body[k] for k in _SAMPLING if k in self.body}
        body.update(prompt=list(ids), stream=True, return_token_ids=True)
        left = self.left(produced)
        if left is None:
            assert max_model_len is not None, "a chat request without a limit needs it"
            left = max_model_len - len(ids)
        body["max_tokens"] = left
        if self.min_tokens > produced:
            body["min_tokens"] = self.min_tokens - produced
        if self.logprobs is not None:
            body["logprobs"] = self.logprobs
        return body


def parse_request(body: Any, chat: bool) -> ClientRequest:
    if not isinstance(body, dict):
        raise RequestError("the body must be a JSON object", None)
    if chat:
        messages = body.get("messages")
        if (not isinstance(messages, list) or not messages or not all(
                isinstance(m, dict) and isinstance(m.get("role"), str)
                and isinstance(m.get("content"), str) for m in messages)):
            raise RequestError("messages must be a non-empty list of {role, content} strings",
                               "messages")
    else:
        prompt = body.get("prompt")
        if not isinstance(prompt, str) or not prompt:
            raise RequestError("prompt must be a non-empty string (send a token-id prompt to "
                               "an engine directly; the gateway needs the text to echo and "
                               "route it)", "prompt")
    limit = _limit(body, chat)
    if limit is None and not chat:
        limit = COMPLETION_DEFAULT_MAX_TOKENS  # what the engine applies (vLLM's default)
    min_tokens = _count(body, "min_tokens", 0)
    if body.get("n", 1) not in (1, None):
        raise RequestError("n must be 1: several choices per request cannot be resumed "
                           "through the gateway; send n requests", "n")
    if body.get("best_of", 1) not in (1, None):
        raise RequestError("best_of must be 1: its candidates cannot be resumed through the "
                           "gateway", "best_of")
    if body.get("use_beam_search"):
        raise RequestError("beam search cannot be resumed through the gateway",
                           "use_beam_search")
    if chat and body.get("tools"):
        raise RequestError("tools are not supported through LUMEN's gateway (tool calls "
                           "cannot be resumed yet); call the engine directly", "tools")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise RequestError("model must be a string", "model")
    stops = _stops(body.get("stop"))
    echo = bool(body.get("echo")) and not chat
    logprobs = _logprobs(body, chat)
    if echo and logprobs is not None:
        raise RequestError("echo with logprobs is not supported through the gateway (prompt "
                           "logprobs); ask for one of them", "echo")
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise RequestError("stream_options must be an object", "stream_options")
    return ClientRequest(
        body=body, chat=chat, limit=limit, min_tokens=min_tokens, stops=stops,
        include_stop=bool(body.get("include_stop_str_in_output")), echo=echo,
        stream=bool(body.get("stream")), want_ids=bool(body.get("return_token_ids")),
        include_usage=bool(options and options.get("include_usage")) and bool(
            body.get("stream")),
        logprobs=logprobs, guided=any(body.get(k) not in (None, {"type": "text"})
                                      for k in _GUIDED)
        # vLLM counts these penalties over the output only: after a break the tokens before
        # it would be prompt, so the request is recomputed from its start instead.
        or any(body.get(k) not in (None, 0, 0.0) for k in _OUTPUT_PENALTIES))


def _count(body: dict[str, Any], key: str, default: int) -> int:
    value = body.get(key, default)
    if value is None:
        return default
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise RequestError(f"{key} must be a non-negative integer", key)
    return value


def _limit(body: dict[str, Any], chat: bool) -> int | None:
    keys = ("max_completion_tokens", "max_tokens") if chat else ("max_tokens",)
    for key in keys:
        value = body.get(key)
        if value is None:
            continue
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise RequestError(f"{key} must be a positive integer", key)
        return value
    return None


def _stops(stop: Any) -> tuple[str, ...]:
    if stop is None:
        return ()
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise RequestError("stop must be a non-empty string or a list of them", "stop")
    return tuple(stop)


def _logprobs(body: dict[str, Any], chat: bool) -> int | None:
    if chat:
        if not body.get("logprobs"):
            return None
        return _count(body, "top_logprobs", 0)
    value = body.get("logprobs")
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise RequestError("logprobs must be a non-negative integer", "logprobs")
    return value

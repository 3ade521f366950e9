"""The sim engine's OpenAI request fields, checked and resolved the way vLLM 0.32 does.

`parse` turns a /v1/completions or /v1/chat/completions body into a `Generation` (token
ids, limits, sampling, what to return) or raises `BadRequest`, whose body is vLLM's error
shape. The rules that matter to a caller, as vLLM has them:

- `max_tokens` absent: 16 on /v1/completions, `max_model_len - prompt` on chat (where
  `max_completion_tokens` wins over `max_tokens`); a limit above `max_model_len` is a 400;
  prompt + limit beyond the context is cut to what fits (finish_reason "length"); a prompt
  filling the whole context is a 400 ("max_tokens must be at least 1, got 0").
- `temperature` absent is greedy here (vLLM's default is 1.0: send 0 to vLLM for greedy).
- `model` naming none of the served names is a 404 (`unknown_model`); absent, it is served.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

from lumend.engine.sim_checkpoint import CheckpointPlan, parse_plan
from lumend.engine.sim_core import Sampling
from lumend.engine.sim_tokenizer import Vocabulary, decode

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # vLLM's CompletionRequest default
MAX_LOGPROBS = 20  # vLLM's default --max-logprobs


class BadRequest(Exception):
    def __init__(self, message: str, param: str | None = None, value: Any = None) -> None:
        extras = []
        if param is not None:
            extras.append(f"parameter={param}")
        if value is not None:
            extras.append(f"value={value}")
        super().__init__(f"{message} ({', '.join(extras)})" if extras else message)
        self.param = param

    def body(self) -> dict[str, Any]:
        return {"error": {"message": str(self), "type": "BadRequestError",
                          "param": self.param, "code": 400}}


def unknown_model(body: Any, served: tuple[str, ...]) -> dict[str, Any] | None:
    """vLLM's 404 body for a request whose `model` is none of the engine's served names
    (--served-model-name, else the model), or None: it is one of them, or the request
    names none (vLLM serves that too)."""
    model = body.get("model") if isinstance(body, dict) else None
    if model is None or model == "" or model in served:
        return None
    return {"error": {"message": f"The model `{model}` does not exist. Valid aliases: "
                      f"{', '.join(served)}.", "type": "NotFoundError", "param": "model",
                      "code": 404}}


@dataclass
class Generation:
    chat: bool
    prompt: list[int]
    prompt_text: str  # the prompt as text (echo on completions; rendered chat prompt)
    max_tokens: int
    sampling: Sampling
    stream: bool = False
    echo: bool = False
    echo_text: str = ""  # chat: the last assistant message, echoed
    return_token_ids: bool = False
    include_usage: bool = False
    continuous_usage: bool = False
    logprobs: int | None = None
    stop: list[str] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    plan: CheckpointPlan | None = None


def parse(body: Any, chat: bool, vocab: Vocabulary, max_model_len: int) -> Generation:
    if not isinstance(body, dict):
        raise BadRequest("the body must be a JSON object")
    if _int(body, "n", 1) != 1:
        raise BadRequest("the sim engine serves n=1 only", "n")
    if body.get("best_of") not in (None, 1):
        raise BadRequest("the sim engine serves best_of=1 only", "best_of")
    limit_name, limit = _limit(body, chat)
    if limit is not None and limit > max_model_len:
        raise BadRequest(f"{limit_name}={limit} cannot be greater than max_model_len="
                         f"{max_model_len}. Please request fewer output tokens.",
                         limit_name, limit)
    echo_text = ""
    if chat:
        prompt_text, echo_text = _chat_prompt(body)
        prompt = _encode_checked(vocab, prompt_text, max_model_len)
    else:
        raw = body.get("prompt")
        if isinstance(raw, list) and len(raw) == 1 and isinstance(raw[0], (str, list)):
            raw = raw[0]  # a batch of one
        if isinstance(raw, str) and raw:
            prompt_text = raw
            prompt = _encode_checked(vocab, raw, max_model_len)
        elif (isinstance(raw, list) and raw
              and all(isinstance(t, int) and not isinstance(t, bool) for t in raw)):
            prompt = list(raw)
            bad = [t for t in prompt if not 0 <= t < vocab.size]
            if bad:
                raise BadRequest(f"token id(s) {bad[:8]} are outside the vocabulary "
                                 f"(0..{vocab.size - 1})", "prompt")
            _check_prompt_tokens(len(prompt), max_model_len)
            prompt_text = decode(vocab, prompt)
        else:
            raise BadRequest("prompt must be a non-empty string, or a non-empty list of "
                             "token ids", "prompt")
    if limit is None and not chat:
        limit = COMPLETIONS_DEFAULT_MAX_TOKENS
    max_tokens = min(v for v in (max_model_len - len(prompt), limit) if v is not None)
    if max_tokens < 1:
        raise BadRequest(f"max_tokens must be at least 1, got {max_tokens}.", "max_tokens",
                         max_tokens)
    stream_options = body.get("stream_options") or {}
    if not isinstance(stream_options, dict):
        raise BadRequest("stream_options must be an object", "stream_options")
    stream = bool(body.get("stream"))
    try:
        plan = parse_plan(body.get("kv_transfer_params"))
    except ValueError as exc:
        raise BadRequest(str(exc), "kv_transfer_params") from None
    logprobs = _logprobs(body, chat)
    return Generation(
        chat=chat, prompt=prompt, prompt_text=prompt_text, max_tokens=max_tokens,
        sampling=_sampling(body, logprobs), stream=stream,
        echo=bool(body.get("echo")), echo_text=echo_text,
        return_token_ids=bool(body.get("return_token_ids")),
        include_usage=stream and bool(stream_options.get("include_usage")),
        continuous_usage=stream and bool(stream_options.get("include_usage"))
        and bool(stream_options.get("continuous_usage_stats")),
        logprobs=logprobs, stop=_stop(body),
        include_stop_str_in_output=bool(body.get("include_stop_str_in_output")),
        plan=plan,
    )


def _int(body: dict[str, Any], name: str, default: int | None) -> int | None:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, int) or isinstance(value, bool):
        raise BadRequest(f"{name} must be an integer, got {value!r}", name)
    return value


def _limit(body: dict[str, Any], chat: bool) -> tuple[str, int | None]:
    if chat and body.get("max_completion_tokens") is not None:
        return "max_completion_tokens", _int(body, "max_completion_tokens", None)
    return "max_tokens", _int(body, "max_tokens", None)


def _content(message: Any, index: int) -> tuple[str, str]:
    if not isinstance(message, dict) or not isinstance(message.get("role"), str):
        raise BadRequest(f"messages[{index}] must be an object with a role", "messages")
    content = message.get("content") or ""
    if isinstance(content, list):  # content parts: the text ones, one a line (as vLLM)
        content = "\n".join(p.get("text", "") for p in content
                          if isinstance(p, dict) and p.get("type") == "text")
    if not isinstance(content, str):
        raise BadRequest(f"messages[{index}].content must be a string or text parts",
                         "messages")
    return message["role"], content


def _chat_prompt(body: dict[str, Any]) -> tuple[str, str]:
    """The sim's chat template: `role: content` lines, then `assistant: `. With
    `continue_final_message`, a final assistant message is continued instead (its text
    ends the prompt). Returns (prompt text, the last assistant message for echo)."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("messages must be a non-empty list", "messages")
    turns = [_content(m, i) for i, m in enumerate(messages)]
    role, content = turns[-1]
    echo_text = content if role == "assistant" else ""
    if body.get("continue_final_message") and role == "assistant":
        head = "".join(f"{r}: {c}\n" for r, c in turns[:-1])
        return head + "assistant: " + content, echo_text
    return "".join(f"{r}: {c}\n" for r, c in turns) + "assistant: ", echo_text


def _encode_checked(vocab: Vocabulary, text: str, max_model_len: int) -> list[int]:
    bound = max_model_len * vocab.max_chars_per_token
    if len(text) > bound:
        raise BadRequest(
            f"This model's maximum context length is {max_model_len} tokens. However, "
            f"your prompt contains {len(text)} characters (more than {bound} characters, "
            f"which is the upper bound for {max_model_len} input tokens). Please reduce "
            "the length of the input prompt.", "input_text", len(text))
    tokens = vocab.encode(text)
    # vLLM's tokenizer stops at max_model_len + 1 tokens: "at least" that many.
    _check_prompt_tokens(min(len(tokens), max_model_len + 1), max_model_len)
    return tokens


def _check_prompt_tokens(count: int, max_model_len: int) -> None:
    if count > max_model_len:
        qualifier = "at least " if count == max_model_len + 1 else ""
        raise BadRequest(
            f"This model's maximum context length is {max_model_len} tokens. However, "
            f"your prompt contains {qualifier}{count} input tokens, which exceeds this "
            "limit even without any output tokens. Please reduce the length of the input "
            "prompt.", "input_tokens", count)


def _logprobs(body: dict[str, Any], chat: bool) -> int | None:
    """Top-k asked for per generated token (0: only the chosen token's), or None."""
    if chat:
        top = _int(body, "top_logprobs", None)
        if top is not None and not body.get("logprobs"):
            raise BadRequest("when using `top_logprobs`, `logprobs` must be set to true.",
                             "top_logprobs")
        if not body.get("logprobs"):
            return None
        k = top or 0
    else:
        k_or_none = _int(body, "logprobs", None)
        if k_or_none is None:
            return None
        k = k_or_none
    if k < 0:
        raise BadRequest(f"logprobs must be 0 or more, got {k}", "logprobs")
    if k > MAX_LOGPROBS:
        raise BadRequest(f"Requested sample logprobs of {k}, which is greater than max "
                         f"allowed: {MAX_LOGPROBS}", "logprobs", k)
    return k


def _stop(body: dict[str, Any]) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise BadRequest("stop must be a string or a list of non-empty strings", "stop")
    return list(stop)


def _sampling(body: dict[str, Any], logprobs: int | None) -> Sampling:
    temperature = body.get("temperature")
    if temperature is None:
        temperature = 0.0
    if not isinstance(temperature, (int, float)) or isinstance(temperature, bool) \
            or temperature < 0:
        raise BadRequest(f"temperature must be a number >= 0, got {temperature!r}",
                         "temperature")
    seed = _int(body, "seed", None)
    stop_ids = body.get("stop_token_ids") or []
    if not isinstance(stop_ids, list) or not all(isinstance(t, int) for t in stop_ids):
        raise BadRequest("stop_token_ids must be a list of token ids", "stop_token_ids")
    return Sampling(
        temperature=float(temperature),
        # As vLLM: a seed seeds the request's own generator (a resumed request restarts
        # it); without one each request draws fresh randomness.
        rng=(random.Random(seed) if seed is not None else random.Random())
        if temperature > 0 else None,
        stop_token_ids=frozenset(stop_ids),
        ignore_eos=bool(body.get("ignore_eos")),
        logprobs=logprobs,
    )

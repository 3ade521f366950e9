"""The sim engine's OpenAI responses, field for field as vLLM 0.32 writes them.

Streaming chunks and whole responses for /v1/completions and /v1/chat/completions,
including vLLM's fields: `prompt_token_ids` / `token_ids` (`return_token_ids`; unset they
are present as null, as vLLM sends them), `stop_reason`, logprobs in both APIs' shapes, the
final usage chunk, `system_fingerprint` on the last message.

Completions with `echo`: the first chunk (or the text) starts with the prompt text, unless
`return_token_ids` is set (then vLLM leaves the prompt text out); `prompt_token_ids` comes
with the first chunk whenever `echo` is set. Chat with `echo`: a chunk with the final
assistant message's content follows the role chunk.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from lumend.engine.sim_core import TokenModel, advance, context_state
from lumend.engine.sim_openai import Generation
from lumend.engine.sim_tokenizer import FILLER_LOGPROB, Ranked, tail_after, token_text

Position = Ranked | None  # a position's distribution; None: the prompt's first token


def prompt_distributions(model: TokenModel, seed: int, prompt: Sequence[int]) -> list[Position]:
    """What the model gave each prompt token (echo with logprobs scores the prompt)."""
    out: list[Position] = [None]
    state, tail = context_state(seed, []), b""
    for i, token in enumerate(prompt):
        state, tail = advance(state, token), tail_after(model.vocab, tail, token)
        if i + 1 < len(prompt):
            out.append(model.ranked(state, tail))
    return out


class Responses:
    def __init__(self, gen: Generation, model: TokenModel, seed: int, model_name: str,
                 request_id: str) -> None:
        self.gen = gen
        self.model = model
        self.seed = seed
        self.name = model_name
        self.id = request_id
        self.created = int(time.time())
        self.fingerprint = f"lumen-sim-{model_name}"
        self.completion_tokens = 0
        self._first = True
        self._next_offset = 0

    # -- logprobs ------------------------------------------------------------------------

    def _entries(self, token: int, ranked: Ranked, k: int) -> list[tuple[int, float]]:
        """vLLM's per-position logprob dict: the chosen token first, then the top k."""
        top = list(zip(ranked.tokens, ranked.logprobs, strict=True))[:k]
        if k > len(top):
            filler = self.model.vocab.filler(0, [t for t, _ in top], k - len(top))
            top += [(t, FILLER_LOGPROB - i) for i, t in enumerate(filler)]
        entries = {token: ranked.logprob(token)}
        for t, lp in top:
            entries.setdefault(t, lp)
        return [(t, max(lp, -9999.0)) for t, lp in entries.items()]

    def completion_logprobs(self, tokens: Sequence[int], positions: Sequence[Position],
                            offset: int) -> dict[str, Any]:
        k = self.gen.logprobs or 0
        vocab = self.model.vocab
        out: dict[str, Any] = {"text_offset": [], "token_logprobs": [], "tokens": [],
                               "top_logprobs": []}
        for token, ranked in zip(tokens, positions, strict=True):
            text = token_text(vocab, token)
            out["text_offset"].append(offset)
            offset += len(text)
            out["tokens"].append(text)
            if ranked is None:
                out["token_logprobs"].append(None)
                out["top_logprobs"].append(None)
                continue
            entries = self._entries(token, ranked, k)
            out["token_logprobs"].append(entries[0][1])
            out["top_logprobs"].append({token_text(vocab, t): lp
                                        for i, (t, lp) in enumerate(entries) if i <= k})
        return out

    def chat_logprobs(self, tokens: Sequence[int], positions: Sequence[Position],
                      ) -> dict[str, Any]:
        k = self.gen.logprobs or 0
        vocab = self.model.vocab
        content = []
        for token, ranked in zip(tokens, positions, strict=True):
            assert ranked is not None
            entries = self._entries(token, ranked, k)
            text = token_text(vocab, token)
            content.append({
                "token": text, "logprob": entries[0][1], "bytes": list(text.encode()),
                "top_logprobs": [{"token": token_text(vocab, t), "logprob": lp,
                                  "bytes": list(token_text(vocab, t).encode())}
                                 for t, lp in entries[:k]],
            })
        return {"content": content}

    def prompt_logprobs(self, positions: Sequence[Position]) -> list[Any]:
        """The non-streamed `prompt_logprobs` field: {token id: {logprob, rank, decoded}}."""
        k = self.gen.logprobs or 0
        vocab = self.model.vocab
        out: list[Any] = []
        for token, ranked in zip(self.gen.prompt, positions, strict=True):
            if ranked is None:
                out.append(None)
                continue
            entries = self._entries(token, ranked, k)
            out.append({str(t): {"logprob": lp, "rank": _rank(ranked, t),
                                 "decoded_token": token_text(vocab, t)} for t, lp in entries})
        return out

    def _usage(self) -> dict[str, int]:
        prompt = len(self.gen.prompt)
        return {"prompt_tokens": prompt, "total_tokens": prompt + self.completion_tokens,
                "completion_tokens": self.completion_tokens}

    # -- streaming -----------------------------------------------------------------------

    def completion_chunk(self, tokens: list[int], positions: list[Position] | None,
                         text: str, finish: str | None, stop_reason: int | str | None,
                         ) -> dict[str, Any]:
        gen = self.gen
        first, self._first = self._first, False
        prompt_ids = None
        logprob_tokens, logprob_positions = tokens, positions
        offset = self._next_offset
        if first and gen.echo:
            text = ("" if gen.return_token_ids else gen.prompt_text) + text
            prompt_ids = gen.prompt
            if positions is not None:
                logprob_tokens = [*gen.prompt, *tokens]
                logprob_positions = [*prompt_distributions(self.model, self.seed,
                                                           gen.prompt), *positions]
        elif first and gen.return_token_ids:
            prompt_ids = gen.prompt
        logprobs = None
        if logprob_positions is not None:
            logprobs = self.completion_logprobs(logprob_tokens, logprob_positions, offset)
            if logprobs["tokens"]:
                self._next_offset = logprobs["text_offset"][-1] + len(logprobs["tokens"][-1])
        self.completion_tokens += len(tokens)
        chunk: dict[str, Any] = {
            "id": self.id, "object": "text_completion", "created": self.created,
            "model": self.name,
            "choices": [{"index": 0, "text": text, "logprobs": logprobs,
                         "finish_reason": finish, "stop_reason": stop_reason,
                         "prompt_token_ids": prompt_ids,
                         "token_ids": tokens if gen.return_token_ids else None}],
        }
        self._end_of_chunk(chunk, finish)
        return chunk

    def chat_opening(self) -> list[dict[str, Any]]:
        """The role chunk (with the prompt's ids when asked for) and the echo chunk."""
        gen = self.gen
        role: dict[str, Any] = {
            "id": self.id, "object": "chat.completion.chunk", "created": self.created,
            "model": self.name,
            "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                         "logprobs": None, "finish_reason": None}],
            "prompt_token_ids": gen.prompt if gen.return_token_ids else None,
            "prompt_text": None,
        }
        chunks = [role]
        if gen.echo and gen.echo_text:
            chunks.append({
                "id": self.id, "object": "chat.completion.chunk", "created": self.created,
                "model": self.name,
                "choices": [{"index": 0, "delta": {"content": gen.echo_text},
                             "logprobs": None, "finish_reason": None}],
            })
        if gen.continuous_usage:
            for chunk in chunks:
                chunk["usage"] = self._usage()
        return chunks

    def chat_chunk(self, tokens: list[int], positions: list[Position] | None, text: str,
                   finish: str | None, stop_reason: int | str | None) -> dict[str, Any]:
        self.completion_tokens += len(tokens)
        choice: dict[str, Any] = {
            "index": 0, "delta": {"content": text},
            "logprobs": None if positions is None else self.chat_logprobs(tokens, positions),
            "finish_reason": finish,
        }
        if finish is not None:
            choice["stop_reason"] = stop_reason
        choice["token_ids"] = tokens if self.gen.return_token_ids else None
        chunk: dict[str, Any] = {"id": self.id, "object": "chat.completion.chunk",
                                 "created": self.created, "model": self.name,
                                 "choices": [choice]}
        self._end_of_chunk(chunk, finish)
        return chunk

    def _end_of_chunk(self, chunk: dict[str, Any], finish: str | None) -> None:
        if finish is not None and not self.gen.include_usage:
            chunk["system_fingerprint"] = self.fingerprint
        if self.gen.continuous_usage:
            chunk["usage"] = self._usage()

    def usage_chunk(self) -> dict[str, Any]:
        return {"id": self.id,
                "object": "chat.completion.chunk" if self.gen.chat else "text_completion",
                "created": self.created, "model": self.name, "choices": [],
                "usage": self._usage(), "system_fingerprint": self.fingerprint}

    # -- whole responses -----------------------------------------------------------------

    def completion(self, tokens: list[int], positions: list[Position] | None, text: str,
                   finish: str | None, stop_reason: int | str | None) -> dict[str, Any]:
        gen = self.gen
        self.completion_tokens = len(tokens)
        logprobs = prompt_logprobs = None
        if gen.echo:
            text = ("" if gen.return_token_ids else gen.prompt_text) + text
        if positions is not None:
            if gen.echo:
                prompt_positions = prompt_distributions(self.model, self.seed, gen.prompt)
                logprobs = self.completion_logprobs([*gen.prompt, *tokens],
                                                    [*prompt_positions, *positions], 0)
                prompt_logprobs = self.prompt_logprobs(prompt_positions)
            else:
                logprobs = self.completion_logprobs(tokens, positions, 0)
        choice = {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish,
                  "stop_reason": stop_reason,
                  "token_ids": tokens if gen.return_token_ids else None,
                  "prompt_logprobs": prompt_logprobs,
                  "prompt_token_ids": gen.prompt if gen.return_token_ids else None,
                  "routed_experts": None}
        return {"id": self.id, "object": "text_completion", "created": self.created,
                "model": self.name, "choices": [choice], "service_tier": None,
                "system_fingerprint": self.fingerprint, "usage": self._full_usage(),
                "kv_transfer_params": None, "ec_transfer_params": None, "metrics": None}

    def chat(self, tokens: list[int], positions: list[Position] | None, text: str,
             finish: str | None, stop_reason: int | str | None) -> dict[str, Any]:
        gen = self.gen
        self.completion_tokens = len(tokens)
        content = (gen.echo_text + text) if gen.echo else text
        choice = {"index": 0,
                  "message": {"role": "assistant", "content": content, "refusal": None,
                              "annotations": None, "audio": None, "function_call": None,
                              "reasoning": None},
                  "logprobs": None if positions is None else self.chat_logprobs(tokens,
                                                                                 positions),
                  "finish_reason": finish, "stop_reason": stop_reason,
                  "token_ids": tokens if gen.return_token_ids else None,
                  "routed_experts": None}
        return {"id": self.id, "object": "chat.completion", "created": self.created,
                "model": self.name, "choices": [choice], "service_tier": None,
                "system_fingerprint": self.fingerprint, "usage": self._full_usage(),
                "prompt_logprobs": None,
                "prompt_token_ids": gen.prompt if gen.return_token_ids else None,
                "prompt_text": None, "kv_transfer_params": None, "ec_transfer_params": None,
                "metrics": None}

    def _full_usage(self) -> dict[str, Any]:
        return {**self._usage(), "prompt_tokens_details": None,
                "completion_tokens_details": None}


def _rank(ranked: Ranked, token: int) -> int:
    try:
        return ranked.tokens.index(token) + 1
    except ValueError:
        return len(ranked.tokens) + 1 + token  # outside the candidates: some lower rank

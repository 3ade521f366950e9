"""What the client receives: OpenAI chunks and responses for completions and chat, built
from what the engines streamed (first the client's own endpoint, after a resume always
`/v1/completions`), with token ids shown only to clients that asked for them."""

from __future__ import annotations

from typing import Any

import msgspec

_encode = msgspec.json.Encoder().encode


class Out(msgspec.Struct, frozen=True):
    """One step of the request's output, ready to send (a Struct: one is made per chunk)."""

    text: str
    token_ids: tuple[int, ...] = ()
    logprobs: list[dict[str, Any]] = []  # per token, chat shape
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    more: bool = False  # more output is ready behind this one: a writer may hold it for it


def token_logprobs(logprobs: dict[str, Any] | None, chat: bool) -> list[dict[str, Any]]:
    """An engine chunk's logprobs as one chat-shaped entry per token ({token, logprob,
    bytes, top_logprobs}), whichever endpoint produced them."""
    if not logprobs:
        return []
    if chat:
        return list(logprobs.get("content") or [])
    tokens = logprobs.get("tokens") or []
    values = logprobs.get("token_logprobs") or []
    tops = logprobs.get("top_logprobs") or [None] * len(tokens)
    entries = []
    for token, value, top in zip(tokens, values, tops, strict=False):
        entries.append({"token": token, "logprob": value, "bytes": list(token.encode()),
                        "top_logprobs": [{"token": t, "logprob": v, "bytes": list(t.encode())}
                                         for t, v in (top or {}).items()]})
    return entries


def completion_logprobs(entries: list[dict[str, Any]], text_offset: int,
                        texts: list[str] | None = None) -> dict[str, Any]:
    """Chat-shaped per-token entries as a completion's logprobs object; offsets count from
    the start of the client's text."""
    offsets = []
    at = text_offset
    for entry in entries:
        offsets.append(at)
        at += len(entry["token"])
    return {"tokens": [e["token"] for e in entries],
            "token_logprobs": [e["logprob"] for e in entries],
            "top_logprobs": [{t["token"]: t["logprob"] for t in e.get("top_logprobs") or []}
                             for e in entries],
            "text_offset": offsets}


class Renderer:
    """Turns a request's outputs into the client's chunks (streaming) or one response."""

    def __init__(self, rid: str, created: int, model: str, chat: bool, want_ids: bool,
                 want_logprobs: bool, echo: str | None) -> None:
        self.rid, self.created, self.model, self.chat = rid, created, model, chat
        self.want_ids, self.want_logprobs = want_ids, want_logprobs
        self._echo = echo
        self._started = False
        self.text_offset = 0  # characters of completion text before the next chunk
        self._plain = self._plain_template()

    def events(self, out: Out, prompt_ids: list[int] | None) -> list[bytes]:
        """`chunks` as the server-sent events the client receives. A chunk of text alone
        (most of a stream's) is the request's template around the encoded text: the same
        bytes, without building and encoding the whole chunk each time."""
        if (self._plain is not None and out.text and out.finish_reason is None
                and self._started):
            self.text_offset += len(out.text)
            return [self._plain[0] + _encode(out.text) + self._plain[1]]
        return [b"data: " + _encode(chunk) + b"\n\n" for chunk in self.chunks(out, prompt_ids)]

    def _plain_template(self) -> tuple[bytes, bytes] | None:
        """The event of a text-only chunk, split where its text goes; None when the client
        wants more than text (ids, logprobs) in every chunk."""
        if self.want_ids or self.want_logprobs:
            return None
        marker = "\u2063lumen\u2063"  # invisible separators: in no id or model name
        choice: dict[str, Any] = {"index": 0}
        if self.chat:
            choice["delta"] = {"content": marker}
        else:
            choice["text"] = marker
        choice["finish_reason"] = None
        parts = (b"data: " + _encode(self._chunk(choice)) + b"\n\n").split(_encode(marker))
        return (parts[0], parts[1]) if len(parts) == 2 else None

    def chunks(self, out: Out, prompt_ids: list[int] | None) -> list[dict[str, Any]]:
        """The chunks to stream for `out` (none when it carries nothing the client sees)."""
        chunks: list[dict[str, Any]] = []
        first = not self._started
        if first:
            self._started = True
            if self.chat:
                role: dict[str, Any] = self._chunk({"index": 0, "delta": {
                    "role": "assistant", "content": ""}, "logprobs": None,
                    "finish_reason": None})
                if self.want_ids and prompt_ids is not None:
                    role["prompt_token_ids"] = prompt_ids
                chunks.append(role)
        text = out.text
        if first and self._echo is not None:
            text = self._echo + text
        visible = (text or out.finish_reason is not None
                   or (self.want_ids and out.token_ids) or (self.want_logprobs and out.logprobs))
        if not visible:
            return chunks
        choice: dict[str, Any] = {"index": 0}
        if self.chat:
            choice["delta"] = {"content": text} if text or not out.finish_reason else {}
        else:
            choice["text"] = text
        if self.want_logprobs:
            choice["logprobs"] = ({"content": out.logprobs} if self.chat else
                                  completion_logprobs(out.logprobs, self.text_offset
                                                      + (len(text) - len(out.text))))
        choice["finish_reason"] = out.finish_reason
        if out.finish_reason is not None:
            choice["stop_reason"] = out.stop_reason
        if self.want_ids:
            if first and not self.chat and prompt_ids is not None:
                choice["prompt_token_ids"] = prompt_ids
            choice["token_ids"] = list(out.token_ids)
        self.text_offset += len(text)
        chunks.append(self._chunk(choice))
        return chunks

    def usage_chunk(self, prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
        chunk = self._chunk(None)
        chunk["usage"] = usage(prompt_tokens, completion_tokens)
        return chunk

    def _chunk(self, choice: dict[str, Any] | None) -> dict[str, Any]:
        return {"id": self.rid, "object": "chat.completion.chunk" if self.chat else
                "text_completion", "created": self.created, "model": self.model,
                "choices": [] if choice is None else [choice]}

    def response(self, text: str, token_ids: list[int], logprobs: list[dict[str, Any]],
                 finish_reason: str, stop_reason: str | int | None,
                 prompt_ids: list[int] | None) -> dict[str, Any]:
        """The whole (non-streamed) response."""
        echo = self._echo or ""
        choice: dict[str, Any] = {"index": 0}
        if self.chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = echo + text
        choice["logprobs"] = None
        if self.want_logprobs:
            choice["logprobs"] = ({"content": logprobs} if self.chat else
                                  completion_logprobs(logprobs, len(echo)))
        choice.update(finish_reason=finish_reason, stop_reason=stop_reason)
        body: dict[str, Any] = {"id": self.rid, "object": "chat.completion" if self.chat else
                                "text_completion", "created": self.created,
                                "model": self.model, "choices": [choice],
                                "usage": usage(len(prompt_ids or ()), len(token_ids))}
        if self.want_ids:
            choice["token_ids"] = token_ids
            if self.chat:
                body["prompt_token_ids"] = prompt_ids
            else:
                choice["prompt_token_ids"] = prompt_ids
        return body


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}

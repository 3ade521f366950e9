"""Resume semantics: what a request has produced (`Progress`), and how it continues on
another engine (`ResumePlan`): after its token ids from the last clean text boundary, with
the text of a character cut in two rendered here (`PendingText`), or recomputed from the
start. Also where a stop string matched on a chunk of several tokens leaves the request's
ids. Everything that asks an engine's tokenizer takes it as a `Detokenize` callable; the
gateway (server.py) serves and drives, this module decides.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from lumend.gateway import emission
from lumend.gateway.emission import Detokenize
from lumend.gateway.request import ClientRequest

log = logging.getLogger("lumend.gateway")


CUT_WINDOW = 16  # generated ids looked back over for a clean text boundary

_INCOMPLETE = emission.INCOMPLETE


@dataclass
class Progress:
    """What one request has produced, in token ids, and what its client has received."""

    prompt_ids: list[int] | None = None  # as the engine that started it tokenized them
    ids: list[int] = field(default_factory=list)  # generated ids received from engines
    raw_text: str = ""  # the text engines streamed for `ids` (before stop strings)
    text: str = ""  # completion text sent to the client (stop strings applied)
    logprobs: list[dict[str, Any]] = field(default_factory=list)  # non-streamed requests
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    workers: list[str] = field(default_factory=list)
    model: str = ""  # the served model it runs on: the latency metrics' model_name label
    broken_at: float | None = None  # when its upstream last broke, until the next token
    # After a resume: ids the client already has that the new engine generates again (a
    # cut back to a clean text boundary, or a restart from the start), and text likewise.
    again_ids: list[int] = field(default_factory=list)
    again_text: str = ""
    pending: PendingText | None = None  # resumed inside a character: its text comes from us

    @property
    def tokens(self) -> int:
        return len(self.ids)

    @property
    def context(self) -> int:
        return len(self.prompt_ids or ()) + len(self.ids)


@dataclass
class PendingText:
    """A stream resumed after its ids: until the new engine's text can be trusted, the
    gateway renders the text itself with the engine's `/detokenize`. Two reasons:
    - ids that end inside a character (the client has the ids, not yet the character): the
      new engine cannot print that character (its decoder starts from a prompt cut inside
      it), so the gateway renders from the last whole character on until it is whole;
    - vLLM's incremental decoder (tokenizers' `DecodeStream` primed with the prompt ids)
      sends, as its first text after a prompt whose text ends in U+FFFD, the WHOLE context's
      text, prompt included (`lumend/engine/sim_detokenizer.py` does the same).
    So the engine's text is taken again only once it has sent some (that first text is
    read, not passed on) and the rendering is whole; the text of that moment comes from
    the engine's own text when it repeats what the client had (`/detokenize` renders
    special tokens, which streams skip), else from the rendering."""

    context: list[int]  # prompt and generated ids up to the last whole character
    base: str  # their text
    ids: list[int]  # generated ids after it, growing as the engine streams
    had: str = ""  # the completion text the client had at the resume (a repeat contains it)
    prompt_text: str = ""  # the prompt ids' text by `/detokenize` (a repeat starts with it)
    clean: bool = False  # resumed after all its ids with none inside a character
    spoke: str = ""  # the text the new engine has streamed since the resume


class Diverged(Exception):
    """A recomputed request did not regenerate what the client already has (sampling)."""


@dataclass
class ResumePlan:
    """Where and how a request (re)starts, and what its progress becomes when it does."""

    path: str
    body: dict[str, Any]
    resume: bool = False
    by_ids: bool = False  # continues after its ids (a KV checkpoint can serve it)
    how: str = "start"
    keep: int | None = None  # generated ids kept as context; None: all
    again_ids: list[int] = field(default_factory=list)
    again_text: str = ""
    pending: PendingText | None = None

    @property
    def restarted(self) -> bool:
        """Recomputed from the start (a plan for a first start keeps every id)."""
        return self.keep == 0

    @classmethod
    def by_cut(cls, req: ClientRequest, progress: Progress, cut: int, text_at_cut: str,
               prompt_text: str, max_model_len: int | None) -> ResumePlan:
        """After all its ids; those after `cut` end inside a character, whose text the
        gateway renders (`PendingText`), as it renders any text until the new engine's
        can be trusted."""
        assert progress.prompt_ids is not None
        ids = progress.ids
        how = "after its token ids"
        if cut < len(ids):
            how += f" (the last {len(ids) - cut} inside a character, rendered by the gateway)"
        pending = PendingText([*progress.prompt_ids, *ids[:cut]], text_at_cut, ids[cut:],
                              had=progress.raw_text, prompt_text=prompt_text,
                              clean=cut == len(ids))
        return cls("/v1/completions", req.resume_body([*progress.prompt_ids, *ids], len(ids),
                                                      max_model_len),
                   resume=True, by_ids=True, how=how, again_ids=[*progress.again_ids],
                   pending=pending)

    @classmethod
    def restart(cls, req: ClientRequest, progress: Progress) -> ResumePlan:
        why = "guided decoding" if req.guided else "no clean cut"
        return cls(path_of(req.chat), req.first_body(), resume=True,
                   how=f"recomputed from the start ({why}), skipping what the client has",
                   keep=0, again_ids=[*progress.ids, *progress.again_ids],
                   again_text=progress.raw_text + progress.again_text)

    def apply(self, progress: Progress) -> None:
        progress.pending = self.pending
        if self.keep is None:
            return
        if self.keep == 0:
            progress.raw_text = ""
            progress.again_text = self.again_text
        progress.ids = progress.ids[:self.keep]
        progress.again_ids = list(self.again_ids)


async def plan(req: ClientRequest, progress: Progress, worker: str, detokenize: Detokenize,
               max_model_len: Callable[[], Awaitable[int | None]]) -> ResumePlan:
    """The engine request that (re)starts `req` on `worker` (whose tokenizer `detokenize`
    is, and whose context length `max_model_len` asks) given its progress."""
    if not progress.ids and not progress.again_ids and not progress.raw_text:
        return ResumePlan(path_of(req.chat), req.first_body())
    if (not req.guided and progress.prompt_ids is not None and progress.ids
            and not progress.again_text):
        cut = await clean_cut(detokenize, progress)
        context = (None if cut is None or req.limit is not None
                   else await max_model_len())
        if cut is not None and (req.limit is not None or context is not None):
            return ResumePlan.by_cut(req, progress, *cut, context)
        log.warning("no clean text boundary in the last %d tokens (or no /detokenize on "
                    "%s): recomputing the request from its start", CUT_WINDOW,
                    worker)
    return ResumePlan.restart(req, progress)

async def clean_cut(detokenize: Detokenize, progress: Progress
                    ) -> tuple[int, str, str] | None:
    """How many of the generated ids end on the last whole character the client has, the
    text up to there, and the prompt's text. An engine sends text once it is whole, so the
    ids after that cut (the first bytes of a character, at most a few tokens) are ones whose
    text the client does not have yet; an engine that starts from a prompt ending inside a
    character cannot print it, so the gateway renders it (`PendingText`). The cut whose
    text is exactly the text received is taken; `/detokenize` renders special tokens,
    which streams skip, so without one the last cut that ends on a whole character is."""
    assert progress.prompt_ids is not None
    prompt, ids = progress.prompt_ids, progress.ids
    base = await detokenize(prompt)
    if base is None:
        return None
    want = base + progress.raw_text
    whole: tuple[int, str, str] | None = None
    for cut in range(len(ids), max(-1, len(ids) - CUT_WINDOW), -1):
        text = await detokenize([*prompt, *ids[:cut]])
        if text is None:
            return None
        if text == want:
            return cut, text, base
        if whole is None and not text.endswith("\ufffd"):
            whole = cut, text, base
    return whole

async def pending_text(detokenize: Detokenize, worker: str, progress: Progress,
                       ids: list[int], engine_text: str, final: bool) -> str:
    """The text a piece adds while the gateway renders it (see `PendingText`): none until
    the new engine has sent text and the rendering is whole, then all of it at once, as an
    engine that had not been interrupted sends it. At the stream's end an incomplete
    character is dropped, as engines drop it."""
    pending = progress.pending
    assert pending is not None
    pending.ids += ids
    pending.spoke += engine_text
    if not final and not pending.spoke:
        return ""  # the engine's first text is still to come; it may repeat the context
    full = await detokenize([*pending.context, *pending.ids])
    if full is None and pending.clean:
        # No rendering to be had (its engines' /detokenize failed): nothing was inside a
        # character, so the engine's own text serves, a repeat of the context taken apart.
        progress.pending = None
        return engine_text_after(pending, pending.spoke)
    if full is None or not full.startswith(pending.base):
        raise Diverged(f"{worker} rendered the text before the cut differently")
    text = full[len(pending.base):]
    if text.endswith(_INCOMPLETE) and not final:
        return ""
    progress.pending = None
    if final and text.endswith(_INCOMPLETE):
        # As an engine ends a stream: with the text its decoder had emitted, up to the
        # last id after which the text was whole (a last token of whole characters and
        # the first bytes of another emits none of them).
        for k in range(len(pending.ids) - 1, -1, -1):
            full = await detokenize([*pending.context, *pending.ids[:k]])
            if full is None or not full.endswith(_INCOMPLETE):
                break
        text = full[len(pending.base):] if full is not None else ""
    return engine_text_after(pending, text)


def engine_text_after(pending: PendingText, rendered: str) -> str:
    """The text since the resume, once the engine's can be trusted again. When its first
    text repeated the context (the prompt's text, then what the client `had`, then the new
    text), the new text, as the engine renders it (without the special tokens `/detokenize`
    shows; invalid bytes as the engine streams them). When it did not, the engine's text
    as it is: its context's text ended on a whole character, so it sent exactly the new
    text. `rendered` (by `/detokenize`) only when its text is a repeat that cannot be
    parted from the new text."""
    spoke = pending.spoke
    if not spoke:  # the stream ended and the engine sent no text since the resume: none
        return ""
    if not pending.had:
        if pending.prompt_text and spoke.startswith(pending.prompt_text):
            return spoke[len(pending.prompt_text):]
        return spoke
    at = spoke.find(pending.had)
    while at != -1:
        head = spoke[:at]
        if head == pending.prompt_text or _without_some_of(head, pending.prompt_text):
            return spoke[at + len(pending.had):]
        at = spoke.find(pending.had, at + 1)
    # A repeat is as long as what the client had; new text alone is a few tokens' worth.
    repeat = len(spoke) >= len(pending.had) + len(rendered)
    return rendered if repeat else spoke


def _without_some_of(short: str, long: str) -> bool:
    """`short` is `long` with some characters left out (special tokens' names)."""
    chars = iter(long)
    return 0 < len(short) < len(long) and all(c in chars for c in short)


async def ids_through_stop(detokenize: Detokenize, progress: Progress, ids: list[int],
                           text: str, stop_end: int) -> int:
    """How many of a chunk's `ids` (several: speculative decoding) an engine keeps when
    the chunk's `text` completes a stop string at `stop_end`: through the token at which
    its incremental decoder emits the text that completes it, as vLLM keeps them when it
    matches stop strings itself (`emission.ids_through_stop`). Without this the ids a
    stopped request reports would depend on where chunks happen to break (a resumed
    stream breaks them elsewhere)."""
    before = progress.ids[:len(progress.ids) - len(ids)]
    return await emission.ids_through_stop(detokenize, before, ids, text, stop_end,
                                           progress.prompt_ids or ())


def path_of(chat: bool) -> str:
    return "/v1/chat/completions" if chat else "/v1/completions"

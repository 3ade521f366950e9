"""The sim engine's draft function: a noisy copy of the target's token function.

Each drafted token is the target's own next token with probability `agreement`, else
another one; the choice is a hash of (draft seed, context digest), so the same context always
gets the same drafts (runs are reproducible) and agreement is independent from position to
position. Per request it keeps the rolling digests of its speculative state, so a round
costs the new tokens plus k, not the whole context (`reuse` says how much is still valid).
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Sequence

from lumend.assist.server import DraftJob
from lumend.engine.sim_core import VOCAB, advance, context_state, next_token

_SCALE = float(1 << 64)


class SimDraftFunction:
    def __init__(self, seed: int, agreement: float, draft_seed: int = 0,
                 seconds_per_token: float = 0.0) -> None:
        """`seed`: the target engines' seed (the token function to imitate); `agreement`:
        P(a drafted token is the target's); `seconds_per_token`: modelled draft cost (the
        draft model's decode step), spent sleeping in the drafting thread."""
        if not 0.0 <= agreement <= 1.0:
            raise ValueError(f"agreement must be within [0, 1], got {agreement}")
        self.seed = seed
        self.agreement = agreement
        self.seconds_per_token = seconds_per_token
        self._key = draft_seed.to_bytes(8, "big", signed=True)
        # request -> digests after each token of its speculative state ([0]: no tokens)
        self._states: dict[str, list[int]] = {}
        self._tokens: dict[str, list[int]] = {}

    def draft(self, jobs: Sequence[DraftJob], k: int) -> list[list[int]]:
        out = [self._one(job, k) for job in jobs]
        if self.seconds_per_token:
            time.sleep(self.seconds_per_token * k)  # k steps of the batch
        return out

    def release(self, request_id: str) -> None:
        self._states.pop(request_id, None)
        self._tokens.pop(request_id, None)

    def _one(self, job: DraftJob, k: int) -> list[int]:
        states = self._states.get(job.request_id)
        tokens = self._tokens.get(job.request_id)
        if states is None or tokens is None or job.reuse == 0:
            states, tokens = [context_state(self.seed, [])], []
        keep = min(job.reuse, len(tokens))
        del states[keep + 1:]
        del tokens[keep:]
        state = states[-1]
        for t in job.context[keep:]:
            state = advance(state, t)
            states.append(state)
        tokens.extend(job.context[keep:])
        drafts = []
        for _ in range(k):
            token = self._guess(state)
            state = advance(state, token)
            states.append(state)
            drafts.append(token)
        tokens.extend(drafts)
        self._states[job.request_id] = states
        self._tokens[job.request_id] = tokens
        return drafts

    def _guess(self, state: int) -> int:
        target = next_token(state)
        digest = hashlib.blake2b(state.to_bytes(8, "big"), key=self._key, digest_size=16).digest()
        if int.from_bytes(digest[:8], "big") / _SCALE < self.agreement:
            return target
        # Any other token of the vocabulary: a wrong guess never matches by accident.
        offset = 1 + int.from_bytes(digest[8:], "big") % (VOCAB - 1)
        return next_token(state + offset)

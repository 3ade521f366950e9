"""A survivor engine's attachment to a drafter: what `POST /lumen/assist` sets up.

The engine asks `drafts()` once per decode step for its running requests; below the batch
threshold that is one round to the drafter, answered within the deadline or not at all. The
engine verifies the drafts itself and reports what it accepted (`verified`). Counters are
kept per assignment, so the acceptance of each assignment can be exported after it ended.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import zmq.asyncio

from lumend.assist import wire
from lumend.assist.client import AsyncDraftClient
from lumend.checkpoint.security import CurveKeys

log = logging.getLogger("lumend.assist")

DEFAULT_K = 4
DEFAULT_MAX_BATCH = 16
_ENDPOINT = re.compile(r"^tcp://(\[[0-9a-fA-F:.]+\]|[A-Za-z0-9.\-]+):\d{1,5}$")


class AttachError(ValueError):
    """A bad attach request; the message names the field and what it accepts."""


@dataclass(frozen=True)
class AttachRequest:
    endpoint: str
    assignment: str
    k: int
    deadline_s: float
    max_batch: int

    @classmethod
    def parse(cls, body: Any, default_deadline_s: float) -> AttachRequest:
        if not isinstance(body, dict):
            raise AttachError("body: expected a JSON object with endpoint (tcp://host:port)")
        endpoint = body.get("endpoint")
        if not isinstance(endpoint, str) or not _ENDPOINT.match(endpoint):
            raise AttachError(f"endpoint: expected tcp://host:port, got {endpoint!r}")
        assignment = body.get("assignment", endpoint)
        if not isinstance(assignment, str) or not 0 < len(assignment) <= 256:
            raise AttachError("assignment: expected a name of 1..256 characters")
        k = body.get("k", DEFAULT_K)
        if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= wire.MAX_K:
            raise AttachError(f"k: expected an integer 1..{wire.MAX_K}, got {k!r}")
        deadline_ms = body.get("deadline_ms", default_deadline_s * 1000)
        if (not isinstance(deadline_ms, int | float) or isinstance(deadline_ms, bool)
                or not 0 < deadline_ms <= 1000):
            raise AttachError(f"deadline_ms: expected a number in (0, 1000], got "
                              f"{deadline_ms!r}")
        max_batch = body.get("max_batch", DEFAULT_MAX_BATCH)
        if not isinstance(max_batch, int) or isinstance(max_batch, bool) or max_batch < 1:
            raise AttachError(f"max_batch: expected an integer >= 1, got {max_batch!r}")
        return cls(endpoint, assignment, k, float(deadline_ms) / 1000, max_batch)


@dataclass
class AssignmentCounters:
    """Per assignment. Acceptance = accepted_tokens / drafted_tokens."""

    rounds: int = 0           # rounds sent
    late_rounds: int = 0      # no drafts by the deadline (or none sent: drafter unreachable)
    drafted_tokens: int = 0   # drafted tokens the engine verified
    accepted_tokens: int = 0  # of those, the ones that matched the target

    @property
    def acceptance(self) -> float | None:
        return self.accepted_tokens / self.drafted_tokens if self.drafted_tokens else None


class Attachment:
    def __init__(self, request: AttachRequest, *, model: str, survivor: str,
                 curve: CurveKeys | None, context: zmq.asyncio.Context | None = None) -> None:
        self.request = request
        self.client = AsyncDraftClient(request.endpoint, deadline_s=request.deadline_s,
                                       curve=curve, model=model, survivor=survivor,
                                       context=context)

    async def drafts(self, contexts: Mapping[str, Sequence[int]],
                     counters: AssignmentCounters) -> dict[str, list[int]]:
        """One round for these requests (none above the batch threshold)."""
        if not contexts or len(contexts) > self.request.max_batch:
            return {}
        before = self.client.counters.on_time
        counters.rounds += 1
        out = await self.client.propose(contexts, self.request.k)
        if self.client.counters.on_time == before:
            counters.late_rounds += 1
        return out

    async def finished(self, running: Iterable[str]) -> None:
        """Release requests the drafter has that are no longer running here."""
        await self.client.release_absent(running)

    def close(self) -> None:
        self.client.close()


class AssistState:
    """The engine's side: the current attachment (or none) and counters per assignment."""

    def __init__(self, model: str, survivor: str, curve: CurveKeys | None) -> None:
        self.model = model
        self.survivor = survivor
        self.curve = curve
        self.attachment: Attachment | None = None
        self.assignments: dict[str, AssignmentCounters] = {}

    def attach(self, request: AttachRequest) -> None:
        self.detach()
        self.attachment = Attachment(request, model=self.model, survivor=self.survivor,
                                     curve=self.curve)
        self.assignments.setdefault(request.assignment, AssignmentCounters())
        log.info("assist attached: drafter %s (assignment %s, k %d, deadline %.1f ms, "
                 "batch <= %d)", request.endpoint, request.assignment, request.k,
                 request.deadline_s * 1000, request.max_batch)

    def detach(self) -> bool:
        if self.attachment is None:
            return False
        a, self.attachment = self.attachment, None
        a.close()
        c = self.assignments[a.request.assignment]
        log.info("assist detached: drafter %s (assignment %s): %d of %d drafted tokens "
                 "accepted over %d rounds, %d late", a.request.endpoint, a.request.assignment,
                 c.accepted_tokens, c.drafted_tokens, c.rounds, c.late_rounds)
        return True

    @property
    def current(self) -> AssignmentCounters | None:
        a = self.attachment
        return None if a is None else self.assignments[a.request.assignment]

    def describe(self) -> dict[str, Any]:
        a = self.attachment
        return {
            "attached": a is not None,
            "endpoint": a.request.endpoint if a else None,
            "assignment": a.request.assignment if a else None,
            "k": a.request.k if a else None,
            "deadline_ms": a.request.deadline_s * 1000 if a else None,
            "max_batch": a.request.max_batch if a else None,
            "assignments": {name: {**asdict(c), "acceptance": c.acceptance}
                            for name, c in self.assignments.items()},
        }

    def metric_lines(self) -> list[str]:
        lines = [f"lumen_assist_attached {int(self.attachment is not None)}"]
        for name, c in self.assignments.items():
            label = f'{{assignment="{_label(name)}"}}'
            lines += [f"lumen_assist_drafted_tokens_total{label} {c.drafted_tokens}",
                      f"lumen_assist_accepted_tokens_total{label} {c.accepted_tokens}",
                      f"lumen_assist_rounds_total{label} {c.rounds}",
                      f"lumen_assist_late_rounds_total{label} {c.late_rounds}"]
        return lines


def _label(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")

"""Whether a vLLM engine core still makes progress, judged from its API server.

vLLM runs its engine core in a process of its own. A core stuck in a GPU kernel, a
collective or a driver call serves nothing while its API server (where LUMEN's gate
lives) still answers HTTP, so a probe the API server answers says nothing about the core.
The core answers utility calls between two steps of its busy loop, idle or serving; one that
has answered none for `hang_after_s`, while no stream through the gate moved either, is
hung.

Judged over a long window, never from one slow answer: on a loaded machine a healthy core
can take seconds for one step (a shadow that just took over, resuming streams from their
checkpoints on a busy CPU, did not answer within 1.5 s three times in a row). At most one
question is outstanding; the next is asked `ask_interval_s` after the last answer.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Mapping

HANG_AFTER_ENV = "LUMEN_CORE_HANG_S"
DEFAULT_HANG_AFTER_S = 20.0
ASK_INTERVAL_S = 1.0


def hang_after_s_from(environ: Mapping[str, str]) -> float:
    """The window from the environment (LUMEN_CORE_HANG_S), else the default. A bad value
    is an error that says what is wanted: an engine must not start with no hang check."""
    raw = environ.get(HANG_AFTER_ENV, "").strip()
    if not raw:
        return DEFAULT_HANG_AFTER_S
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not value > 0 or value == float("inf"):
        raise ValueError(f"{HANG_AFTER_ENV}={raw!r}: want seconds, a positive number "
                         f"(unset for the default, {DEFAULT_HANG_AFTER_S:g})")
    return value


class CoreWatch:
    """Asks the core a cheap question (`ask`) when poked and judges from the answers and
    the streams' progress. Lives on the API server's event loop."""

    def __init__(self, ask: Callable[[], Awaitable[object]], hang_after_s: float,
                 ask_interval_s: float = ASK_INTERVAL_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._ask = ask
        self.hang_after_s = hang_after_s
        self._ask_interval_s = ask_interval_s
        self._clock = clock
        self._asked_at: float | None = None  # the outstanding question's, else None
        self._answered_at = float("-inf")
        self._progress_at = float("-inf")
        self._failure: str | None = None
        self._task: asyncio.Task[None] | None = None

    def progress(self) -> None:
        """A stream through the gate moved: the core stepped."""
        self._progress_at = self._clock()

    def poke(self) -> None:
        """Ask, unless a question is outstanding or was answered too recently."""
        now = self._clock()
        if self._asked_at is not None or now - self._answered_at < self._ask_interval_s:
            return
        self._asked_at = now
        self._task = asyncio.get_running_loop().create_task(self._ask_once())

    async def _ask_once(self) -> None:
        try:
            await self._ask()
            self._failure = None
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # EngineDeadError, and whatever else a dead core gives
            self._failure = f"its engine core failed a call: {exc!r}"
        finally:
            self._answered_at = self._clock()
            self._asked_at = None

    def silent_s(self, since: float) -> float:
        """How long the outstanding question has waited (from `since` at the earliest);
        0 when none is outstanding. A few seconds is common on a busy machine; lumend
        takes a worker whose core is silent this long as stalled (admits elsewhere)."""
        if self._asked_at is None:
            return 0.0
        return max(0.0, self._clock() - max(self._asked_at, since))

    def verdict(self, since: float) -> str | None:
        """Why the core does not serve, or None. Only time from `since` (when the engine
        became active) counts: a standby's core may be busy waking."""
        if self._failure is not None:
            return self._failure
        if self._asked_at is None:
            return None
        now = self._clock()
        silent = now - max(self._asked_at, since)
        still = now - max(self._progress_at, since)
        if min(silent, still) < self.hang_after_s:
            return None
        return (f"its engine core has answered nothing for {silent:.1f} s and no stream has "
                f"moved for {still:.1f} s (hang window {self.hang_after_s:g} s, "
                f"{HANG_AFTER_ENV}): hung, though its API server still answers")

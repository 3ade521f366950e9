"""Stop strings matched by the gateway on the text of the whole request, across resumes.

The engine is never given the client's `stop` strings: a stop string that spans a break
would be invisible to the engine that continues (it sees only its own output), and an
engine holds back text that may begin a stop string, which a failure would lose. Here the
text is held back instead (at most the longest stop string minus one character) until it
cannot be the start of a stop string, as vLLM does.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class StopScan:
    stops: tuple[str, ...]
    include_stop: bool = False
    held: str = ""  # text received but not released: it may begin a stop string
    matched: str | None = None  # the stop string found, once found
    stop_end: int | None = None  # characters of the last text fed through the stop's end

    @property
    def hold_back(self) -> int:
        return max((len(s) for s in self.stops), default=1) - 1

    def feed(self, text: str, allow_stop: bool = True) -> str:
        """The text that may be sent now; after a match, the text up to the stop (with it
        when `include_stop`) and `matched` is set. `allow_stop` False (min_tokens not yet
        reached) releases text without matching."""
        if self.matched is not None:
            return ""
        if not self.stops:
            return text
        window = self.held + text
        if allow_stop:
            found = [(window.find(s), s) for s in self.stops]
            hits = [(at, s) for at, s in found if at >= 0]
            if hits:
                at, stop = min(hits)
                self.stop_end = at + len(stop) - len(self.held)
                self.matched, self.held = stop, ""
                return window[:at + len(stop)] if self.include_stop else window[:at]
        keep = self.hold_back
        if keep <= 0 or not allow_stop:
            self.held = ""
            return window
        cut = max(0, len(window) - keep)
        self.held = window[cut:]
        return window[:cut]

    def flush(self) -> str:
        """At the end of the request: the held text was no stop string."""
        held, self.held = self.held, ""
        return held

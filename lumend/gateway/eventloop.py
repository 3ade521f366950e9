"""The event loop lumend runs on.

The gateway's cost per request and per streamed chunk is mostly the event loop's and the HTTP
stack's (bench/gateway.py measures it). uvloop, where it is installed, does that work in C:
lumend then runs on it unless `LUMEN_EVENT_LOOP=asyncio` says otherwise (the off switch, for
an operator who suspects the loop; `lumend run` logs which loop it runs on).

    LUMEN_EVENT_LOOP=auto     uvloop when installed, else asyncio (the default)
    LUMEN_EVENT_LOOP=uvloop   uvloop, and an error at start when it is not installed
    LUMEN_EVENT_LOOP=asyncio  the standard library's loop
"""

from __future__ import annotations

import asyncio
import importlib.util
import os
from collections.abc import Callable, Coroutine, Mapping
from typing import Any, TypeVar

ENV = "LUMEN_EVENT_LOOP"
CHOICES = ("auto", "uvloop", "asyncio")

T = TypeVar("T")


class LoopChoiceError(ValueError):
    """`LUMEN_EVENT_LOOP` names no loop this host can run; the message says the fix."""


def uvloop_installed() -> bool:
    return importlib.util.find_spec("uvloop") is not None


def choose(env: Mapping[str, str] | None = None, installed: bool | None = None) -> str:
    """The loop to run on, "uvloop" or "asyncio", from `LUMEN_EVENT_LOOP` in `env`."""
    value = (os.environ if env is None else env).get(ENV, "auto").strip().lower() or "auto"
    if value not in CHOICES:
        raise LoopChoiceError(f"{ENV}={value!r}: use one of {', '.join(CHOICES)}")
    have = uvloop_installed() if installed is None else installed
    if value == "uvloop" and not have:
        raise LoopChoiceError(f"{ENV}=uvloop but uvloop is not installed: install it "
                              f"(pip install uvloop) or set {ENV}=asyncio")
    if value == "asyncio" or not have:
        return "asyncio"
    return "uvloop"


def loop_factory(name: str) -> Callable[[], asyncio.AbstractEventLoop]:
    if name == "uvloop":
        import uvloop

        return uvloop.new_event_loop
    if name == "asyncio":
        return asyncio.new_event_loop
    raise LoopChoiceError(f"no event loop called {name!r}")


def run(main: Coroutine[Any, Any, T], name: str | None = None) -> T:
    """`asyncio.run(main)` on the loop `name` (default: `choose()`)."""
    with asyncio.Runner(loop_factory=loop_factory(name or choose())) as runner:
        return runner.run(main)

"""The engine-core watch (lumend.engine.core_watch): a core is hung only after a whole
window with no answer and no stream moving, counted from its activation; one slow answer,
a busy stream or a standby's wake is no hang. A real vLLM core: tests/vllm/test_vllm_failover.py."""

from __future__ import annotations

import asyncio

import pytest

from lumend.engine.core_watch import DEFAULT_HANG_AFTER_S, CoreWatch, hang_after_s_from


class Core:
    """Answers a question when told to; counts the questions."""

    def __init__(self) -> None:
        self.asked = 0
        self.answer = asyncio.Event()
        self.fail: Exception | None = None

    async def ask(self) -> bool:
        self.asked += 1
        await self.answer.wait()
        self.answer.clear()
        if self.fail is not None:
            raise self.fail
        return False


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_silence_for_the_window_is_a_hang_and_an_answer_ends_it() -> None:
    async def scenario() -> None:
        core, clock = Core(), Clock()
        watch = CoreWatch(core.ask, 20.0, ask_interval_s=1.0, clock=clock)
        watch.poke()
        await asyncio.sleep(0)
        assert core.asked == 1
        for _ in range(19):  # probes while the question is outstanding: no second question
            clock.now += 1.0
            watch.poke()
            assert watch.verdict(since=0.0) is None
        await asyncio.sleep(0)
        assert core.asked == 1
        clock.now += 1.0
        why = watch.verdict(since=0.0)
        assert why is not None and "answered nothing for 20.0 s" in why, why
        core.answer.set()  # the core comes back (a step that took 20 s): no longer hung
        await asyncio.sleep(0)
        assert watch.verdict(since=0.0) is None
        watch.poke()  # answered just now: no new question yet
        await asyncio.sleep(0)
        assert core.asked == 1
        clock.now += 1.0
        watch.poke()
        await asyncio.sleep(0)
        assert core.asked == 2

    asyncio.run(scenario())


def test_a_moving_stream_or_a_recent_activation_is_no_hang() -> None:
    async def scenario() -> None:
        core, clock = Core(), Clock()
        watch = CoreWatch(core.ask, 20.0, clock=clock)
        watch.poke()
        await asyncio.sleep(0)
        clock.now += 15.0
        watch.progress()  # a stream moved 5 s ago when the window is up
        clock.now += 10.0
        assert watch.verdict(since=0.0) is None
        clock.now += 15.0
        assert watch.verdict(since=0.0) is not None  # 20 s with neither
        # Activated 5 s ago (a shadow that took over): its wake does not count.
        assert watch.verdict(since=clock.now - 5.0) is None
        core.answer.set()
        await asyncio.sleep(0)

    asyncio.run(scenario())


def test_a_failed_call_is_reported_until_an_answer() -> None:
    async def scenario() -> None:
        core, clock = Core(), Clock()
        watch = CoreWatch(core.ask, 20.0, clock=clock)
        core.fail = RuntimeError("EngineDeadError: the core is gone")
        watch.poke()
        core.answer.set()
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        why = watch.verdict(since=0.0)
        assert why is not None and "EngineDeadError" in why, why
        core.fail = None
        clock.now += 2.0
        watch.poke()
        core.answer.set()
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        assert watch.verdict(since=0.0) is None

    asyncio.run(scenario())


def test_the_window_comes_from_the_environment_and_a_bad_one_says_what_is_wanted() -> None:
    assert hang_after_s_from({}) == DEFAULT_HANG_AFTER_S == 20.0
    assert hang_after_s_from({"LUMEN_CORE_HANG_S": " 8.5 "}) == 8.5
    for bad in ("0", "-3", "nan", "inf", "twenty"):
        with pytest.raises(ValueError, match=r"LUMEN_CORE_HANG_S.*positive number"):
            hang_after_s_from({"LUMEN_CORE_HANG_S": bad})

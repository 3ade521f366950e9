"""QuietWatch: a task is cancelled only after a quiet period as long as its limit, heard
reads move that period, the limit is read as the stream's state changes, and a cancellation
from elsewhere is never taken for the watch's."""

from __future__ import annotations

import asyncio

import pytest

from lumend.gateway.quiet import QuietWatch


async def reader(feed: asyncio.Queue[bytes | None], limits: list[float]) -> list[bytes]:
    """Reads `feed` until None, under a watch whose limit is `limits[0]` until the first
    item, then `limits[1]`; returns what it read, or raises TimeoutError on a quiet period."""
    got: list[bytes] = []
    watch = QuietWatch(lambda: limits[0] if not got else limits[1])
    try:
        while True:
            try:
                item = await feed.get()
            except asyncio.CancelledError:
                if watch.expired():
                    raise TimeoutError(f"quiet after {len(got)} items") from None
                raise
            if item is None:
                return got
            got.append(item)
            watch.heard()
    finally:
        watch.close()


def test_steady_reads_longer_than_the_limit_in_all_are_not_cut() -> None:
    async def main() -> list[bytes]:
        feed: asyncio.Queue[bytes | None] = asyncio.Queue()
        task = asyncio.create_task(reader(feed, [5.0, 0.5]))
        for i in range(40):  # 40 x 0.025 s: twice the limit in all, never quiet for it
            feed.put_nowait(b"%d" % i)
            await asyncio.sleep(0.025)
        feed.put_nowait(None)
        return await task

    assert len(asyncio.run(main())) == 40


def test_a_quiet_period_cancels_with_the_limit_of_the_streams_state() -> None:
    async def main() -> None:
        feed: asyncio.Queue[bytes | None] = asyncio.Queue()
        task = asyncio.create_task(reader(feed, [30.0, 0.1]))
        await asyncio.sleep(0.3)  # before the first item the limit is 30 s: still reading
        assert not task.done()
        feed.put_nowait(b"first")
        with pytest.raises(TimeoutError, match="quiet after 1 items"):
            await asyncio.wait_for(task, 10)  # then 0.1 s: it gives up

    asyncio.run(main())


def test_a_cancellation_from_elsewhere_propagates() -> None:
    async def main() -> None:
        feed: asyncio.Queue[bytes | None] = asyncio.Queue()
        task = asyncio.create_task(reader(feed, [30.0, 30.0]))
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert task.cancelled()

    asyncio.run(main())


def test_a_closed_watch_never_fires() -> None:
    async def main() -> None:
        fired = asyncio.Event()

        async def closes_its_watch() -> None:
            watch = QuietWatch(lambda: 0.05)
            watch.close()
            try:
                await asyncio.sleep(0.3)
            except asyncio.CancelledError:
                fired.set()
                raise

        await asyncio.create_task(closes_its_watch())
        assert not fired.is_set()

    asyncio.run(main())

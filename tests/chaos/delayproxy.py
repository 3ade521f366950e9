"""A TCP relay that delays what it carries: the chaos lab's delay, since this kernel has no
`tc netem` and nftables can drop but not hold packets.

    python delayproxy.py LISTEN_HOST:PORT TARGET_HOST:PORT CONTROL_FILE

Every connection to LISTEN is relayed to TARGET; each chunk read from either side is
written to the other side `delay` later (the order kept, the throughput not limited), so a
round trip through the relay takes 2 x delay more. The delay, in milliseconds one way, is
read from CONTROL_FILE (absent or empty: 0) ten times a second, so a test changes it while
connections are open. The relay counts what it delayed in CONTROL_FILE.stats (JSON:
connections, chunks, chunks_delayed). Standard library only; stopped by SIGTERM.
"""

from __future__ import annotations

import asyncio
import json
import signal
import sys
import time
from pathlib import Path


class Relay:
    def __init__(self, target: tuple[str, int], control: Path) -> None:
        self.target = target
        self.control = control
        self.delay_s = 0.0
        self.stats = {"connections": 0, "chunks": 0, "chunks_delayed": 0}

    async def watch_control(self) -> None:
        stats = self.control.with_name(self.control.name + ".stats")
        while True:
            try:
                text = self.control.read_text().strip()
                self.delay_s = float(text) / 1000 if text else 0.0
            except (OSError, ValueError):
                self.delay_s = 0.0
            partial = stats.with_name(stats.name + ".partial")
            partial.write_text(json.dumps(self.stats))
            partial.replace(stats)
            await asyncio.sleep(0.1)

    async def pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Chunks from `reader` to `writer`, each at its arrival plus the delay then."""
        queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()

        async def later() -> None:
            while True:
                due, data = await queue.get()
                if not data:
                    break
                wait = due - time.monotonic()
                if wait > 0:
                    await asyncio.sleep(wait)
                writer.write(data)
                await writer.drain()

        sender = asyncio.create_task(later())
        try:
            while data := await reader.read(65536):
                self.stats["chunks"] += 1
                if self.delay_s > 0:
                    self.stats["chunks_delayed"] += 1
                queue.put_nowait((time.monotonic() + self.delay_s, data))
        except OSError:
            pass
        finally:
            queue.put_nowait((0.0, b""))
            try:
                await sender
                writer.write_eof()
            except OSError:
                pass

    async def serve(self, client_r: asyncio.StreamReader,
                    client_w: asyncio.StreamWriter) -> None:
        self.stats["connections"] += 1
        try:
            server_r, server_w = await asyncio.open_connection(*self.target)
        except OSError:
            client_w.close()
            return
        try:
            await asyncio.gather(self.pipe(client_r, server_w), self.pipe(server_r, client_w))
        finally:
            for w in (client_w, server_w):
                w.close()


def address(text: str) -> tuple[str, int]:
    host, port = text.rsplit(":", 1)
    return host, int(port)


async def main(listen: tuple[str, int], target: tuple[str, int], control: Path) -> None:
    relay = Relay(target, control)
    server = await asyncio.start_server(relay.serve, *listen)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    loop.add_signal_handler(signal.SIGINT, stop.set)
    watcher = asyncio.create_task(relay.watch_control())
    async with server:
        await stop.wait()
    watcher.cancel()


if __name__ == "__main__":
    if len(sys.argv) != 4:
        sys.exit(__doc__)
    asyncio.run(main(address(sys.argv[1]), address(sys.argv[2]), Path(sys.argv[3])))

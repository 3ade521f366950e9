"""Checkpoint streaming throughput over loopback, next to a raw ZeroMQ send of the same bytes.

    .venv/bin/python bench/checkpoint.py [--total-mib 256] [--pages-kib 64,1024,4096]

For each page size, in the same run: (1) raw: a DEALER sends [small header, page] messages
(copy=False, blocking) to a ROUTER process that only receives them and answers once at the
end; (2) lumen: the CheckpointStreamer puts the same pages to a real holder process (decode,
validate, account, store, ACK each page) and waits for the last ACK. The streamer's send
high-water mark is set high enough that nothing is dropped; drops are shown anyway.
Prints a table; asserts nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import time
from typing import Any

import zmq

from lumenctl.localcluster import free_ports
from lumend.checkpoint.holder import HolderConfig, HolderService
from lumend.checkpoint.streamer import CheckpointStreamer, PageLayout


def run_holder(port: int, budget: int) -> None:
    async def main() -> None:
        service = HolderService(HolderConfig(listen=f"127.0.0.1:{port}", workers=("w0",),
                                             budget_bytes=budget, rcvhwm=100_000))
        await service.run(asyncio.Event())  # until the process is terminated

    asyncio.run(main())


def run_raw_receiver(port: int) -> None:
    sock: zmq.Socket[Any] = zmq.Context.instance().socket(zmq.ROUTER)
    sock.setsockopt(zmq.RCVHWM, 100_000)
    sock.bind(f"tcp://127.0.0.1:{port}")
    for _ in range(3):  # one per round: the count announced, the pages, then "done"
        peer, total = sock.recv_multipart()
        for _ in range(int(total)):
            sock.recv_multipart(copy=False)
        sock.send_multipart([peer, b"done"])


def raw_send(port: int, page: bytes, count: int) -> float:
    sock: zmq.Socket[Any] = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, 100_000)
    sock.connect(f"tcp://127.0.0.1:{port}")
    header = b"x" * 200  # about the size of a checkpoint header
    best = float("inf")
    for _ in range(3):
        sock.send(str(count).encode())
        start = time.perf_counter()
        for _ in range(count):
            sock.send_multipart([header, page], copy=False)
        sock.recv()
        best = min(best, time.perf_counter() - start)
    sock.close()
    return best


def lumen_send(port: int, layout: PageLayout, page: bytes, count: int) -> tuple[float, int]:
    # ZeroMQ learns of the reads at the other end in batches of half the high-water mark, so
    # a queue of `count` pages needs twice that to be sure none is dropped.
    streamer = CheckpointStreamer(f"tcp://127.0.0.1:{port}", layout, sndhwm=2 * count + 16)
    assert streamer.wait_connected(10)
    best, dropped = float("inf"), 0
    for attempt in range(3):
        ckpt = f"bench-{attempt}"
        start = time.perf_counter()
        for i in range(count):
            streamer.put_block(ckpt_id=ckpt, request_id=ckpt, worker="w0", block_index=i,
                               block_hash=i.to_bytes(8, "big") + b"\1" * 24, page=page,
                               token_count=16 * (i + 1))
        progress = streamer.wait_acks(ckpt, 120)
        best = min(best, time.perf_counter() - start)
        dropped += progress.dropped + (progress.sent - progress.reached)
        streamer.finish(ckpt)
    streamer.close()
    return best, dropped


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--total-mib", type=int, default=256)
    parser.add_argument("--pages-kib", default="64,1024,4096")
    args = parser.parse_args()
    total = args.total_mib << 20
    ctx = mp.get_context("spawn")
    rows = []
    for kib in (int(x) for x in args.pages_kib.split(",")):
        nbytes = kib << 10
        count = max(1, total // nbytes)
        page = bytes(nbytes)
        layout = PageLayout(model="bench", layout_fingerprint="fp", dtype="uint8",
                            page_shape=(nbytes,))
        raw_port, holder_port = free_ports(2)
        receiver = ctx.Process(target=run_raw_receiver, args=(raw_port,))
        holder = ctx.Process(target=run_holder, args=(holder_port, 2 * total))
        receiver.start()
        holder.start()
        try:
            raw_s = raw_send(raw_port, page, count)
            lumen_s, dropped = lumen_send(holder_port, layout, page, count)
        finally:
            for proc in (receiver, holder):
                proc.terminate()
                proc.join(10)
        gb = count * nbytes / 1e9
        rows.append((kib, count, gb / raw_s, gb / lumen_s, 100 * raw_s / lumen_s, dropped))

    print(f"checkpoint streaming over loopback, {args.total_mib} MiB per run, best of 3")
    print(f"{'page':>9} {'pages':>6} {'raw zmq GB/s':>13} {'streamer GB/s':>14} "
          f"{'of raw':>7} {'dropped':>8}")
    for kib, count, raw, lumen, share, dropped in rows:
        print(f"{kib:>6}KiB {count:>6} {raw:>13.2f} {lumen:>14.2f} {share:>6.0f}% {dropped:>8}")


if __name__ == "__main__":
    main()

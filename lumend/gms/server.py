"""The GMS server: one process per worker that owns the weight memory.

Engines come and go; the allocations stay here, so a shadow (or a restarted engine) maps
the weights in milliseconds instead of loading them again. Run with
`python -m lumend.gms.server --socket PATH` (lumend's supervisor starts it).
"""

from __future__ import annotations

import argparse
import array
import asyncio
import itertools
import logging
import os
import signal
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lumend.failover.lifeline import die_with_supervisor
from lumend.gms.backend import Backend, OutOfMemory, make_backend, round_up
from lumend.gms.cuda_vmm import CudaUnavailable
from lumend.gms.protocol import (
    HEADER,
    MAX_FRAME,
    PROTOCOL_VERSION,
    Allocate,
    Commit,
    Export,
    FrameError,
    Hello,
    Layout,
    PutTensor,
    Request,
    Stats,
    TensorMeta,
    decode_request,
    element_extent,
    encode,
    layout_hash,
)
from lumend.gms.session import Event, GmsState, admits, next_state

log = logging.getLogger("lumend.gms")

DTYPE_SIZES = {
    "float32": 4, "float16": 2, "bfloat16": 2, "float64": 8,
    "float8_e4m3fn": 1, "float8_e5m2": 1, "bool": 1,
    "int8": 1, "uint8": 1, "int16": 2, "int32": 4, "int64": 8,
    "uint16": 2, "uint32": 4, "uint64": 8,
}


class RequestError(Exception):
    """A well-formed request that cannot be served; answered with `ok: false`."""


@dataclass
class Allocation:
    id: int
    tag: str
    size: int
    fd: int


@dataclass(eq=False)
class Session:
    id: int
    role: str | None = None  # "writer" or "reader" once admitted


@dataclass
class Counters:
    commits: int = 0
    aborts: int = 0
    writer_sessions: int = 0
    reader_sessions: int = 0
    bad_frames: int = 0
    allocation_retries: int = 0
    started_at: float = field(default_factory=time.time)


class GmsServer:
    def __init__(self, path: Path, backend: Backend, alloc_timeout_s: float = 10.0) -> None:
        self.path = path
        self.backend = backend
        self.alloc_timeout_s = alloc_timeout_s
        self.state = GmsState.EMPTY
        self.allocations: dict[int, Allocation] = {}
        self.tensors: dict[str, TensorMeta] = {}
        self.layout_hash: str | None = None
        self.writer: Session | None = None
        self.readers: set[Session] = set()
        self.counters = Counters()
        self._changed = asyncio.Condition()
        self._ids = itertools.count(1)
        self._sessions = itertools.count(1)
        self._listener: socket.socket | None = None
        self._sent_once: set[int] = set()  # fds to close once their reply has gone

    # -- lifecycle ------------------------------------------------------------------------

    def bind(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if self.path.exists():
            probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                probe.connect(str(self.path))
            except OSError:
                self.path.unlink()  # left behind by a dead server
            else:
                raise RuntimeError(f"another GMS server is serving {self.path}")
            finally:
                probe.close()
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(str(self.path))
        os.chmod(self.path, 0o660)
        listener.listen(64)
        listener.setblocking(False)
        self._listener = listener

    async def serve_forever(self) -> None:
        assert self._listener is not None, "bind() first"
        loop = asyncio.get_running_loop()
        tasks: set[asyncio.Task[None]] = set()
        while True:
            conn, _ = await loop.sock_accept(self._listener)
            conn.setblocking(False)
            task = asyncio.create_task(self._serve_session(conn))
            tasks.add(task)
            task.add_done_callback(tasks.discard)

    def close(self) -> None:
        if self._listener is not None:
            self._listener.close()
            self._listener = None
        for alloc in self.allocations.values():
            self.backend.free(alloc.fd)
        self.allocations.clear()

    # -- one connection -----------------------------------------------------------------

    async def _serve_session(self, conn: socket.socket) -> None:
        session = Session(next(self._sessions))
        try:
            while True:
                payload = await _read_frame(conn)
                request = decode_request(payload)
                reply, fds = await self._handle(session, request)
                try:
                    await _send(conn, reply, fds)
                finally:
                    for fd in fds:
                        if fd in self._sent_once:  # made for this reply only
                            self._sent_once.discard(fd)
                            os.close(fd)
        except FrameError as exc:
            self.counters.bad_frames += 1
            log.warning("GMS session %d: %s; closing it", session.id, exc)
        except (ConnectionError, OSError):
            pass
        finally:
            conn.close()
            await self._leave(session)

    async def _handle(self, session: Session, request: Request) -> tuple[dict[str, Any],
                                                                          list[int]]:
        try:
            if isinstance(request, Hello):
                return await self._hello(session, request), []
            if isinstance(request, Stats):  # monitoring needs no session
                return self._stats(request), []
            if session.role is None:
                raise FrameError(f"{type(request).__name__} before hello")
            if isinstance(request, Allocate):
                return await self._allocate(session, request), []
            if isinstance(request, Export):
                return self._export(session, request)
            if isinstance(request, PutTensor):
                return self._put_tensor(session, request), []
            if isinstance(request, Commit):
                return await self._commit(session, request), []
            return self._layout(session, request), []
        except RequestError as exc:
            return {"id": request.id, "ok": False, "error": str(exc)}, []

    # -- operations -----------------------------------------------------------------------

    async def _hello(self, session: Session, req: Hello) -> dict[str, Any]:
        if req.version != PROTOCOL_VERSION:
            raise FrameError(f"protocol version {req.version} is not {PROTOCOL_VERSION}")
        if session.role is not None:
            raise RequestError("hello was already answered on this connection")
        async with self._changed:
            try:
                granted = await asyncio.wait_for(
                    self._changed.wait_for(lambda: admits(self.state, req.role) is not None),
                    timeout=req.timeout_s,
                )
            except TimeoutError:
                raise RequestError(
                    f"timed out after {req.timeout_s} s waiting to join as {req.role} "
                    f"(GMS state {self.state.value})"
                ) from None
            role = admits(self.state, req.role)
            assert granted and role is not None
            if role == "writer":
                self._transition(Event.WRITER_JOINS)
                self.writer = session
                self.counters.writer_sessions += 1
            else:
                self._transition(Event.READER_JOINS)
                self.readers.add(session)
                self.counters.reader_sessions += 1
            session.role = role
            self._changed.notify_all()
        return {"id": req.id, "ok": True, "role": role, "state": self.state.value,
                "layout_hash": self.layout_hash, "backend": self.backend.name}

    async def _allocate(self, session: Session, req: Allocate) -> dict[str, Any]:
        self._require_writer(session)
        if req.size <= 0:
            raise RequestError(f"allocation size must be positive, got {req.size}")
        size = round_up(req.size, self.backend.granularity())
        deadline = time.monotonic() + self.alloc_timeout_s
        while True:
            try:
                fd = self.backend.allocate(size, req.tag)
                break
            except OutOfMemory as exc:
                # Memory of an engine that was just killed is released a moment later.
                if time.monotonic() >= deadline:
                    raise RequestError(
                        f"could not allocate {size} bytes within {self.alloc_timeout_s} s: "
                        f"{exc}") from None
                self.counters.allocation_retries += 1
                await asyncio.sleep(0.05)
        alloc = Allocation(next(self._ids), req.tag, size, fd)
        self.allocations[alloc.id] = alloc
        return {"id": req.id, "ok": True, "allocation": alloc.id, "size": size}

    def _export(self, session: Session, req: Export) -> tuple[dict[str, Any], list[int]]:
        alloc = self.allocations.get(req.allocation)
        if alloc is None:
            raise RequestError(f"no allocation {req.allocation}")
        writable = session.role == "writer"
        fd = alloc.fd
        if not writable:
            reader_fd = self.backend.reader_fd(alloc.fd)
            if reader_fd is not None:
                fd = reader_fd
                self._sent_once.add(fd)
        return {"id": req.id, "ok": True, "allocation": alloc.id, "size": alloc.size,
                "tag": alloc.tag, "writable": writable}, [fd]

    def _put_tensor(self, session: Session, req: PutTensor) -> dict[str, Any]:
        self._require_writer(session)
        t = req.tensor
        alloc = self.allocations.get(t.allocation)
        if alloc is None:
            raise RequestError(f"tensor {t.name!r}: no allocation {t.allocation}")
        itemsize = DTYPE_SIZES.get(t.dtype)
        if itemsize is None:
            raise RequestError(f"tensor {t.name!r}: unknown dtype {t.dtype!r}")
        if any(dim < 0 for dim in t.shape) or any(s < 0 for s in t.stride or []):
            raise RequestError(f"tensor {t.name!r}: negative dimension or stride in "
                               f"{t.shape} / {t.stride}")
        try:
            nbytes = itemsize * element_extent(t.shape, t.stride)
        except ValueError as exc:
            raise RequestError(f"tensor {t.name!r}: {exc}") from None
        if t.offset < 0 or t.offset + nbytes > alloc.size:
            raise RequestError(
                f"tensor {t.name!r} ({nbytes} bytes at offset {t.offset}) does not fit in "
                f"allocation {alloc.id} of {alloc.size} bytes")
        self.tensors[t.name] = t
        return {"id": req.id, "ok": True}

    async def _commit(self, session: Session, req: Commit) -> dict[str, Any]:
        self._require_writer(session)
        async with self._changed:
            self.layout_hash = layout_hash(
                {a.id: (a.tag, a.size) for a in self.allocations.values()},
                list(self.tensors.values()),
            )
            self._transition(Event.COMMIT)
            self.writer = None
            self.readers.add(session)
            session.role = "reader"
            self.counters.commits += 1
            self._changed.notify_all()
        log.info("GMS layout committed: %d allocations, %d tensors, %d bytes, hash %s",
                 len(self.allocations), len(self.tensors),
                 sum(a.size for a in self.allocations.values()), self.layout_hash[:12])
        return {"id": req.id, "ok": True, "layout_hash": self.layout_hash}

    def _layout(self, session: Session, req: Layout) -> dict[str, Any]:
        return {
            "id": req.id, "ok": True, "state": self.state.value, "layout_hash": self.layout_hash,
            "allocations": {str(a.id): {"tag": a.tag, "size": a.size}
                            for a in self.allocations.values()},
            "tensors": [_tensor_dict(t) for t in self.tensors.values()],
        }

    def _stats(self, req: Stats) -> dict[str, Any]:
        c = self.counters
        return {
            "id": req.id, "ok": True, "state": self.state.value, "backend": self.backend.name,
            "readers": len(self.readers), "writer": self.writer is not None,
            "allocations": len(self.allocations),
            "bytes": sum(a.size for a in self.allocations.values()),
            "commits": c.commits, "aborts": c.aborts, "writer_sessions": c.writer_sessions,
            "reader_sessions": c.reader_sessions, "bad_frames": c.bad_frames,
            "allocation_retries": c.allocation_retries, "pid": os.getpid(),
        }

    # -- state ----------------------------------------------------------------------------

    async def _leave(self, session: Session) -> None:
        async with self._changed:
            if session is self.writer:
                self.writer = None
                self._transition(Event.WRITER_LEAVES)
                for alloc in self.allocations.values():
                    self.backend.free(alloc.fd)
                self.allocations.clear()
                self.tensors.clear()
                self.layout_hash = None
                self.counters.aborts += 1
                log.warning("GMS writer left before commit: its layout was aborted")
            elif session in self.readers:
                self.readers.discard(session)
                self._transition(Event.READER_LEAVES if self.readers
                                 else Event.LAST_READER_LEAVES)
            self._changed.notify_all()

    def _transition(self, event: Event) -> None:
        self.state = next_state(self.state, event)

    def _require_writer(self, session: Session) -> None:
        if session is not self.writer:
            raise RequestError("only the writer may do this, before it commits")


def _tensor_dict(t: TensorMeta) -> dict[str, Any]:
    return {"name": t.name, "allocation": t.allocation, "offset": t.offset,
            "shape": list(t.shape), "dtype": t.dtype, "stride": t.stride, "kind": t.kind}


async def _read_frame(conn: socket.socket) -> bytes:
    loop = asyncio.get_running_loop()
    header = await _read_exact(loop, conn, HEADER.size)
    (length,) = HEADER.unpack(header)
    if length > MAX_FRAME:
        raise FrameError(f"frame of {length} bytes exceeds the {MAX_FRAME}-byte limit")
    return await _read_exact(loop, conn, length)


async def _read_exact(loop: asyncio.AbstractEventLoop, conn: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = await loop.sock_recv(conn, n - len(data))
        if not chunk:
            raise ConnectionError("peer closed")
        data += chunk
    return data


async def _send(conn: socket.socket, reply: dict[str, Any], fds: list[int]) -> None:
    data = encode(reply)
    if not fds:
        await asyncio.get_running_loop().sock_sendall(conn, data)
        return
    ancillary = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))]
    while True:
        try:
            sent = conn.sendmsg([data], ancillary)
            break
        except BlockingIOError:
            await asyncio.sleep(0.001)
    if sent < len(data):  # the fd went with the first bytes; the rest is plain data
        await asyncio.get_running_loop().sock_sendall(conn, data[sent:])


async def _main(args: argparse.Namespace, backend: Backend) -> None:
    server = GmsServer(Path(args.socket), backend, args.alloc_timeout)
    server.bind()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    log.info("GMS server (%s backend) on %s, pid %d", args.backend, args.socket, os.getpid())
    serving = asyncio.create_task(server.serve_forever())
    await stop.wait()
    serving.cancel()
    server.close()


def main() -> None:
    die_with_supervisor()
    parser = argparse.ArgumentParser(description="LUMEN GPU Memory Service server")
    parser.add_argument("--socket", required=True, help="unix socket path")
    parser.add_argument("--backend", default="host", choices=["host", "cuda"],
                        help="host: memfd pages (any Linux); cuda: GPU memory (lumen-serving[gpu])")
    parser.add_argument("--device", type=int, default=0,
                        help="CUDA device ordinal for the cuda backend (default 0)")
    parser.add_argument("--alloc-timeout", type=float, default=10.0,
                        help="seconds an allocation retries while the device is full")
    parser.add_argument("--log-level", default="INFO")
    args = parser.parse_args()
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        backend = make_backend(args.backend, args.device)
    except CudaUnavailable as exc:
        parser.exit(2, f"lumend gms-server: {exc}\n")
    asyncio.run(_main(args, backend))


if __name__ == "__main__":
    main()

"""GMS client for engines: join as writer or reader, allocate, map, publish, read layouts.

Blocking and small on purpose: engines talk to GMS at start-up and on wake, never on the
decode path. The connection is the session: closing it (or dying) leaves the session.
"""

from __future__ import annotations

import mmap
import os
import socket
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from lumend.gms.protocol import (
    PROTOCOL_VERSION,
    Allocate,
    Commit,
    Export,
    FrameError,
    Hello,
    Layout,
    PutTensor,
    Stats,
    TensorMeta,
    decode_reply,
    layout_hash,
    recv_frame,
    send_frame,
)

if TYPE_CHECKING:
    from lumend.gms.cuda_vmm import CudaDevice, DeviceMapping
    from lumend.gms.host_vmm import HostMapping


class GmsError(Exception):
    """The server refused a request (the message says why)."""


class LayoutMismatch(GmsError):
    """The layout read does not hash to what the writer committed: do not use it."""


@dataclass
class MappedAllocation:
    allocation: int
    size: int
    tag: str
    mem: mmap.mmap


class GmsClient:
    def __init__(self, path: str | os.PathLike[str], connect_timeout_s: float = 5.0) -> None:
        self.path = str(path)
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.settimeout(connect_timeout_s)
        try:
            self._sock.connect(self.path)
        except OSError as exc:
            self._sock.close()
            raise GmsError(f"cannot reach the GMS server at {self.path}: {exc}") from exc
        self._sock.settimeout(None)
        self._next_id = 0
        self.role: str | None = None
        self.layout_hash: str | None = None
        self.backend: str | None = None  # the server's memory: "host" or "cuda"

    def close(self) -> None:
        self._sock.close()

    def __enter__(self) -> GmsClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- requests -------------------------------------------------------------------------

    def hello(self, role: str = "auto", timeout_s: float = 30.0) -> str:
        """Join the session lock; returns the role granted ("writer" or "reader")."""
        self._sock.settimeout(timeout_s + 5.0)
        try:
            reply = self._call(Hello(id=self._id(), version=PROTOCOL_VERSION, role=role,  # type: ignore[arg-type]
                                     timeout_s=timeout_s))
        finally:
            self._sock.settimeout(None)
        self.role = str(reply["role"])
        self.layout_hash = reply.get("layout_hash")
        self.backend = str(reply.get("backend", "host"))
        return self.role

    def allocate(self, tag: str, size: int) -> tuple[int, int]:
        reply = self._call(Allocate(id=self._id(), tag=tag, size=size))  # type: ignore[arg-type]
        return int(reply["allocation"]), int(reply["size"])

    def export(self, allocation: int) -> tuple[dict[str, Any], int]:
        """The allocation's description and a file descriptor for it (the caller closes it)."""
        reply, fds = self._call_with_fds(Export(id=self._id(), allocation=allocation))
        if len(fds) != 1:
            for fd in fds:
                os.close(fd)
            raise FrameError(f"export of allocation {allocation} came with {len(fds)} fds")
        return reply, fds[0]

    def map(self, allocation: int) -> MappedAllocation:
        """Map a host-backend allocation: read-write for the writer, read-only for readers."""
        if self.backend == "cuda":
            raise GmsError(f"GMS at {self.path} holds GPU memory (cuda backend): map it with "
                           "map_device(), not map()")
        reply, fd = self.export(allocation)
        try:
            writable = bool(reply["writable"])
            prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
            mem = mmap.mmap(fd, int(reply["size"]), flags=mmap.MAP_SHARED, prot=prot)
        finally:
            os.close(fd)  # the mapping keeps the memory; the fd is not needed any more
        return MappedAllocation(allocation, int(reply["size"]), str(reply["tag"]), mem)

    def map_device(self, allocation: int, device: CudaDevice) -> DeviceMapping:
        """Map a cuda-backend allocation into `device`'s address space: read-write for the
        writer, read-only for readers (cuMemSetAccess)."""
        from lumend.gms.cuda_vmm import DeviceMapping

        if self.backend != "cuda":
            raise GmsError(f"GMS at {self.path} holds host memory ({self.backend} backend): "
                           "map it with map(), not map_device()")
        reply, fd = self.export(allocation)
        try:
            return DeviceMapping(device, allocation, int(reply["size"]), str(reply["tag"]),
                                 fd, writable=bool(reply["writable"]))
        finally:
            os.close(fd)  # the imported handle keeps the memory

    def map_fixed(self, allocation: int) -> HostMapping:
        """Map a host-backend allocation at an address that survives unmap/remap (the CPU
        twin of map_device): read-write for the writer, PROT_READ for readers."""
        from lumend.gms.host_vmm import HostMapping

        if self.backend == "cuda":
            raise GmsError(f"GMS at {self.path} holds GPU memory (cuda backend): map it with "
                           "map_device(), not map_fixed()")
        reply, fd = self.export(allocation)
        try:
            return HostMapping(allocation, int(reply["size"]), str(reply["tag"]), fd,
                               writable=bool(reply["writable"]))
        finally:
            os.close(fd)  # the mapping keeps the memory

    def remap(self, mapping: DeviceMapping | HostMapping) -> None:
        """Map `mapping`'s allocation again at its reserved address (after an unmap), with
        the access this session is granted."""
        reply, fd = self.export(mapping.allocation)
        try:
            if int(reply["size"]) != mapping.size:
                raise LayoutMismatch(
                    f"GMS allocation {mapping.allocation} is {reply['size']} bytes now, was "
                    f"{mapping.size}: the layout changed while this engine slept")
            mapping.remap(fd, writable=bool(reply["writable"]))
        finally:
            os.close(fd)

    remap_device = remap

    def put_tensor(self, tensor: TensorMeta) -> None:
        self._call(PutTensor(id=self._id(), tensor=tensor))

    def commit(self) -> str:
        reply = self._call(Commit(id=self._id()))
        self.role = "reader"
        self.layout_hash = str(reply["layout_hash"])
        return self.layout_hash

    def layout(self) -> tuple[dict[int, tuple[str, int]], list[TensorMeta], str | None]:
        """Allocations, tensors and the committed hash, verified against each other."""
        reply = self._call(Layout(id=self._id()))
        allocations = {int(k): (str(v["tag"]), int(v["size"]))
                       for k, v in reply["allocations"].items()}
        tensors = [TensorMeta(**t) for t in reply["tensors"]]
        committed = reply.get("layout_hash")
        if committed is not None and layout_hash(allocations, tensors) != committed:
            raise LayoutMismatch(
                f"GMS layout at {self.path} does not match its committed hash {committed[:12]}"
            )
        return allocations, tensors, committed

    def stats(self) -> dict[str, Any]:
        return self._call(Stats(id=self._id()))

    # -- plumbing -------------------------------------------------------------------------

    def _id(self) -> int:
        self._next_id += 1
        return self._next_id

    def _call(self, request: Any) -> dict[str, Any]:
        reply, fds = self._call_with_fds(request)
        for fd in fds:
            os.close(fd)
        return reply

    def _call_with_fds(self, request: Any) -> tuple[dict[str, Any], list[int]]:
        send_frame(self._sock, request)
        payload, fds = recv_frame(self._sock)
        reply = decode_reply(payload)
        if reply.get("id") != request.id:
            raise FrameError(f"reply id {reply.get('id')} does not answer request {request.id}")
        if not reply.get("ok"):
            for fd in fds:
                os.close(fd)
            raise GmsError(str(reply.get("error", "request refused")))
        return reply, fds

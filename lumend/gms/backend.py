"""GMS memory backends: where allocations live and how they are exported as fds.

`host` keeps allocations in memfd pages (any Linux machine; the sim engine and CPU tests).
`cuda` keeps them in device memory (cuMemCreate, exported as POSIX file descriptors; see
`cuda_vmm`); it needs cuda-python (`lumen-serving[gpu]`) and an NVIDIA driver.
"""

from __future__ import annotations

import errno
import os
from typing import Protocol

from lumend.gms.cuda_vmm import CudaDevice, CudaOutOfMemory, HandleTable, close_quietly

PAGE = os.sysconf("SC_PAGE_SIZE")


class OutOfMemory(Exception):
    """The backend has no room now; the server retries until its allocation timeout."""


class Backend(Protocol):
    name: str

    def granularity(self) -> int: ...

    def allocate(self, size: int, tag: str) -> int:
        """Create an allocation of `size` bytes; return an fd that can be exported."""
        ...

    def free(self, fd: int) -> None: ...

    def reader_fd(self, fd: int) -> int | None:
        """A new fd for `fd`'s memory that lets readers map it read-only and nothing more
        (the caller closes it), or None when access is granted per mapping instead."""
        ...


class HostBackend:
    name = "host"

    def granularity(self) -> int:
        return PAGE

    def allocate(self, size: int, tag: str) -> int:
        try:
            fd = os.memfd_create(f"lumen-gms-{tag}", os.MFD_CLOEXEC)
        except OSError as exc:
            if exc.errno in (errno.ENOMEM, errno.EMFILE, errno.ENFILE):
                raise OutOfMemory(str(exc)) from exc
            raise
        try:
            os.ftruncate(fd, size)
        except OSError as exc:
            os.close(fd)
            if exc.errno in (errno.ENOMEM, errno.ENOSPC, errno.EFBIG):
                raise OutOfMemory(str(exc)) from exc
            raise
        return fd

    def free(self, fd: int) -> None:
        os.close(fd)

    def reader_fd(self, fd: int) -> int | None:
        # A read-only open of the memfd: a reader cannot map it writable, nor mprotect a
        # read-only mapping to writable (EACCES), so its PROT_READ is not just a default.
        return os.open(f"/proc/self/fd/{fd}", os.O_RDONLY | os.O_CLOEXEC)


class CudaBackend:
    """Device memory of one GPU. The server only creates and exports allocations; it
    never maps them (clients do), so it holds no CUDA context of its own."""

    name = "cuda"

    def __init__(self, device: int = 0) -> None:
        self.device = CudaDevice(device)  # raises CudaUnavailable with what to do
        self.handles = HandleTable()

    def granularity(self) -> int:
        return self.device.granularity()

    def allocate(self, size: int, tag: str) -> int:
        try:
            handle = self.device.create(size)
        except CudaOutOfMemory as exc:
            raise OutOfMemory(str(exc)) from exc
        try:
            fd = self.device.export_fd(handle)
        except BaseException:
            self.device.release(handle)
            raise
        self.handles.add(fd, handle, size)
        return fd

    def free(self, fd: int) -> None:
        handle, _size = self.handles.pop(fd)
        close_quietly(fd)
        # Importers hold their own references: the memory goes when the last one unmaps.
        self.device.release(handle)

    def reader_fd(self, fd: int) -> int | None:
        return None  # the importer sets read-only access per mapping (cuMemSetAccess)


def make_backend(name: str, device: int = 0) -> Backend:
    if name == "host":
        return HostBackend()
    if name == "cuda":
        return CudaBackend(device)
    raise ValueError(f"unknown GMS backend {name!r}; use 'host' or 'cuda'")


def round_up(size: int, granularity: int) -> int:
    return -(-size // granularity) * granularity

"""GMS memory backends: where allocations live and how they are exported as fds.

`host` keeps allocations in memfd pages (any Linux machine; the sim engine and CPU tests).
`cuda` (cuMemCreate with POSIX-fd handles) is not written yet: see the engines issue.
"""

from __future__ import annotations

import errno
import os
from typing import Protocol

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


def make_backend(name: str) -> Backend:
    if name == "host":
        return HostBackend()
    if name == "cuda":
        raise NotImplementedError(
            "the cuda GMS backend is not available in this build; use backend 'host'"
        )
    raise ValueError(f"unknown GMS backend {name!r}; use 'host'")


def round_up(size: int, granularity: int) -> int:
    return -(-size // granularity) * granularity

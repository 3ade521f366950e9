"""Host memory mapped the way `cuda_vmm` maps GPU memory: the CPU twin of `DeviceMapping`.

An address range is reserved first (an anonymous PROT_NONE mapping), then the GMS memfd is
mapped into it with MAP_FIXED, read-only for readers (PROT_READ) or read-write for the
writer. Unmapping puts a PROT_NONE reservation back over the same range, so the weights'
pages leave the process but the addresses stay taken; remapping maps the memfd there again.
A write through a read-only mapping is a SIGSEGV, and any access while unmapped is one too:
the CPU faults where a GPU would (an MMU fault), which is what lets CPU tests catch an engine
writing into shared weights.
"""

from __future__ import annotations

import ctypes
import mmap
import os
from typing import Any

from lumend.gms.cuda_vmm import MapState, next_map_state

# Linux values (x86-64 and arm64 alike); Python's mmap module does not export them.
MAP_FIXED = 0x10
MAP_NORESERVE = 0x4000
PROT_NONE = 0

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                       ctypes.c_int, ctypes.c_long]
_libc.munmap.restype = ctypes.c_int
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.mprotect.restype = ctypes.c_int
_libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_MAP_FAILED = ctypes.c_void_p(-1).value


class HostMapError(OSError):
    """An mmap/mprotect/munmap call failed; the message names the call and errno."""


def _fail(call: str) -> HostMapError:
    err = ctypes.get_errno()
    return HostMapError(err, f"{call} failed: {os.strerror(err)}")


def _prot(writable: bool) -> int:
    return mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)


def _reservation(va: int | None, size: int) -> int:
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | MAP_NORESERVE
    if va is not None:
        flags |= MAP_FIXED
    got = _libc.mmap(va, size, PROT_NONE, flags, -1, 0)
    if got is None or got == _MAP_FAILED:
        raise _fail(f"mmap(reserve {size} bytes)")
    return int(got)


class HostMapping:
    """One GMS host allocation mapped into this process at an address that survives
    unmap/remap (same interface as `cuda_vmm.DeviceMapping`)."""

    def __init__(self, allocation: int, size: int, tag: str, fd: int,
                 writable: bool) -> None:
        self.allocation = allocation
        self.size = size
        self.tag = tag
        self.writable = writable
        self.va = _reservation(None, size)
        self.state = MapState.UNMAPPED
        try:
            self._attach(fd)
        except BaseException:
            _libc.munmap(self.va, size)
            raise
        self.state = MapState.MAPPED

    def _attach(self, fd: int) -> None:
        got = _libc.mmap(self.va, self.size, _prot(self.writable),
                         mmap.MAP_SHARED | MAP_FIXED, fd, 0)
        if got is None or got == _MAP_FAILED:
            raise _fail(f"mmap(GMS allocation {self.allocation}, fd {fd})")
        if int(got) != self.va:  # MAP_FIXED never moves; guard the invariant anyway
            raise HostMapError(0, f"mmap placed allocation {self.allocation} at {got:#x}, "
                                  f"not its reserved address {self.va:#x}")

    def set_access(self, writable: bool) -> None:
        """Change this process's access (e.g. read-only once the writer has committed)."""
        if self.state is not MapState.MAPPED:
            raise RuntimeError(f"GMS host mapping: cannot set access while {self.state.value}")
        if _libc.mprotect(self.va, self.size, _prot(writable)) != 0:
            raise _fail(f"mprotect(GMS allocation {self.allocation})")
        self.writable = writable

    def unmap(self) -> None:
        """Drop the memfd pages from this process; the address range stays reserved."""
        state = next_map_state(self.state, "unmap")
        _reservation(self.va, self.size)
        self.state = state

    def remap(self, fd: int, writable: bool | None = None) -> None:
        """Map the allocation behind `fd` at the same address again (after `unmap`)."""
        state = next_map_state(self.state, "remap")
        if writable is not None:
            self.writable = writable
        self._attach(fd)
        self.state = state

    def close(self) -> None:
        if self.state is MapState.CLOSED:
            return
        state = next_map_state(self.state, "close")
        if _libc.munmap(self.va, self.size) != 0:
            raise _fail(f"munmap(GMS allocation {self.allocation})")
        self.state = state


def host_tensor_base(mapping: HostMapping) -> Any:
    """A flat uint8 CPU tensor over the mapping's address range (no copy; the same
    address after a remap, so tensors made from it stay valid across sleep and wake)."""
    import torch

    array = (ctypes.c_uint8 * mapping.size).from_address(mapping.va)
    return torch.frombuffer(array, dtype=torch.uint8)

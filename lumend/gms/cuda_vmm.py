"""CUDA virtual memory management for GMS, over cuda-python's driver bindings.

Imported lazily: nothing here touches CUDA until `driver()` is first called, so CPU-only
machines import lumend.gms freely and only the `cuda` backend needs LUMEN's `gpu` extra
(cuda-python; GPU_EXTRA_HINT says how to install it).

The server side creates physical allocations (`cuMemCreate`, pinned device memory that can
be exported as a POSIX file descriptor) and never maps them, so it needs no CUDA context.
Clients import the fd they received over SCM_RIGHTS, reserve a virtual address range, map
the allocation into it and set access: read-write for the writer, read-only for readers.
A mapping can be unmapped while its address range stays reserved, and re-mapped later at
the same address (what an engine's sleep and wake need: CUDA graphs captured against the
weights' addresses stay valid).
"""

from __future__ import annotations

import contextlib
import enum
import importlib
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from lumend import __version__

# pyproject.toml's `gpu` extra (a unit test keeps the two the same).
CUDA_PYTHON_SPEC = "cuda-python>=12.6,<13"
# Never `pip install lumen-serving...` by name: our distribution is not on public indexes,
# so a name lookup there installs whoever registers the name (dependency confusion).
GPU_EXTRA_HINT = (
    "install LUMEN's gpu extra (cuda-python): with the Ansible role, put gpu in "
    "lumend_extras (e.g. [systemd, vllm, gpu]); by hand, the wheel built from the checkout "
    f"(`make wheel`) with the extra: pip install "
    f"'dist/lumen_serving-{__version__}-py3-none-any.whl[gpu]'")
# cuda-python's driver bindings: 12.6 and newer, then older 12.x.
BINDINGS_MODULES = ("cuda.bindings.driver", "cuda.cuda")

_driver: Any = None


class CudaUnavailable(RuntimeError):
    """No usable CUDA here: cuda-python missing, no driver, or no such device."""


class CudaPythonMissing(CudaUnavailable):
    """cuda-python (LUMEN's gpu extra) is not installed at all."""


class CudaError(RuntimeError):
    """A CUDA driver call failed; the message names the call and the driver's reason."""

    def __init__(self, call: str, code: int, name: str, reason: str) -> None:
        super().__init__(f"{call} failed: {name} ({reason})")
        self.call = call
        self.code = code
        self.name = name


class CudaOutOfMemory(CudaError):
    """The device has no room now (the memory of a just-killed engine may come back)."""


def driver() -> Any:
    """cuda-python's driver module, initialised (`cuInit`) once per process."""
    global _driver
    if _driver is not None:
        return _driver
    cu = import_bindings()
    try:
        (result,) = cu.cuInit(0)
    except (OSError, RuntimeError) as exc:  # libcuda.so.1 could not be loaded
        raise _no_driver(exc) from exc
    except Exception as exc:  # bindings that load but do not work (wrong build)
        raise _broken(exc) from exc
    if result != cu.CUresult.CUDA_SUCCESS:
        name, reason = _describe(cu, result)
        if name == "CUDA_ERROR_NO_DEVICE":
            raise CudaUnavailable("no CUDA device is visible to this process (cuInit: "
                                  "CUDA_ERROR_NO_DEVICE); check CUDA_VISIBLE_DEVICES and "
                                  "`nvidia-smi`, or use the GMS backend 'host'")
        raise CudaUnavailable(f"no CUDA driver usable here: cuInit failed with {name} "
                              f"({reason}); check `nvidia-smi`, or use the GMS backend 'host'")
    _driver = cu
    return cu


def import_bindings(import_module: Callable[[str], Any] = importlib.import_module) -> Any:
    """cuda-python's driver bindings, or CudaUnavailable saying which fix applies
    (CudaPythonMissing when cuda-python is not installed). `import_module`: how a module is
    imported (tests pass a fake)."""
    for module in BINDINGS_MODULES:
        try:
            return import_module(module)
        except ModuleNotFoundError as exc:
            if exc.name is not None and module.startswith(exc.name):
                continue  # this layout is not installed: try the other one
            raise _broken(exc) from exc
        except (OSError, RuntimeError) as exc:
            raise _no_driver(exc) from exc
        except Exception as exc:  # ImportError of a symbol, AttributeError, a bad build...
            raise _broken(exc) from exc
    raise CudaPythonMissing(
        f"the GMS cuda backend needs cuda-python, which is not installed: "
        f"{GPU_EXTRA_HINT}, or use the GMS backend 'host'")


def _broken(exc: BaseException) -> CudaUnavailable:
    first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return CudaUnavailable(
        f"cuda-python is installed but does not work here ({type(exc).__name__}: "
        f"{first_line}); reinstall a build that matches this driver and Python: "
        f"pip install --force-reinstall '{CUDA_PYTHON_SPEC}' in lumend's virtualenv (the gpu "
        f"extra's pin; check `nvidia-smi` for the driver's CUDA version), or use the GMS "
        f"backend 'host'")


def _no_driver(exc: BaseException) -> CudaUnavailable:
    first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return CudaUnavailable(
        f"no CUDA driver: the NVIDIA driver library (libcuda.so.1) could not be loaded "
        f"({first_line}); install the NVIDIA driver on this host, or use the GMS backend "
        f"'host'")


def _describe(cu: Any, result: Any) -> tuple[str, str]:
    name = getattr(result, "name", str(result))
    err, text = cu.cuGetErrorString(result)
    if err == cu.CUresult.CUDA_SUCCESS and text:
        return name, text.decode() if isinstance(text, bytes) else str(text)
    return name, "no description"


def _check(cu: Any, result: Any, call: str) -> None:
    if result == cu.CUresult.CUDA_SUCCESS:
        return
    name, reason = _describe(cu, result)
    kind = CudaOutOfMemory if name == "CUDA_ERROR_OUT_OF_MEMORY" else CudaError
    raise kind(call, int(result), name, reason)


class CudaDevice:
    """The VMM calls GMS needs, for one device ordinal."""

    def __init__(self, ordinal: int) -> None:
        cu = driver()
        err, count = cu.cuDeviceGetCount()
        _check(cu, err, "cuDeviceGetCount")
        if not 0 <= ordinal < int(count):
            raise CudaUnavailable(f"CUDA device {ordinal} does not exist: this process sees "
                                  f"{int(count)} device(s); check --device and "
                                  f"CUDA_VISIBLE_DEVICES")
        err, self._device = cu.cuDeviceGet(ordinal)
        _check(cu, err, f"cuDeviceGet({ordinal})")
        self.cu = cu
        self.ordinal = ordinal
        self._granularity: int | None = None
        self._context: Any = None

    def _prop(self) -> Any:
        cu = self.cu
        prop = cu.CUmemAllocationProp()
        prop.type = cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        prop.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        prop.location.id = self.ordinal
        prop.requestedHandleTypes = (
            cu.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR)
        return prop

    def granularity(self) -> int:
        """Sizes and address ranges are multiples of this (2 MiB on current GPUs)."""
        if self._granularity is None:
            err, value = self.cu.cuMemGetAllocationGranularity(
                self._prop(),
                self.cu.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM)
            _check(self.cu, err, "cuMemGetAllocationGranularity")
            self._granularity = int(value)
        return self._granularity

    def use_primary_context(self) -> None:
        """Make the device's primary context current on this thread (the one PyTorch
        uses)."""
        if self._context is None:
            err, ctx = self.cu.cuDevicePrimaryCtxRetain(self._device)
            _check(self.cu, err, "cuDevicePrimaryCtxRetain")
            self._context = ctx
        (err,) = self.cu.cuCtxSetCurrent(self._context)
        _check(self.cu, err, "cuCtxSetCurrent")

    def ensure_context(self) -> None:
        """Make a context current on this thread unless one already is.

        Reserving, mapping and setting access need a current context on some drivers
        (vLLM's cumem allocator makes one current for the same reason); a fresh process or
        a thread PyTorch never used has none. An existing context (PyTorch's) is kept."""
        err, current = self.cu.cuCtxGetCurrent()
        _check(self.cu, err, "cuCtxGetCurrent")
        if current is None or int(current) == 0:
            self.use_primary_context()

    # -- physical memory (server) ---------------------------------------------------------

    def create(self, size: int) -> int:
        """A physical allocation of `size` bytes (a multiple of the granularity)."""
        if size <= 0 or size % self.granularity():
            raise ValueError(f"allocation size {size} is not a positive multiple of the "
                             f"device granularity {self.granularity()}")
        err, handle = self.cu.cuMemCreate(size, self._prop(), 0)
        if err == self.cu.CUresult.CUDA_ERROR_INVALID_CONTEXT and self._context is None:
            # Some drivers want a current context even for context-free VMM calls.
            self.use_primary_context()
            err, handle = self.cu.cuMemCreate(size, self._prop(), 0)
        _check(self.cu, err, f"cuMemCreate({size})")
        return int(handle)

    def export_fd(self, handle: int) -> int:
        err, fd = self.cu.cuMemExportToShareableHandle(
            handle, self.cu.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
            0)
        _check(self.cu, err, "cuMemExportToShareableHandle")
        return int(fd)

    def release(self, handle: int) -> None:
        (err,) = self.cu.cuMemRelease(handle)
        _check(self.cu, err, "cuMemRelease")

    # -- mapping (clients) ----------------------------------------------------------------

    def import_fd(self, fd: int) -> int:
        """A handle for the allocation behind `fd` (the fd stays open: the caller closes
        it)."""
        self.ensure_context()
        err, handle = self.cu.cuMemImportFromShareableHandle(
            fd, self.cu.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR)
        _check(self.cu, err, "cuMemImportFromShareableHandle")
        return int(handle)

    def reserve(self, size: int) -> int:
        self.ensure_context()
        err, va = self.cu.cuMemAddressReserve(size, self.granularity(), 0, 0)
        _check(self.cu, err, f"cuMemAddressReserve({size})")
        return int(va)

    def free_address(self, va: int, size: int) -> None:
        self.ensure_context()
        (err,) = self.cu.cuMemAddressFree(va, size)
        _check(self.cu, err, "cuMemAddressFree")

    def map(self, va: int, size: int, handle: int) -> None:
        self.ensure_context()
        (err,) = self.cu.cuMemMap(va, size, 0, handle, 0)
        _check(self.cu, err, "cuMemMap")

    def set_access(self, va: int, size: int, writable: bool) -> None:
        self.ensure_context()
        cu = self.cu
        desc = cu.CUmemAccessDesc()
        desc.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        desc.location.id = self.ordinal
        desc.flags = (cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE if writable
                      else cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READ)
        (err,) = cu.cuMemSetAccess(va, size, [desc], 1)
        _check(cu, err, "cuMemSetAccess")

    def unmap(self, va: int, size: int) -> None:
        self.ensure_context()
        (err,) = self.cu.cuMemUnmap(va, size)
        _check(self.cu, err, "cuMemUnmap")

    # -- copies (checks and tools; engines copy with PyTorch) -----------------------------

    def copy_to_device(self, va: int, data: bytes) -> None:
        self.use_primary_context()
        (err,) = self.cu.cuMemcpyHtoD(va, data, len(data))
        _check(self.cu, err, "cuMemcpyHtoD")

    def copy_from_device(self, va: int, size: int) -> bytes:
        self.use_primary_context()
        out = bytearray(size)
        (err,) = self.cu.cuMemcpyDtoH(out, va, size)
        _check(self.cu, err, "cuMemcpyDtoH")
        return bytes(out)


# -- bookkeeping (pure) --------------------------------------------------------------------


@dataclass
class HandleTable:
    """The server's exported allocations: fd -> (driver handle, size).

    The fd is what GMS sends over SCM_RIGHTS; the handle is what must be released.
    """

    _entries: dict[int, tuple[int, int]] = field(default_factory=dict)

    def add(self, fd: int, handle: int, size: int) -> None:
        if fd in self._entries:
            raise ValueError(f"fd {fd} already names GMS allocation handle "
                             f"{self._entries[fd][0]}")
        self._entries[fd] = (handle, size)

    def pop(self, fd: int) -> tuple[int, int]:
        try:
            return self._entries.pop(fd)
        except KeyError:
            raise ValueError(f"fd {fd} is not a GMS allocation of this backend") from None

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def total_bytes(self) -> int:
        return sum(size for _, size in self._entries.values())


class MapState(enum.Enum):
    MAPPED = "mapped"
    UNMAPPED = "unmapped"  # address range still reserved: re-map at the same address
    CLOSED = "closed"


_MAP_TRANSITIONS = {
    (MapState.MAPPED, "unmap"): MapState.UNMAPPED,
    (MapState.UNMAPPED, "remap"): MapState.MAPPED,
    (MapState.MAPPED, "close"): MapState.CLOSED,
    (MapState.UNMAPPED, "close"): MapState.CLOSED,
}


def next_map_state(state: MapState, action: str) -> MapState:
    try:
        return _MAP_TRANSITIONS[(state, action)]
    except KeyError:
        raise RuntimeError(f"GMS device mapping: cannot {action} while "
                           f"{state.value}") from None


class DeviceMapping:
    """One GMS allocation mapped into this process's device address space."""

    def __init__(self, device: CudaDevice, allocation: int, size: int, tag: str,
                 fd: int, writable: bool) -> None:
        self.device = device
        self.allocation = allocation
        self.size = size
        self.tag = tag
        self.writable = writable
        self.va = device.reserve(size)
        self.state = MapState.UNMAPPED
        self._handle: int | None = None
        try:
            self._attach(fd)
        except BaseException:
            device.free_address(self.va, size)
            raise
        self.state = MapState.MAPPED

    def _attach(self, fd: int) -> None:
        handle = self.device.import_fd(fd)
        try:
            self.device.map(self.va, self.size, handle)
            try:
                self.device.set_access(self.va, self.size, self.writable)
            except BaseException:
                self.device.unmap(self.va, self.size)
                raise
        except BaseException:
            self.device.release(handle)
            raise
        self._handle = handle

    def set_access(self, writable: bool) -> None:
        """Change this process's access (e.g. read-only once the writer has committed)."""
        if self.state is not MapState.MAPPED:
            raise RuntimeError(f"GMS device mapping: cannot set access while "
                               f"{self.state.value}")
        self.device.set_access(self.va, self.size, writable)
        self.writable = writable

    def unmap(self) -> None:
        """Drop the physical memory from this process; the address range stays reserved."""
        state = next_map_state(self.state, "unmap")
        self._detach()
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
        if self.state is MapState.MAPPED:
            self._detach()
        self.device.free_address(self.va, self.size)
        self.state = state

    def _detach(self) -> None:
        assert self._handle is not None
        self.device.unmap(self.va, self.size)
        self.device.release(self._handle)
        self._handle = None

    def read(self, offset: int, size: int) -> bytes:
        if self.state is not MapState.MAPPED or offset < 0 or offset + size > self.size:
            raise ValueError(f"cannot read {size} bytes at {offset} of a {self.state.value} "
                             f"mapping of {self.size} bytes")
        return self.device.copy_from_device(self.va + offset, size)

    def write(self, offset: int, data: bytes) -> None:
        if self.state is not MapState.MAPPED or offset < 0 or offset + len(data) > self.size:
            raise ValueError(f"cannot write {len(data)} bytes at {offset} of a "
                             f"{self.state.value} mapping of {self.size} bytes")
        self.device.copy_to_device(self.va + offset, data)


def close_quietly(fd: int) -> None:
    with contextlib.suppress(OSError):
        os.close(fd)

"""A PyTorch module's tensors in GMS: publish them (writer), materialise a module on them
(reader).

Works over either backend: the caller gives a function that turns an allocation id into a
flat uint8 tensor over the mapped bytes (host: an mmap; cuda: a device mapping). Names are
the module's own (`layers.0.mlp.weight`); a tensor reachable under several names (tied
weights) is stored once and re-attached as one object, so the tie survives.

The writer copies chunk by chunk (each chunk its own GMS allocation, allocated only when
the previous one is done) and re-points the module's parameters at the shared copy as it
goes, so their private copies are freed between chunks and the peak stays near the
weights' size plus one chunk. Only parameters are shared: buffers and tensor attributes
are published too, but every process (the writer included) computes with its own copy of
them, so nothing an engine writes at run time lands in shared memory.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from lumend.gms.protocol import TensorKind, TensorMeta, element_extent

log = logging.getLogger("lumend.gms.weights")

ALIGN = 256  # bytes: every tensor starts aligned for any dtype and vectorised kernels
CHUNK_BYTES = 1 << 30

BaseFor = Callable[[int], torch.Tensor]  # allocation id -> flat uint8 tensor over its bytes


class WeightsMismatch(Exception):
    """The GMS layout does not fit this model (another model, dtype or parallel layout)."""


@dataclass(frozen=True)
class Entry:
    """One distinct tensor of a module and every name it is reachable under."""

    names: tuple[tuple[str, TensorKind], ...]
    tensor: torch.Tensor

    @property
    def dtype(self) -> str:
        return dtype_name(self.tensor.dtype)

    @property
    def nbytes(self) -> int:
        stride = None if self.tensor.is_contiguous() else list(self.tensor.stride())
        return element_extent(list(self.tensor.shape), stride) * self.tensor.element_size()


@dataclass(frozen=True)
class Placement:
    chunk: int
    offset: int


@dataclass
class Plan:
    placements: list[Placement]
    chunk_sizes: list[int] = field(default_factory=list)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def torch_dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise WeightsMismatch(f"GMS tensor dtype {name!r} is not a torch dtype")
    return dtype


def align_up(n: int, align: int = ALIGN) -> int:
    return -(-n // align) * align


def plan_chunks(sizes: Iterable[int], chunk_bytes: int = CHUNK_BYTES,
                align: int = ALIGN) -> Plan:
    """Place tensors of `sizes` bytes, in order, into chunks of at most `chunk_bytes`
    (a bigger tensor gets a chunk of its own); every offset is `align`-aligned."""
    plan = Plan([])
    used = 0
    for size in sizes:
        if size < 0:
            raise ValueError(f"tensor size {size} is negative")
        start = align_up(used, align)
        if not plan.chunk_sizes or (used and start + size > chunk_bytes):
            plan.chunk_sizes.append(0)
            start = 0
        plan.placements.append(Placement(len(plan.chunk_sizes) - 1, start))
        used = start + size
        plan.chunk_sizes[-1] = max(align_up(used, align), align)
    return plan


def collect(module: nn.Module) -> list[Entry]:
    """Every tensor the module computes with: parameters, buffers and plain tensor
    attributes of its submodules, each distinct tensor once with all its names."""
    by_id: dict[int, tuple[list[tuple[str, TensorKind]], torch.Tensor]] = {}
    order: list[int] = []

    def add(name: str, kind: TensorKind, t: torch.Tensor) -> None:
        if id(t) not in by_id:
            by_id[id(t)] = ([], t)
            order.append(id(t))
        by_id[id(t)][0].append((name, kind))

    for name, p in module.named_parameters(remove_duplicate=False):
        add(name, "param", p)
    for name, b in module.named_buffers(remove_duplicate=False):
        if b is not None:
            add(name, "buffer", b)
    for prefix, sub in module.named_modules(remove_duplicate=False):
        for attr, value in vars(sub).items():
            if isinstance(value, torch.Tensor) and not isinstance(value, nn.Parameter):
                add(f"{prefix}.{attr}" if prefix else attr, "attr", value)
    return [Entry(tuple(by_id[i][0]), by_id[i][1]) for i in order]


def view_of(base: torch.Tensor, meta: TensorMeta) -> torch.Tensor:
    """The tensor `meta` describes, over the flat bytes of its allocation."""
    dtype = torch_dtype(meta.dtype)
    itemsize = torch.empty((), dtype=dtype).element_size()
    nbytes = element_extent(list(meta.shape), meta.stride) * itemsize
    if meta.offset < 0 or meta.offset + nbytes > base.numel():
        raise WeightsMismatch(f"GMS tensor {meta.name!r} ({nbytes} bytes at {meta.offset}) "
                              f"lies outside its allocation of {base.numel()} bytes")
    raw = base[meta.offset: meta.offset + nbytes].view(dtype)
    if meta.stride is None:
        return raw.view(list(meta.shape))
    return raw.as_strided(list(meta.shape), list(meta.stride))


def publish(client: Any, module: nn.Module, base_for: BaseFor, *, tag: str = "weights",
            chunk_bytes: int = CHUNK_BYTES,
            after_chunk: Callable[[], None] | None = None) -> int:
    """Copy the module's tensors into GMS (the client must be the writer) and describe
    them; the caller commits. Returns the bytes published.

    One chunk at a time: allocate it, copy its tensors, re-point the module's parameters
    at the shared copy and drop every reference to their private originals before the
    next chunk is allocated, so the peak stays near the weights plus one chunk (call
    `after_chunk`, e.g. `torch.cuda.empty_cache`, to hand the freed memory back).

    Only parameters are re-pointed. Buffers and plain tensor attributes are published for
    readers to clone, but the module keeps its own: vLLM writes into them (attention
    scales, buffers restored after sleep), and shared memory is read-only once committed.
    """
    pending: list[Entry | None] = list(collect(module))
    plan = plan_chunks([e.nbytes for e in pending if e is not None], chunk_bytes)
    members: list[list[int]] = [[] for _ in plan.chunk_sizes]
    for index, place in enumerate(plan.placements):
        members[place.chunk].append(index)
    total = 0
    for chunk, indices in enumerate(members):
        allocation, _ = client.allocate(tag, plan.chunk_sizes[chunk])
        base = base_for(allocation)
        for index in indices:
            entry, pending[index] = pending[index], None
            assert entry is not None
            total += _publish_entry(client, module, entry, base, allocation,
                                    plan.placements[index].offset)
            del entry  # the parameter's private original goes with the last reference
        del base
        if after_chunk is not None:
            after_chunk()
    log.info("published %d tensors (%d bytes) in %d GMS allocations", len(pending), total,
             len(members))
    return total


def _publish_entry(client: Any, module: nn.Module, entry: Entry, base: torch.Tensor,
                   allocation: int, offset: int) -> int:
    t = entry.tensor
    stride = None if t.is_contiguous() else list(t.stride())
    first_name, first_kind = entry.names[0]
    shared = view_of(base, TensorMeta(name=first_name, allocation=allocation, offset=offset,
                                      shape=list(t.shape), dtype=entry.dtype, stride=stride,
                                      kind=first_kind))
    with torch.no_grad():
        shared.copy_(t)
    if is_parameter(entry):
        _rebind(module, entry, shared)
    for name, kind in entry.names:
        client.put_tensor(TensorMeta(name=name, allocation=allocation, offset=offset,
                                     shape=list(t.shape), dtype=entry.dtype, stride=stride,
                                     kind=kind))
    return entry.nbytes


def is_parameter(entry: Entry) -> bool:
    return any(kind == "param" for _, kind in entry.names)


def _rebind(module: nn.Module, entry: Entry, shared: torch.Tensor) -> None:
    obj: torch.Tensor = shared
    if any(kind == "param" for _, kind in entry.names):
        obj = nn.Parameter(shared, requires_grad=False)
        if isinstance(entry.tensor, nn.Parameter):
            # Keep vLLM's per-parameter attributes (weight_loader, output_dim, ...).
            for key, value in vars(entry.tensor).items():
                setattr(obj, key, value)
    modules = dict(module.named_modules(remove_duplicate=False))
    for name, kind in entry.names:
        _attach(modules, name, kind, obj)


def _attach(modules: dict[str, nn.Module], name: str, kind: TensorKind,
            obj: torch.Tensor) -> None:
    owner_name, _, leaf = name.rpartition(".")
    owner = modules.get(owner_name)
    if owner is None:
        raise WeightsMismatch(f"GMS tensor {name!r} has no module {owner_name!r} in this "
                              "model: the layout was published by a different model")
    persistent = leaf not in owner._non_persistent_buffers_set
    owner._parameters.pop(leaf, None)
    owner._buffers.pop(leaf, None)
    owner.__dict__.pop(leaf, None)
    if kind == "param":
        if not isinstance(obj, nn.Parameter):
            obj = nn.Parameter(obj, requires_grad=False)
        owner.register_parameter(leaf, obj)
    elif kind == "buffer":
        owner.register_buffer(leaf, obj, persistent=persistent)
    else:
        object.__setattr__(owner, leaf, obj)


def private_clone(shared: torch.Tensor) -> torch.Tensor:
    """This process's own copy of a non-parameter tensor read from GMS."""
    return shared.clone()


def materialize(module: nn.Module, tensors: list[TensorMeta], base_for: BaseFor, *,
                require_complete: bool = True,
                private: Callable[[torch.Tensor], torch.Tensor] = private_clone) -> int:
    """Attach the GMS tensors to `module` (typically built on the meta device), in place.

    Parameters become views of the shared bytes (no copy). Every other tensor (buffers,
    plain tensor attributes) becomes this process's own copy, made by `private` from the
    shared bytes: engines write into those, and writes must never reach shared memory.
    Names that resolve to the same bytes become one object (tied weights stay tied).
    Raises WeightsMismatch when a tensor's shape or dtype differs from the module's, or
    (with `require_complete`) when the module still has tensors GMS did not provide.
    Returns the bytes mapped shared (parameters).
    """
    modules = dict(module.named_modules(remove_duplicate=False))
    expected = {name: t for e in collect(module) for name, _ in e.names for t in [e.tensor]}
    bases: dict[int, torch.Tensor] = {}
    attached: dict[tuple[Any, ...], torch.Tensor] = {}
    shared_bytes = 0
    for meta in tensors:
        want = expected.get(meta.name)
        if want is not None and (list(want.shape) != list(meta.shape)
                                 or dtype_name(want.dtype) != meta.dtype):
            raise WeightsMismatch(
                f"GMS tensor {meta.name!r} is {meta.dtype}{list(meta.shape)} but this model "
                f"wants {dtype_name(want.dtype)}{list(want.shape)}: the engines of one "
                "worker must serve the same model, dtype and parallel layout")
        key = (meta.allocation, meta.offset, meta.dtype, tuple(meta.shape),
               tuple(meta.stride) if meta.stride is not None else None, meta.kind == "param")
        obj = attached.get(key)
        if obj is None:
            if meta.allocation not in bases:
                bases[meta.allocation] = base_for(meta.allocation)
            view = view_of(bases[meta.allocation], meta)
            if meta.kind == "param":
                obj = nn.Parameter(view, requires_grad=False)
                shared_bytes += view.numel() * view.element_size()
            else:
                obj = private(view)
            attached[key] = obj
        if want is not None and isinstance(want, nn.Parameter) and meta.kind == "param":
            for key_attr, value in vars(want).items():  # weight_loader and friends
                if not hasattr(obj, key_attr):
                    setattr(obj, key_attr, value)
        _attach(modules, meta.name, meta.kind, obj)
    missing = missing_tensors(module) if require_complete else []
    if missing:
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more"
                                          if len(missing) > 5 else "")
        raise WeightsMismatch(f"the GMS layout lacks {len(missing)} tensor(s) this model "
                              f"needs ({shown}): it was published by another model or "
                              "version")
    return shared_bytes


def missing_tensors(module: nn.Module) -> list[str]:
    """Names of tensors still on the meta device (nothing backs them)."""
    return [name for e in collect(module) if e.tensor.device.type == "meta"
            for name, _ in e.names]


def host_base(mapped: Any) -> torch.Tensor:
    """A flat uint8 tensor over a host-backend mapping (`GmsClient.map(...).mem`)."""
    import warnings

    with warnings.catch_warnings():
        # A reader's mapping is read-only: torch warns that the buffer is not writable.
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(mapped, dtype=torch.uint8)


class _CudaArray:
    """The CUDA array interface over raw device memory, for torch.as_tensor."""

    def __init__(self, ptr: int, nbytes: int) -> None:
        # PyTorch refuses the interface's read-only flag; a reader's mapping is protected
        # where it counts, by the access the driver granted (cuMemSetAccess, read only).
        self.__cuda_array_interface__ = {
            "shape": (nbytes,), "typestr": "|u1", "data": (ptr, False),
            "version": 3, "strides": None,
        }


def device_base(mapping: Any) -> torch.Tensor:
    """A flat uint8 CUDA tensor over a `DeviceMapping` (no copy; same address after a
    remap, so tensors made from it stay valid across sleep and wake)."""
    array = _CudaArray(mapping.va, mapping.size)
    return torch.as_tensor(array, device=torch.device("cuda", mapping.device.ordinal))

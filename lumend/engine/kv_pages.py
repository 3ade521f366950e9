"""Pages in and out of vLLM's paged KV cache, for LumenConnector (torch only, no vLLM).

A page is one block of every layer of this tensor-parallel rank: layer after layer (sorted
by layer name), each layer's block as its raw bytes. Blocks move in batches: saving gathers
a step's blocks of every layer into one buffer and copies it to the host once; loading copies
a request's fetched pages into one host buffer, moves it once and scatters it into the
layers (one kernel per layer, not one copy per layer per block).

One code path on CPU and CUDA. Only `_CudaCopies` is CUDA-specific: pinned host staging,
a side stream (the engine's stream never waits for a copy to the host) and events. On CPU
the gathered batch is the host buffer, ready at once.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

# Bumped whenever the bytes of a page change meaning (part of the connector's fingerprint,
# so a holder never serves pages of one format to an engine that reads another).
# 1: one page per block of every layer, copied per block. 2: the same bytes, batched.
PAGE_FORMAT = 2
MAX_BATCH_BYTES = 64 << 20  # one gather/scatter at most (a device-side temporary on CUDA)


@dataclass
class StagedPages:
    """Pages on their way to the host: `pages[i]` is block `block_ids[i]`'s page once
    `ready()` (on CUDA the copy runs on a side stream; the batch stays alive until then)."""

    block_ids: list[int]
    pages: torch.Tensor  # (len(block_ids), page_nbytes) uint8 on the host
    _done: Any = None  # torch.cuda.Event, None on CPU
    _device_batch: torch.Tensor | None = None  # kept alive until the copy is done

    def ready(self) -> bool:
        if self._done is None or self._done.query():
            self._device_batch = None
            return True
        return False

    def wait(self) -> None:
        if self._done is not None:
            self._done.synchronize()
        self._device_batch = None

    @property
    def nbytes(self) -> int:
        return self.pages.numel()


class KvPages:
    def __init__(self, layers: Sequence[torch.Tensor], block_dim: int,
                 max_batch_bytes: int = MAX_BATCH_BYTES) -> None:
        if not layers:
            raise ValueError("KvPages needs at least one KV cache layer")
        if any(block_dim >= layer.dim() - 1 for layer in layers):
            raise ValueError(f"KvPages: block dimension {block_dim} must not be a layer's last")
        # Raw words are moved, whatever the KV dtype (fp8 and bf16 included): every device
        # has fast index kernels for int32 (uint8's are slow on CPU).
        self.layers = _as_words(list(layers))
        self.block_dim = block_dim
        self.device = self.layers[0].device
        self.block_shapes = [tuple(layer.select(block_dim, 0).shape) for layer in self.layers]
        sizes = [layer.select(block_dim, 0).numel() * layer.element_size()
                 for layer in self.layers]
        self.offsets = [sum(sizes[:i]) for i in range(len(sizes))]
        self.layer_nbytes = sizes
        self.page_nbytes = sum(sizes)
        self.batch_blocks = max(1, max_batch_bytes // self.page_nbytes)
        self._cuda = _CudaCopies(self.device) if self.device.type == "cuda" else None

    # -- save ---------------------------------------------------------------------------

    def save(self, block_ids: Sequence[int]) -> list[StagedPages]:
        """Start copying these blocks' pages to the host (after the work queued so far on
        the engine's stream, which wrote them). The blocks may be reused once this returns:
        the engine's stream waits (on the device, not the host) until they were read."""
        staged = []
        for start in range(0, len(block_ids), self.batch_blocks):
            ids = list(block_ids[start:start + self.batch_blocks])
            if self._cuda is None:
                staged.append(StagedPages(ids, self._gather(ids)))
            else:
                staged.append(self._cuda.save(self, ids))
        return staged

    def _gather(self, ids: list[int]) -> torch.Tensor:
        """(len(ids), page_nbytes) uint8 on the KV cache's device."""
        index = torch.tensor(ids, dtype=torch.long, device=self.device)
        batch = torch.empty((len(ids), self.page_nbytes), dtype=torch.uint8, device=self.device)
        for layer, view in zip(self.layers, self._layer_views(batch), strict=True):
            # Straight into the page's bytes (one copy, no temporary), strided as it is.
            torch.index_select(layer, self.block_dim, index,
                               out=view.movedim(0, self.block_dim))
        return batch

    def _layer_views(self, batch: torch.Tensor) -> list[torch.Tensor]:
        """Each layer's part of every page in `batch`, as (blocks, *block shape)."""
        views = []
        for layer, offset, nbytes, shape in zip(self.layers, self.offsets, self.layer_nbytes,
                                                self.block_shapes, strict=True):
            part = batch[:, offset:offset + nbytes].view(layer.dtype)
            views.append(part.view(part.shape[0], *shape))
        return views

    # -- load ---------------------------------------------------------------------------

    def load(self, block_ids: Sequence[int], pages: Sequence[Any]) -> None:
        """Write fetched pages (buffers of page_nbytes each) into these blocks, before the
        forward that reads them (on CUDA the engine's stream waits for the copies)."""
        if len(block_ids) != len(pages):
            raise ValueError(f"{len(block_ids)} blocks but {len(pages)} pages")
        for start in range(0, len(block_ids), self.batch_blocks):
            ids = list(block_ids[start:start + self.batch_blocks])
            host = self._host_batch(pages[start:start + self.batch_blocks])
            if self._cuda is None:
                self._scatter(ids, host)
            else:
                self._cuda.load(self, ids, host)

    def _host_batch(self, pages: Sequence[Any]) -> torch.Tensor:
        host = torch.empty((len(pages), self.page_nbytes), dtype=torch.uint8,
                           pin_memory=self._cuda is not None)
        with warnings.catch_warnings():  # read-only buffers (ZeroMQ frames) are only read
            warnings.simplefilter("ignore", UserWarning)
            for row, page in zip(host, pages, strict=True):
                view = memoryview(page)
                if view.nbytes != self.page_nbytes:
                    raise ValueError(f"page of {view.nbytes} bytes; this engine's pages are "
                                     f"{self.page_nbytes}")
                row.copy_(torch.frombuffer(view, dtype=torch.uint8))
        return host

    def _scatter(self, ids: list[int], batch: torch.Tensor) -> None:
        index = torch.tensor(ids, dtype=torch.long, device=self.device)
        for layer, view in zip(self.layers, self._layer_views(batch), strict=True):
            layer.index_copy_(self.block_dim, index, view.movedim(0, self.block_dim))


def _as_words(layers: list[torch.Tensor]) -> list[torch.Tensor]:
    """The layers viewed as the widest integer type that every one of them allows (the
    same bytes; the last dimension counts words then), else as they are."""
    for word in (torch.int32, torch.int16, torch.uint8):
        try:
            return [layer.view(word) for layer in layers]
        except RuntimeError:  # a last dimension of bytes not divisible, or not contiguous
            continue
    return layers


class _CudaCopies:
    """The CUDA-only part: pinned staging and a side stream, ordered against the engine's
    stream by events so that neither side waits on the host."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]

    def save(self, pages: KvPages, ids: list[int]) -> StagedPages:
        engine = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(engine)  # the forward that wrote these blocks
        with torch.cuda.stream(self.stream):
            batch = pages._gather(ids)
            gathered = torch.cuda.Event()  # type: ignore[no-untyped-call]
            gathered.record(self.stream)
            host = torch.empty(batch.shape, dtype=torch.uint8, pin_memory=True)
            host.copy_(batch, non_blocking=True)
            done = torch.cuda.Event()  # type: ignore[no-untyped-call]
            done.record(self.stream)
        engine.wait_event(gathered)  # later work may overwrite the blocks once read
        return StagedPages(ids, host, done, batch)

    def load(self, pages: KvPages, ids: list[int], host: torch.Tensor) -> None:
        engine = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(engine)  # whatever the engine queued on these blocks
        with torch.cuda.stream(self.stream):
            batch = host.to(self.device, non_blocking=True)  # pinned: truly asynchronous
            pages._scatter(ids, batch)
        engine.wait_stream(self.stream)  # the forward reads the loaded blocks

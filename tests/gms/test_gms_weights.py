"""A PyTorch module published into GMS by one process and materialised by others.

The host backend stands in for GPU memory: the same publish/materialise code runs over
mmap'ed bytes here and over device mappings on a GPU (bench/gpu/gms_check.py)."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn

from lumend.gms.client import GmsClient
from lumend.gms.weights import (
    ALIGN,
    WeightsMismatch,
    collect,
    host_base,
    materialize,
    plan_chunks,
    publish,
)

from .conftest import GmsProcess

ROOT = Path(__file__).parents[2]


class Tiny(nn.Module):
    """Tied weights, a non-contiguous parameter, persistent and non-persistent buffers and
    a plain tensor attribute: every way a model keeps tensors."""

    def __init__(self, width: int = 16, vocab: int = 50) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, width)
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=True)
        self.head.weight = self.emb.weight  # tied
        self.proj = nn.Parameter(torch.randn(width // 2, width).t())  # non-contiguous
        self.register_buffer("scale", torch.linspace(0.5, 1.5, width))
        self.register_buffer("shift", torch.full((width,), 0.25), persistent=False)
        self.gate = torch.linspace(-1.0, 1.0, width // 2)  # plain attribute

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.norm(self.emb(ids)) * self.scale + self.shift
        h = h + torch.tanh((h @ self.proj) * self.gate) @ self.proj.t()
        return self.head(h)


IDS = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6]])


def build(seed: int = 0) -> Tiny:
    torch.manual_seed(seed)
    return Tiny()


def reference_output() -> torch.Tensor:
    with torch.no_grad():
        return build()(IDS)


def _base_for(client: GmsClient) -> object:
    return lambda allocation: host_base(client.map(allocation).mem)


def _start_writer(gms: GmsProcess) -> subprocess.Popen[str]:
    script = textwrap.dedent(f"""
        import sys, time
        sys.path.insert(0, {str(ROOT)!r})
        import torch
        from lumend.gms.client import GmsClient
        from lumend.gms.weights import host_base, publish
        from tests.gms.test_gms_weights import IDS, build
        model = build()
        c = GmsClient({str(gms.socket)!r})
        assert c.hello("writer") == "writer"
        publish(c, model, lambda a: host_base(c.map(a).mem), chunk_bytes=4096)
        c.commit()
        with torch.no_grad():  # the writer now computes on the shared copy
            torch.save(model(IDS), sys.argv[1])
        print("ready", flush=True)
        time.sleep(600)
    """)
    out = gms.socket.parent / "writer_out.pt"
    proc = subprocess.Popen([sys.executable, "-c", script, str(out)], stdout=subprocess.PIPE,
                            text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    assert torch.equal(torch.load(out), reference_output())
    return proc


def read_model(gms: GmsProcess) -> tuple[GmsClient, Tiny]:
    client = gms.client()
    assert client.hello("reader", timeout_s=5) == "reader"
    _, tensors, _ = client.layout()
    with torch.device("meta"):
        model = Tiny()
    materialize(model, tensors, _base_for(client))  # type: ignore[arg-type]
    return client, model


def test_reader_materialises_the_writers_module_and_outlives_it(gms: GmsProcess) -> None:
    writer = _start_writer(gms)
    try:
        client, model = read_model(gms)
        with torch.no_grad():
            assert torch.equal(model(IDS), reference_output())
        assert model.head.weight is model.emb.weight, "the tie was lost"
        assert not model.proj.is_contiguous() and model.proj.stride() == (1, 16)
        assert "shift" in model._non_persistent_buffers_set
        assert set(model.state_dict()) == set(build().state_dict())
        assert all(t.device.type == "cpu" for e in collect(model) for t in [e.tensor])
    finally:
        writer.send_signal(signal.SIGKILL)
        writer.wait()
    # The writer is gone; the reader's mapping and a new reader still hold the weights.
    with torch.no_grad():
        assert torch.equal(model(IDS), reference_output())
    client.close()
    second, again = read_model(gms)
    with second, torch.no_grad():
        assert torch.equal(again(IDS), reference_output())
    stats = gms.stats()
    assert stats["commits"] == 1 and stats["allocations"] > 1  # chunked at 4 KiB


def test_a_different_model_is_refused(gms: GmsProcess) -> None:
    writer = _start_writer(gms)
    try:
        with gms.client() as client:
            client.hello("reader")
            _, tensors, _ = client.layout()
            with torch.device("meta"):
                wider = Tiny(width=32)
            with pytest.raises(WeightsMismatch,
                               match=r"float32\[16, 8\] but this model wants float32\[32, 16\]"):
                materialize(wider, tensors, _base_for(client))  # type: ignore[arg-type]
            with torch.device("meta"):
                extra = Tiny()
                extra.extra = nn.Linear(4, 4)
            with pytest.raises(WeightsMismatch, match=r"lacks 2 tensor.*extra.weight"):
                materialize(extra, tensors, _base_for(client))  # type: ignore[arg-type]
    finally:
        writer.send_signal(signal.SIGKILL)
        writer.wait()


def test_collect_names_each_tensor_once_with_all_its_names() -> None:
    entries = collect(build())
    names = {n: k for e in entries for n, k in e.names}
    tied = [e for e in entries if len(e.names) > 1]
    assert [sorted(n for n, _ in e.names) for e in tied] == [["emb.weight", "head.weight"]]
    assert names["scale"] == "buffer" and names["gate"] == "attr" and names["proj"] == "param"


def test_chunk_plan_aligns_offsets_and_splits_at_the_chunk_size() -> None:
    plan = plan_chunks([100, 10, 300, 5000, 1], chunk_bytes=1024)
    assert [(p.chunk, p.offset) for p in plan.placements] == [
        (0, 0), (0, 256), (0, 512), (1, 0), (2, 0)]
    assert plan.chunk_sizes == [1024, 5120, ALIGN]
    assert all(p.offset % ALIGN == 0 for p in plan.placements)
    assert plan_chunks([]).chunk_sizes == []
    assert plan_chunks([0]).chunk_sizes == [ALIGN]
    with pytest.raises(ValueError, match="negative"):
        plan_chunks([-1])


def test_publish_needs_the_writer(gms: GmsProcess) -> None:
    writer = _start_writer(gms)
    try:
        with gms.client() as reader:
            reader.hello("reader")
            from lumend.gms.client import GmsError

            with pytest.raises(GmsError, match="only the writer"):
                publish(reader, build(), _base_for(reader))  # type: ignore[arg-type]
    finally:
        writer.send_signal(signal.SIGKILL)
        writer.wait()


class Wide(nn.Module):
    """Eight 4 KiB parameters and a buffer: several chunks at an 8 KiB chunk size."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ParameterList([nn.Parameter(torch.full((1024,), float(i)))
                                        for i in range(8)])
        self.register_buffer("scale", torch.ones(4))


def test_publish_frees_each_chunks_originals_before_allocating_the_next(
        gms: GmsProcess) -> None:
    import weakref

    model = Wide()
    originals = [weakref.ref(p) for p in model.layers]
    total = sum(p.numel() * p.element_size() for p in model.layers)
    chunk = 8192
    peaks: list[int] = []

    def after_chunk() -> None:
        alive = sum(4096 for ref in originals if ref() is not None)
        published = int(str(gms.stats()["bytes"]))
        peaks.append(alive + published)

    with gms.client() as writer:
        writer.hello("writer")
        publish(writer, model, _base_for(writer), chunk_bytes=chunk,  # type: ignore[arg-type]
                after_chunk=after_chunk)
        writer.commit()
    assert len(peaks) >= 4
    # Originals and shared copies together never exceed the weights plus one chunk (the
    # buffer's 16 bytes round up to a page in its own chunk at the end).
    assert max(peaks) <= total + chunk + 4096, peaks
    assert all(ref() is None for ref in originals), "a private original outlived publishing"
    assert [float(p[0]) for p in model.layers] == [float(i) for i in range(8)]


def test_readers_map_parameters_and_own_every_other_tensor(gms: GmsProcess) -> None:
    writer = _start_writer(gms)
    try:
        with gms.client() as client:
            client.hello("reader", timeout_s=5)
            _, tensors, _ = client.layout()
            bases: list[torch.Tensor] = []

            def base_for(allocation: int) -> torch.Tensor:
                bases.append(host_base(client.map(allocation).mem))
                return bases[-1]

            with torch.device("meta"):
                model = Tiny()
            materialize(model, tensors, base_for)

            def in_gms(t: torch.Tensor) -> bool:
                return any(b.data_ptr() <= t.data_ptr() < b.data_ptr() + b.numel()
                           for b in bases)

            assert all(in_gms(p) for p in model.parameters())
            assert not any(in_gms(b) for b in model.buffers()) and not in_gms(model.gate)
            with torch.no_grad():  # the reader's own copies: nothing reaches GMS
                model.scale.mul_(0.0)
                model.gate.mul_(0.0)
                assert not torch.equal(model(IDS), reference_output())
            second_client, second = read_model(gms)
            with second_client, torch.no_grad():
                assert torch.equal(second(IDS), reference_output())
    finally:
        writer.send_signal(signal.SIGKILL)
        writer.wait()

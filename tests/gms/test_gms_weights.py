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

"""GMS host memory mapped like GPU memory (`host_vmm`): the writer's mapping takes writes,
a reader's faults on a write (SIGSEGV, in a process of its own), the writer's too once
sealed, and unmap/remap keeps the address."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from lumend.gms.client import GmsClient
from lumend.gms.cuda_vmm import MapState
from lumend.gms.host_vmm import HostMapError, HostMapping, host_tensor_base
from lumend.gms.protocol import TensorMeta

from .conftest import GmsProcess

ROOT = Path(__file__).parents[2]
DATA = bytes(range(256)) * 64  # 16 KiB


def commit_blob(gms: GmsProcess) -> tuple[GmsClient, HostMapping]:
    """A writer that maps an allocation, writes DATA through it and commits (its session
    stays open: the mapping is still read-write)."""
    writer = gms.client()
    assert writer.hello("writer") == "writer"
    alloc, _ = writer.allocate("weights", len(DATA))
    mapping = writer.map_fixed(alloc)
    host_tensor_base(mapping)[: len(DATA)].copy_(torch.frombuffer(bytearray(DATA),
                                                                   dtype=torch.uint8))
    writer.put_tensor(TensorMeta(name="blob", allocation=alloc, offset=0, shape=[len(DATA)],
                                 dtype="uint8"))
    writer.commit()
    return writer, mapping


def in_reader(gms: GmsProcess, body: str) -> subprocess.CompletedProcess[str]:
    """Run `body` in a fresh process holding a reader's mapping `m` of the blob."""
    script = textwrap.dedent(f"""
        import ctypes, sys
        sys.path.insert(0, {str(ROOT)!r})
        from lumend.gms.client import GmsClient
        c = GmsClient({str(gms.socket)!r})
        assert c.hello("reader", timeout_s=5) == "reader"
        _, tensors, _ = c.layout()
        m = c.map_fixed(tensors[0].allocation)
        view = (ctypes.c_uint8 * m.size).from_address(m.va)
        print("read", bytes(view[:4]).hex(), m.writable, flush=True)
    """) + textwrap.dedent(body)
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=60)


def test_a_readers_write_is_a_sigsegv_and_its_reads_see_the_writers_bytes(
        gms: GmsProcess) -> None:
    writer, mapping = commit_blob(gms)
    with writer:
        out = in_reader(gms, "view[0] = 7\nprint('wrote', flush=True)\n")
        assert out.stdout.splitlines()[0] == "read 00010203 False", out.stderr
        assert out.returncode == -signal.SIGSEGV and "wrote" not in out.stdout
        # Control: the same store through the writer's (read-write) mapping works.
        base = host_tensor_base(mapping)
        base[0] = 7
        assert int(base[0]) == 7
        out = in_reader(gms, "print('still', view[0], flush=True)\n")
        assert out.returncode == 0 and "still 7" in out.stdout  # one copy, seen by both


def test_a_reader_cannot_make_its_mapping_writable(gms: GmsProcess) -> None:
    writer, _ = commit_blob(gms)
    with writer, gms.client() as reader:
        reader.hello("reader")
        _, tensors, _ = reader.layout()
        m = reader.map_fixed(tensors[0].allocation)
        # GMS hands readers a read-only fd: PROT_WRITE is refused, not merely not asked for.
        with pytest.raises(HostMapError, match=r"mprotect.*Permission denied"):
            m.set_access(True)
        assert not m.writable
        m.close()
        # Each reader fd is made for one reply: the server does not keep them.
        def server_fds() -> int:
            reader.stats()  # the session answers in order: the last reply's fd is closed
            return len(list(Path(f"/proc/{gms.proc.pid}/fd").iterdir()))

        before = server_fds()
        for _ in range(20):
            reader.map_fixed(tensors[0].allocation).close()
        assert server_fds() == before


def test_a_sealed_writer_faults_like_a_reader(gms: GmsProcess) -> None:
    script = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(ROOT)!r})
        from tests.gms.test_host_vmm import commit_blob
        from tests.gms.conftest import GmsProcess
        from lumend.gms.host_vmm import host_tensor_base
        from pathlib import Path
        gms = GmsProcess(Path({str(gms.socket)!r}), None, Path("/dev/null"))
        writer, mapping = commit_blob(gms)
        mapping.set_access(False)
        print("sealed", mapping.writable, flush=True)
        host_tensor_base(mapping)[0] = 9
        print("wrote", flush=True)
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=60)
    assert out.stdout.splitlines() == ["sealed False"], out.stderr
    assert out.returncode == -signal.SIGSEGV


def test_unmap_keeps_the_address_reserved_and_remap_maps_the_same_bytes_there(
        gms: GmsProcess) -> None:
    writer, mapping = commit_blob(gms)
    with writer, gms.client() as reader:
        reader.hello("reader")
        _, tensors, _ = reader.layout()
        m = reader.map_fixed(tensors[0].allocation)
        tensor = host_tensor_base(m)  # made before the unmap, used after the remap
        assert bytes(tensor[:4].tolist()) == DATA[:4]
        va = m.va
        m.unmap()
        assert m.state is MapState.UNMAPPED
        assert _perms_over(m.va, m.size) == "---p"  # reserved, no access, no memfd pages
        out = in_reader(gms, "m.unmap()\nprint(view[0], flush=True)\n")
        assert out.returncode == -signal.SIGSEGV  # touching unmapped weights faults
        reader.remap(m)
        assert m.va == va and m.state is MapState.MAPPED and not m.writable
        assert bytes(tensor[:4].tolist()) == DATA[:4]
        assert _perms_over(m.va, m.size) == "r--s"
        m.close()
        assert _perms_over(va, m.size) is None
        with pytest.raises(RuntimeError, match="cannot remap while closed"):
            reader.remap(m)
    mapping.close()


def _perms_over(va: int, size: int) -> str | None:
    for line in Path("/proc/self/maps").read_text().splitlines():
        span, perms, *_ = line.split()
        lo, hi = (int(x, 16) for x in span.split("-"))
        if lo <= va and va + size <= hi:
            return perms
    return None

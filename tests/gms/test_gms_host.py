"""GMS over the host backend: a real server process, real fds over SCM_RIGHTS, real mmap."""

from __future__ import annotations

import os
import random
import signal
import socket
import struct
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import msgspec
import pytest

from lumend.gms.client import GmsClient, GmsError, LayoutMismatch
from lumend.gms.protocol import TensorMeta, layout_hash

from .conftest import GmsProcess

WEIGHTS = bytes(random.Random(7).randrange(256) for _ in range(3 * 4096 + 100))


def load_weights(client: GmsClient) -> str:
    """What an engine does as writer: allocate, fill, describe, commit."""
    alloc, _size = client.allocate("weights", len(WEIGHTS))
    mapped = client.map(alloc)
    mapped.mem[: len(WEIGHTS)] = WEIGHTS
    client.put_tensor(TensorMeta(name="layer0.w", allocation=alloc, offset=0,
                                 shape=[len(WEIGHTS)], dtype="uint8"))
    return client.commit()


def read_weights(client: GmsClient) -> bytes:
    _allocations, tensors, _ = client.layout()
    (tensor,) = tensors
    mapped = client.map(tensor.allocation)
    return bytes(mapped.mem[tensor.offset: tensor.offset + tensor.shape[0]])


def test_writer_commits_and_readers_see_identical_bytes(gms: GmsProcess) -> None:
    with gms.client() as writer:
        assert writer.hello("auto") == "writer"
        committed = load_weights(writer)
        readers = [gms.client() for _ in range(4)]
        try:
            for r in readers:
                assert r.hello("auto") == "reader"
                assert r.layout_hash == committed
                assert read_weights(r) == WEIGHTS
            # Readers map read-only: a write is refused by the mapping itself.
            _, tensors, _ = readers[0].layout()
            mapped = readers[0].map(tensors[0].allocation)
            with pytest.raises(TypeError):
                mapped.mem[0:1] = b"x"
        finally:
            for r in readers:
                r.close()
    stats = gms.stats()
    assert stats["state"] == "committed" and stats["commits"] == 1 and stats["readers"] == 0


def _writer_script(sock: Path, commit: bool) -> str:
    return textwrap.dedent(f"""
        import sys, time
        sys.path.insert(0, {str(Path(__file__).parents[2])!r})
        from lumend.gms.client import GmsClient
        from tests.gms.test_gms_host import load_weights
        c = GmsClient({str(sock)!r})
        assert c.hello("writer") == "writer"
        if {commit!r}:
            load_weights(c)
        else:
            c.allocate("weights", 1 << 20)
        print("ready", flush=True)
        time.sleep(600)
    """)


def _run_writer(gms: GmsProcess, commit: bool) -> subprocess.Popen[str]:
    proc = subprocess.Popen([sys.executable, "-c", _writer_script(gms.socket, commit)],
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    return proc


def test_writer_killed_before_commit_aborts_its_layout(gms: GmsProcess) -> None:
    writer = _run_writer(gms, commit=False)
    assert gms.stats()["state"] == "rw"
    writer.send_signal(signal.SIGKILL)
    writer.wait()
    deadline = time.monotonic() + 10
    while gms.stats()["state"] != "empty":
        assert time.monotonic() < deadline, "the aborted layout was never dropped"
        time.sleep(0.02)
    stats = gms.stats()
    assert stats["aborts"] == 1 and stats["allocations"] == 0
    with gms.client() as c:  # the next engine becomes the writer
        assert c.hello("auto") == "writer"


def test_writer_killed_after_commit_leaves_the_weights(gms: GmsProcess) -> None:
    writer = _run_writer(gms, commit=True)
    writer.send_signal(signal.SIGKILL)
    writer.wait()
    with gms.client() as reader:
        assert reader.hello("auto", timeout_s=5) == "reader"
        assert read_weights(reader) == WEIGHTS
    assert gms.stats()["commits"] == 1


def test_reader_waits_for_the_writer_and_times_out_cleanly(gms: GmsProcess) -> None:
    with gms.client() as c, pytest.raises(GmsError, match=r"timed out .* state empty"):
        c.hello("reader", timeout_s=0.2)
    with gms.client() as writer:
        assert writer.hello("writer") == "writer"
        with gms.client() as second, pytest.raises(GmsError, match="state rw"):
            second.hello("auto", timeout_s=0.2)  # another engine waits while one loads


def test_only_the_writer_allocates_and_tensors_must_fit(gms: GmsProcess) -> None:
    with gms.client() as writer:
        writer.hello("writer")
        alloc, size = writer.allocate("weights", 100)
        assert size == os.sysconf("SC_PAGE_SIZE")
        with pytest.raises(GmsError, match="does not fit"):
            writer.put_tensor(TensorMeta(name="big", allocation=alloc, offset=0,
                                         shape=[size + 1], dtype="uint8"))
        with pytest.raises(GmsError, match="unknown dtype"):
            writer.put_tensor(TensorMeta(name="x", allocation=alloc, offset=0, shape=[1],
                                         dtype="complex7"))
        writer.commit()
        with pytest.raises(GmsError, match="only the writer"):
            writer.allocate("weights", 10)


def test_layout_hash_catches_a_torn_layout() -> None:
    t = TensorMeta(name="w", allocation=1, offset=0, shape=[4], dtype="uint8")
    good = layout_hash({1: ("weights", 4096)}, [t])
    moved = msgspec.structs.replace(t, offset=8)
    assert layout_hash({1: ("weights", 4096)}, [moved]) != good
    assert layout_hash({1: ("weights", 8192)}, [t]) != good


def test_layout_mismatch_is_refused_by_the_client(gms: GmsProcess) -> None:
    # Negative control for the reader's check: a hash that does not match must raise.
    with gms.client() as writer:
        writer.hello("writer")
        load_weights(writer)
        original = layout_hash
        import lumend.gms.client as client_module

        client_module.layout_hash = lambda a, t: "0" * 64  # type: ignore[assignment]
        try:
            with pytest.raises(LayoutMismatch):
                writer.layout()
        finally:
            client_module.layout_hash = original


def _raw(sock_path: Path, data: bytes) -> bytes:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(5)
    s.connect(str(sock_path))
    try:
        s.sendall(data)
        s.shutdown(socket.SHUT_WR)
        out = b""
        try:
            while chunk := s.recv(4096):
                out += chunk
        except ConnectionResetError:
            pass  # the server closed the connection with our garbage unread
        return out
    finally:
        s.close()


def test_malformed_frames_close_only_their_connection(gms: GmsProcess) -> None:
    with gms.client() as reader_to_keep, gms.client() as writer:
        writer.hello("writer")
        load_weights(writer)
        reader_to_keep.hello("reader")
        rng = random.Random(1234)
        bad_inputs = [
            struct.pack(">I", 1 << 30),  # oversized length
            struct.pack(">I", 3) + b"\xc1\xc1\xc1",  # not msgpack
            struct.pack(">I", 1) + b"\x01",  # msgpack, not a request map
            msgspec.msgpack.encode({"allocate": 1}),  # no length prefix
        ]
        for _ in range(30):  # random frames with a valid length prefix
            body = bytes(rng.randrange(256) for _ in range(rng.randrange(1, 64)))
            bad_inputs.append(struct.pack(">I", len(body)) + body)
        before = int(gms.stats()["bad_frames"])  # type: ignore[call-overload]
        for data in bad_inputs:
            _raw(gms.socket, data)
        after = int(gms.stats()["bad_frames"])  # type: ignore[call-overload]
        assert after > before
        # The server is alive and the established sessions still work.
        assert read_weights(reader_to_keep) == WEIGHTS
        assert gms.proc.poll() is None

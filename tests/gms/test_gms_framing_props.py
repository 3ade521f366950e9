"""Property tests of the GMS framing (4-byte big-endian length + msgpack): frames survive
any split into reads, any byte string decodes to a request or a FrameError, and a real
server fed random frames, truncations, oversize lengths and garbage closes only those
connections while a good client keeps being served."""

from __future__ import annotations

import socket
import struct
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lumenctl.localcluster import stop_process
from lumend.gms.client import GmsClient
from lumend.gms.protocol import (
    MAX_FRAME,
    PROTOCOL_VERSION,
    Allocate,
    Commit,
    Export,
    FrameError,
    Hello,
    Layout,
    PutTensor,
    Stats,
    TensorMeta,
    decode_request,
    encode,
    recv_frame,
)

from .conftest import GmsProcess, start_gms
from .test_gms_host import WEIGHTS, load_weights, read_weights

ids = st.integers(min_value=0, max_value=2**31)
names = st.text(min_size=1, max_size=20)
dims = st.lists(st.integers(min_value=0, max_value=64), max_size=4)
tensors = st.builds(TensorMeta, name=names, allocation=ids, offset=ids, shape=dims,
                    dtype=st.sampled_from(["float32", "bfloat16", "uint8", "int64"]),
                    stride=st.none() | dims, kind=st.sampled_from(["param", "buffer", "attr"]))
requests = st.one_of(
    st.builds(Hello, id=ids, version=st.just(PROTOCOL_VERSION),
              role=st.sampled_from(["writer", "reader", "auto"]),
              timeout_s=st.floats(min_value=0, max_value=60)),
    st.builds(Allocate, id=ids, tag=st.sampled_from(["weights", "kv_cache"]), size=ids),
    st.builds(Export, id=ids, allocation=ids),
    st.builds(PutTensor, id=ids, tensor=tensors),
    st.builds(Commit, id=ids), st.builds(Layout, id=ids), st.builds(Stats, id=ids),
)


@given(requests)
def test_every_request_round_trips(request: msgspec.Struct) -> None:
    frame = encode(request)
    (length,) = struct.unpack(">I", frame[:4])
    assert length == len(frame) - 4
    assert decode_request(frame[4:]) == request


@given(st.lists(requests, min_size=1, max_size=5), st.data())
def test_frames_survive_any_split_into_reads(batch: list[msgspec.Struct],
                                             data: st.DataObject) -> None:
    stream = b"".join(encode(r) for r in batch)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(stream)), max_size=8)))
    a, b = socket.socketpair()
    with a, b:
        a.settimeout(5)
        b.settimeout(5)
        start = 0
        for cut in [*cuts, len(stream)]:
            if cut > start:
                a.sendall(stream[start:cut])
                start = cut
        for request in batch:
            payload, fds = recv_frame(b)
            assert fds == [] and decode_request(payload) == request


@given(st.binary(max_size=200))
def test_any_bytes_decode_to_a_request_or_a_frame_error(payload: bytes) -> None:
    try:
        request = decode_request(payload)
    except FrameError:
        return  # anything else escaping would be a crash of the server's session task
    assert isinstance(request, Hello | Allocate | Export | PutTensor | Commit | Layout | Stats)


def test_an_oversize_length_is_refused_before_reading_the_body() -> None:
    a, b = socket.socketpair()
    with a, b:
        a.sendall(struct.pack(">I", MAX_FRAME + 1))
        with pytest.raises(FrameError, match="exceeds"):
            recv_frame(b)


# -- a real server under hostile input ----------------------------------------------------

bad_inputs = st.one_of(
    st.binary(min_size=1, max_size=64),  # garbage
    st.integers(MAX_FRAME + 1, 2**32 - 1).map(lambda n: struct.pack(">I", n)),  # oversize
    st.tuples(requests, st.integers(1, 64)).map(  # a valid frame cut short
        lambda rc: encode(rc[0])[: max(1, len(encode(rc[0])) - rc[1])]),
    st.binary(min_size=1, max_size=64).map(lambda b: struct.pack(">I", len(b)) + b),
    st.builds(lambda n, body: struct.pack(">I", n) + body,  # a length that lies
              st.integers(0, 4096), st.binary(max_size=64)),
    # Well-formed requests that need a session first: refused, the connection closed.
    st.one_of(st.builds(Allocate, id=ids, tag=st.just("weights"), size=ids),
              st.builds(Export, id=ids, allocation=ids), st.builds(Commit, id=ids)).map(encode),
    # Maps that are msgpack but no request: unknown op, wrong field types.
    st.dictionaries(st.sampled_from(["type", "id", "op", "size"]),
                    st.one_of(st.integers(min_value=-(2**63), max_value=2**64 - 1),  # msgpack's
                              st.text(max_size=8), st.none()),
                    max_size=4).map(lambda d: encode(d)),
)


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[GmsProcess,
                                                                       GmsClient]]:
    server = start_gms(tmp_path_factory.mktemp("props"))
    writer = server.client()
    writer.hello("writer")
    load_weights(writer)  # after commit the writer is a reader: the good client
    try:
        yield server, writer
    finally:
        writer.close()
        stop_process(server.proc)


def _send_and_drain(path: Path, data: bytes) -> bytes:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(10)  # a server that neither answers nor closes fails the test here
    s.connect(str(path))
    try:
        s.sendall(data)
        s.shutdown(socket.SHUT_WR)
        out = b""
        try:
            while chunk := s.recv(4096):
                out += chunk
        except ConnectionResetError:
            pass
        return out
    finally:
        s.close()


@settings(max_examples=60, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(bad_inputs, min_size=1, max_size=3))
def test_the_server_survives_hostile_connections(
        served: tuple[GmsProcess, GmsClient], inputs: list[bytes]) -> None:
    server, good = served
    for data in inputs:
        replies = _send_and_drain(server.socket, data)
        # Whatever came back is whole frames, each a map (an answer or a refusal).
        while replies:
            (length,) = struct.unpack(">I", replies[:4])
            assert isinstance(msgspec.msgpack.decode(replies[4: 4 + length]), dict)
            replies = replies[4 + length:]
    assert server.proc.poll() is None, "the GMS server died"
    assert read_weights(good) == WEIGHTS
    stats = good.stats()
    assert stats["commits"] == 1 and stats["state"] == "ro"


def test_garbage_is_counted(served: tuple[GmsProcess, GmsClient]) -> None:
    server, good = served
    before = int(good.stats()["bad_frames"])
    _send_and_drain(server.socket, struct.pack(">I", MAX_FRAME + 1))
    _send_and_drain(server.socket, struct.pack(">I", 2) + b"\xc1\xc1")
    assert int(good.stats()["bad_frames"]) == before + 2

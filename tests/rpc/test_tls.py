"""mTLS on the control plane: certificates made here, a real gRPC server on loopback."""

from __future__ import annotations

import asyncio
import datetime
import ipaddress
from pathlib import Path

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from lumenctl.localcluster import free_ports
from lumend.cluster.fencing import EpochFence
from lumend.config import ConfigError, parse_config
from lumend.rpc import lumen_pb2 as pb
from lumend.rpc import lumen_pb2_grpc
from lumend.rpc.agent_service import AgentService
from lumend.rpc.client import AgentClient, RpcFailure
from lumend.rpc.server import CoordinatorServicer, RpcServer
from lumend.rpc.tls import RpcTls


def _name(common: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common)])


def _write(path: Path, cert: x509.Certificate, key: ec.EllipticCurvePrivateKey) -> RpcTls:
    path.mkdir(parents=True, exist_ok=True)
    (path / "cert.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    (path / "key.pem").write_bytes(key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption()))
    return RpcTls(str(path.parent / "ca.pem"), str(path / "cert.pem"), str(path / "key.pem"))


def make_pki(root: Path) -> tuple[RpcTls, RpcTls]:
    """A CA, and (server, client) files signed by it; the server is valid for 127.0.0.1."""
    now = datetime.datetime.now(datetime.UTC)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = (x509.CertificateBuilder().subject_name(_name("lumen test CA"))
          .issuer_name(_name("lumen test CA")).public_key(ca_key.public_key())
          .serial_number(x509.random_serial_number()).not_valid_before(now)
          .not_valid_after(now + datetime.timedelta(days=1))
          .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
          .sign(ca_key, hashes.SHA256()))
    root.mkdir(parents=True, exist_ok=True)
    (root / "ca.pem").write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    out = []
    for who in ("server", "client"):
        key = ec.generate_private_key(ec.SECP256R1())
        cert = (x509.CertificateBuilder().subject_name(_name(f"lumen {who}"))
                .issuer_name(ca.subject).public_key(key.public_key())
                .serial_number(x509.random_serial_number()).not_valid_before(now)
                .not_valid_after(now + datetime.timedelta(days=1))
                .add_extension(x509.SubjectAlternativeName([
                    x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                    critical=False)
                .sign(ca_key, hashes.SHA256()))
        out.append(_write(root / who, cert, key))
    return out[0], out[1]


async def _serve(tls: RpcTls | None) -> tuple[RpcServer, str]:
    service = AgentService("n1", EpochFence(), lambda: [], lambda: "ok",
                           failover=_no_failover)
    server = RpcServer(service, CoordinatorServicer(lambda: None, lambda: "nobody"), tls)
    listen = f"127.0.0.1:{free_ports(1)[0]}"
    await server.start(listen)
    return server, listen


async def _no_failover(worker: str, requested_at: float, by: str) -> tuple[str, float]:
    raise RuntimeError("not in this test")


def test_mtls_admits_a_client_with_a_certificate_and_refuses_one_without(
        tmp_path: Path) -> None:
    server_tls, client_tls = make_pki(tmp_path / "pki")
    ca = Path(client_tls.ca).read_bytes()

    async def scenario() -> None:
        server, listen = await _serve(server_tls)
        good, plaintext = AgentClient(listen, client_tls), AgentClient(listen)
        # Trusts the server's CA but presents no certificate of its own.
        anonymous = grpc.aio.secure_channel(listen, grpc.ssl_channel_credentials(
            root_certificates=ca))
        try:
            assert (await good.status()).node == "n1"
            with pytest.raises(RpcFailure) as refused:
                await plaintext.status(timeout_s=2.0)
            assert refused.value.code == "UNAVAILABLE"
            with pytest.raises(grpc.aio.AioRpcError) as no_cert:
                await lumen_pb2_grpc.AgentStub(anonymous).Status(pb.StatusRequest(), timeout=2.0)
            assert no_cert.value.code() == grpc.StatusCode.UNAVAILABLE
            assert (await good.status()).node == "n1"  # the server is still fine
        finally:
            await good.close()
            await plaintext.close()
            await anonymous.close()
            await server.stop()

    asyncio.run(scenario())


def test_plaintext_when_no_certificates_are_configured() -> None:
    async def scenario() -> None:
        server, listen = await _serve(None)
        client = AgentClient(listen)
        try:
            assert (await client.status()).node == "n1"
        finally:
            await client.close()
            await server.stop()

    asyncio.run(scenario())


def test_check_config_names_missing_and_unreadable_certificates(tmp_path: Path) -> None:
    server_tls, _ = make_pki(tmp_path / "pki")
    base = ('[node]\nname = "n1"\naddress = "10.0.0.1"\n[etcd]\n'
            'endpoints = ["http://10.0.0.1:2379"]\n[rpc]\n')
    good = base + (f'ca = "{server_tls.ca}"\ncert = "{server_tls.cert}"\n'
                   f'key = "{server_tls.key}"\n')
    assert parse_config(good).rpc.tls_files == (server_tls.ca, server_tls.cert, server_tls.key)
    assert parse_config(base).rpc.tls_files is None
    with pytest.raises(ConfigError) as missing:
        parse_config(base + f'ca = "{server_tls.ca}"\ncert = "/nope/cert.pem"\n')
    text = str(missing.value)
    assert 'rpc.cert = "/nope/cert.pem": no such file' in text
    assert "rpc.key is missing: mTLS needs ca, cert and key together" in text
    unreadable = Path(server_tls.key)
    unreadable.chmod(0)
    try:
        import os

        if os.access(unreadable, os.R_OK):  # root reads anything: nothing to check here
            return
        with pytest.raises(ConfigError, match=r"rpc\.key = .*cannot read this file"):
            parse_config(good)
    finally:
        unreadable.chmod(0o600)

"""etcd over TLS with client certificates, as the etcd role runs it: a real etcd started
with --cert-file/--key-file/--trusted-ca-file/--client-cert-auth, certificates made here.
lumend, lumenctl and the store connect with the right files; every other client is refused
with an error that says what to fix."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from lumend.cluster.store import (
    EtcdStore,
    StoreConfigError,
    StoreError,
    StoreUnavailable,
    TlsFiles,
)

from .conftest import Lumend, wait_until
from .pki import CertFiles, TestCA
from .tls_etcd import TlsEtcd


@dataclass
class Pki:
    member: CertFiles  # etcd's server and peer certificate
    client: CertFiles  # lumend's and lumenctl's
    rogue: CertFiles  # signed by another CA


@pytest.fixture
def pki(tmp_path: Path) -> Pki:
    ca = TestCA(tmp_path / "pki")
    return Pki(ca.issue("member", server=True), ca.issue("client"),
               TestCA(tmp_path / "rogue", "rogue CA").issue("client"))


@pytest.fixture
def tls_etcd(tmp_path: Path, pki: Pki) -> Iterator[TlsEtcd]:
    server = TlsEtcd(tmp_path / "etcd", pki.member)
    try:
        yield server.start()
    finally:
        server.stop()


def files(f: CertFiles, *, client_cert: bool = True) -> TlsFiles:
    if not client_cert:
        return TlsFiles(str(f.ca))
    return TlsFiles(str(f.ca), str(f.cert), str(f.key))


def put_and_get(endpoint: str, tls: TlsFiles | None) -> bytes:
    async def go() -> bytes:
        store = EtcdStore([endpoint], request_timeout_s=0.5, retry_budget_s=1.0, tls=tls)
        try:
            await store.put("/lumen-tls-test", b"through TLS")
            got = await store.get("/lumen-tls-test")
            assert got is not None
            return got.value
        finally:
            await store.close()

    return asyncio.run(go())


def refusal(endpoint: str, tls: TlsFiles | None) -> StoreError:
    with pytest.raises(StoreError) as caught:
        put_and_get(endpoint, tls)
    return caught.value


def test_store_needs_a_client_certificate_signed_by_the_trusted_ca(
    tls_etcd: TlsEtcd, pki: Pki
) -> None:
    assert put_and_get(tls_etcd.endpoint, files(pki.client)) == b"through TLS"

    for who, tls in (("no client certificate", files(pki.client, client_cert=False)),
                     ("a certificate of another CA",
                      TlsFiles(str(pki.client.ca), str(pki.rogue.cert), str(pki.rogue.key)))):
        error = refusal(tls_etcd.endpoint, tls)
        assert isinstance(error, StoreUnavailable), who
        assert "etcd refused the TLS handshake" in str(error), who
        assert "--trusted-ca-file" in str(error), who

    # The client does not trust etcd's certificate (a CA that did not sign it).
    error = refusal(tls_etcd.endpoint, TlsFiles(str(pki.rogue.ca), str(pki.client.cert),
                                                str(pki.client.key)))
    assert "etcd refused the TLS handshake" in str(error)
    assert "CERTIFICATE_VERIFY_FAILED" in str(error)

    plaintext = refusal(tls_etcd.endpoint.replace("https://", "http://"), None)
    assert isinstance(plaintext, StoreUnavailable)
    assert "as an etcd that serves TLS does to a plaintext client" in str(plaintext)

    no_ca = refusal(tls_etcd.endpoint, None)
    assert isinstance(no_ca, StoreConfigError)
    assert "is an https endpoint but no CA certificate is given" in str(no_ca)

    missing = refusal(tls_etcd.endpoint, TlsFiles(str(pki.client.ca), "/nope/client.pem",
                                                  str(pki.client.key)))
    assert isinstance(missing, StoreConfigError)
    assert "cannot read the etcd TLS file /nope/client.pem" in str(missing)


def lumenctl(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "lumenctl", *args], capture_output=True,
                          text=True, timeout=60)


def check_config(path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "lumend", "check-config", str(path)],
                          capture_output=True, text=True, timeout=60)


def test_lumend_and_lumenctl_connect_with_certificates(
    tls_etcd: TlsEtcd, pki: Pki, start_lumend: Callable[..., Lumend], tmp_path: Path
) -> None:
    node = start_lumend([tls_etcd.endpoint], name="t1", etcd_tls=pki.client)
    assert check_config(node.config).returncode == 0

    def registered() -> bool:
        result = lumenctl("--config", str(node.config), "-o", "json", "status")
        return result.returncode == 0 and [n["name"] for n in json.loads(result.stdout)
                                           ["nodes"]] == ["t1"]

    wait_until(registered, 60, "t1 registered through TLS, read by lumenctl with its config")
    assert "waiting for etcd" not in node.log_text()

    # lumenctl with the files as flags (no config file).
    base = ["--config", str(tmp_path / "absent.toml"), "--endpoints", tls_etcd.endpoint,
            "--cluster", "deploy", "--etcd-timeout", "0.5"]
    flags = ["--ca-cert", str(pki.client.ca), "--cert", str(pki.client.cert),
             "--key", str(pki.client.key)]
    ok = lumenctl(*base, *flags, "-o", "json", "status")
    assert ok.returncode == 0, ok.stderr
    assert [n["name"] for n in json.loads(ok.stdout)["nodes"]] == ["t1"]

    # Without a client certificate etcd refuses: exit 3, and the message names the fix.
    refused = lumenctl(*base, "--ca-cert", str(pki.client.ca), "status")
    assert refused.returncode == 3
    assert "etcd refused the TLS handshake" in refused.stderr
    assert "lumenctl --cert/--key" in refused.stderr
    # Without any TLS file, an https endpoint is a usage error.
    usage = lumenctl(*base, "status")
    assert usage.returncode == 2
    assert "no CA certificate is given" in usage.stderr

    # check-config refuses a config that would connect without the client certificate.
    text = node.config.read_text()
    without_cert = tmp_path / "no-cert.toml"
    without_cert.write_text(text.replace(f'cert = "{pki.client.cert}"\n', "").replace(
        f'key = "{pki.client.key}"\n', ""))
    result = check_config(without_cert)
    assert result.returncode != 0
    assert "etcd.cert is missing: etcd over TLS needs a client certificate" in result.stderr
    plaintext = tmp_path / "plaintext.toml"
    plaintext.write_text(text.replace(tls_etcd.endpoint, tls_etcd.endpoint.replace(
        "https://", "http://")))
    result = check_config(plaintext)
    assert result.returncode != 0
    assert "http:// endpoints would reach etcd in plaintext" in result.stderr

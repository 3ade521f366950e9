"""mTLS for the control plane: when `[rpc]` names ca, cert and key, every lumend serves with
its certificate and requires a client certificate signed by the CA; every client presents
its certificate. Without them, plaintext."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc


@dataclass(frozen=True)
class RpcTls:
    ca: str
    cert: str
    key: str

    def _read(self) -> tuple[bytes, bytes, bytes]:
        return Path(self.ca).read_bytes(), Path(self.cert).read_bytes(), Path(self.key).read_bytes()

    def server_credentials(self) -> Any:
        ca, cert, key = self._read()
        return grpc.ssl_server_credentials([(key, cert)], root_certificates=ca,
                                           require_client_auth=True)

    def channel_credentials(self) -> Any:
        ca, cert, key = self._read()
        return grpc.ssl_channel_credentials(root_certificates=ca, private_key=key,
                                            certificate_chain=cert)


def open_channel(address: str, tls: RpcTls | None) -> Any:
    """A grpc.aio channel to host:port, secured when `tls` is given."""
    options = [("grpc.enable_retries", 0), ("grpc.initial_reconnect_backoff_ms", 100),
               ("grpc.max_reconnect_backoff_ms", 1000)]
    if tls is None:
        return grpc.aio.insecure_channel(address, options=options)
    return grpc.aio.secure_channel(address, tls.channel_credentials(), options=options)

"""Who may drive an engine: the control paths of an engine's HTTP port are lumend's alone.

An engine's port must stay reachable from the gateways of other nodes for `/v1/*`, so it
cannot listen on loopback only. Everything else an engine serves can drive it: vLLM's dev
endpoints (`/sleep`, `/wake_up`, `/collective_rpc`, ... with `VLLM_SERVER_DEV_MODE=1`) and
LUMEN's own (`/lumen/release` forces a switchover). The gate inside the engine
(`lumend.engine.vllm_gate`) serves those only to a request that comes from this machine
(loopback, or the engine's own address: lumend calls its engines at the node's address) and
carries the engine's token, which lumend derives per engine and hands it in its environment.

This module is imported by lumend and by the gate inside vLLM: the standard library only.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import secrets
from dataclasses import dataclass

TOKEN_ENV = "LUMEN_ENGINE_TOKEN"
TOKEN_HEADER = "X-Lumen-Engine-Token"

# Paths anyone who reaches the port may use (what gateways, probes and Prometheus need).
# /tokenize and /detokenize change nothing; the gateway finds a clean resume point with
# /detokenize (lumend/gateway/server.py).
OPEN_PATHS = frozenset({"/health", "/metrics", "/ping", "/version", "/load", "/tokenize",
                        "/detokenize"})
# Read-only LUMEN paths lumend polls (GET only: their other methods act on the engine).
OPEN_FOR_GET = frozenset({"/lumen/engine", "/lumen/assist"})
# Under /v1/ but not inference: they change what the engine serves.
CONTROL_UNDER_V1 = frozenset({"/v1/load_lora_adapter", "/v1/unload_lora_adapter"})

# One secret per lumend process: its engines die with it (die_with_supervisor), so a token
# never has to outlive the process that derived it.
_NODE_SECRET = secrets.token_bytes(32)


def engine_token(engine_id: str) -> str:
    """The token of one engine slot (the same for every restart of it under this lumend)."""
    return hmac.new(_NODE_SECRET, engine_id.encode(), hashlib.sha256).hexdigest()


def control_headers(engine_id: str) -> dict[str, str]:
    """Headers lumend sends with every control call to one of its engines."""
    return {TOKEN_HEADER: engine_token(engine_id)}


def is_control_path(method: str, path: str) -> bool:
    if path in CONTROL_UNDER_V1:
        return True
    if path.startswith("/v1/") or path in OPEN_PATHS:
        return False
    return not (method in ("GET", "HEAD") and path in OPEN_FOR_GET)


def is_local(client_host: str | None, server_host: str | None) -> bool:
    """A peer on this machine: loopback, or the address the request arrived at (a local
    process that calls the node's address sends from it; Linux drops packets from outside
    that claim one of its own addresses as their source)."""
    if not client_host:
        return False
    try:
        client = ipaddress.ip_address(client_host)
    except ValueError:
        return False  # a unix socket or a name: not an address we can vouch for
    if client.is_loopback:
        return True
    if not server_host:
        return False
    try:
        return client == ipaddress.ip_address(server_host)
    except ValueError:
        return False


@dataclass(frozen=True)
class Refusal:
    reason: str  # remote | no_token | bad_token (the refusal counter's label)
    message: str


def control_refusal(method: str, path: str, client_host: str | None, server_host: str | None,
                    presented: str | None, expected: str | None) -> Refusal | None:
    """Why a request must be refused (None: serve it). `expected` None means the engine was
    not started by lumend (no token in its environment): control is then local-only."""
    if not is_control_path(method, path):
        return None
    if not is_local(client_host, server_host):
        return Refusal("remote", (
            f"{method} {path} controls the engine and is served only to lumend on this "
            f"machine, not to {client_host or 'an unknown peer'}; send completions to /v1/*, "
            "and switch over through lumend (lumenctl)"))
    if expected is None:
        return None
    if presented is None:
        return Refusal("no_token", (
            f"{method} {path} controls the engine and needs its token (header "
            f"{TOKEN_HEADER}, which lumend sends); call it through lumend"))
    if not hmac.compare_digest(presented.encode(), expected.encode()):
        return Refusal("bad_token", f"{method} {path}: the {TOKEN_HEADER} header does not "
                       "match this engine's token")
    return None

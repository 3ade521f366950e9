"""Engine adapters: how lumend starts an engine of a kind and learns what it is doing.

Both kinds serve the same HTTP surface (DESIGN.md section 6); an adapter knows the command
line and how to read the engine's lifecycle state. The supervisor owns processes, probes
and restarts; adapters hold no state of their own.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from typing import Protocol

import aiohttp

ENGINE_STATES = ("initialising", "standby", "active", "releasing")


@dataclass(frozen=True)
class EngineSpec:
    """One engine slot of a worker."""

    engine_id: str
    host: str
    port: int
    model: str
    args: tuple[str, ...]
    gms_socket: str | None
    failover_lock: str
    seed: int = 0
    time_scale: float = 1.0

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"


@dataclass(frozen=True)
class EngineLoad:
    running: int
    waiting: int
    kv_usage: float
    # Checkpoint coverage gauges; None when the engine does not export them (unknown, not 0).
    ckpt_running: int | None = None
    ckpt_complete: int | None = None


class EngineAdapter(Protocol):
    kind: str
    uses_gms: bool

    def command(self, spec: EngineSpec) -> list[str]: ...

    def environment(self, spec: EngineSpec) -> dict[str, str]:
        """Variables added to lumend's environment for the engine process."""
        ...

    async def probe(self, session: aiohttp.ClientSession, spec: EngineSpec) -> str:
        """The engine's lifecycle state (one of ENGINE_STATES); raises when unreachable."""
        ...

    async def release(self, session: aiohttp.ClientSession, spec: EngineSpec,
                      drain_timeout_s: float) -> None:
        """Planned switchover: finish, sleep, hand the failover lock to a shadow."""
        ...

    async def load(self, session: aiohttp.ClientSession, spec: EngineSpec) -> EngineLoad: ...


class HttpEngineAdapter:
    """Both engine kinds expose LUMEN's lifecycle endpoints (`/lumen/engine`,
    `/lumen/release`) and vLLM's `/metrics`; they differ only in how they are started."""

    kind = ""
    uses_gms = False

    def environment(self, spec: EngineSpec) -> dict[str, str]:
        return {}

    async def probe(self, session: aiohttp.ClientSession, spec: EngineSpec) -> str:
        async with session.get(spec.url + "/lumen/engine") as response:
            response.raise_for_status()
            body = await response.json()
        state = str(body["state"])
        if state not in ENGINE_STATES:
            raise ValueError(f"engine {spec.engine_id} reports unknown state {state!r}")
        return state

    async def release(self, session: aiohttp.ClientSession, spec: EngineSpec,
                      drain_timeout_s: float) -> None:
        async with session.post(spec.url + "/lumen/release",
                                params={"drain_timeout_s": str(drain_timeout_s)}) as response:
            response.raise_for_status()

    async def load(self, session: aiohttp.ClientSession, spec: EngineSpec) -> EngineLoad:
        async with session.get(spec.url + "/metrics") as response:
            response.raise_for_status()
            return parse_load(await response.text())


class SimAdapter(HttpEngineAdapter):
    kind = "sim"
    uses_gms = True

    def command(self, spec: EngineSpec) -> list[str]:
        cmd = [
            sys.executable, "-m", "lumend.engine.sim_server",
            "--engine-id", spec.engine_id, "--host", spec.host, "--port", str(spec.port),
            "--model", spec.model, "--seed", str(spec.seed),
            "--time-scale", str(spec.time_scale), "--failover-lock", spec.failover_lock,
        ]
        if spec.gms_socket is not None:
            cmd += ["--gms-socket", spec.gms_socket]
        return cmd + list(spec.args)


class VllmAdapter(HttpEngineAdapter):
    """Real vLLM (`python -m vllm.entrypoints.openai.api_server`), gated by LUMEN's
    middleware. Without CUDA the shadow is a hot standby: initialised, serving nothing
    until it holds the failover lock. (Sleep mode and GMS weights need the cuda backend.)"""

    kind = "vllm"

    def command(self, spec: EngineSpec) -> list[str]:
        cmd = [
            sys.executable, "-m", "vllm.entrypoints.openai.api_server",
            "--model", spec.model, "--host", spec.host, "--port", str(spec.port),
            "--middleware", "lumend.engine.vllm_gate.gate",
        ]
        # LUMEN checkpoints through our KV connector, unless the operator configured a
        # connector of their own in the worker's args (theirs wins, and says so in the log).
        if not any(a.startswith("--kv-transfer-config") for a in spec.args):
            cmd += ["--kv-transfer-config", LUMEN_KV_TRANSFER_CONFIG]
        return cmd + list(spec.args)

    def environment(self, spec: EngineSpec) -> dict[str, str]:
        return {"LUMEN_ENGINE_ID": spec.engine_id, "LUMEN_FAILOVER_LOCK": spec.failover_lock}


LUMEN_KV_TRANSFER_CONFIG = json.dumps({
    "kv_connector": "LumenConnector",
    "kv_connector_module_path": "lumend.engine.vllm_connector",
    "kv_role": "kv_both",
    # A checkpoint that cannot be loaded means recompute, never an error to the client.
    "kv_load_failure_policy": "recompute",
}, separators=(",", ":"))


_LOAD_METRICS = ("vllm:num_requests_running", "vllm:num_requests_waiting",
                 "vllm:kv_cache_usage_perc", "lumen:ckpt_requests_running",
                 "lumen:ckpt_requests_complete")


def parse_load(metrics_text: str) -> EngineLoad:
    """Load from vLLM's metric names in a Prometheus text exposition, and checkpoint
    coverage from LUMEN's `lumen:ckpt_requests_running` / `lumen:ckpt_requests_complete`
    (None each when absent, as from an engine without LUMEN's connector)."""
    values: dict[str, float] = {}
    for line in metrics_text.splitlines():
        if line.startswith("#") or not line.strip():
            continue
        name_part, _, value = line.rpartition(" ")
        name = name_part.split("{", 1)[0]
        if name in _LOAD_METRICS:
            values[name] = values.get(name, 0.0) + float(value)

    def optional(name: str) -> int | None:
        return int(values[name]) if name in values else None

    return EngineLoad(
        running=int(values.get("vllm:num_requests_running", 0)),
        waiting=int(values.get("vllm:num_requests_waiting", 0)),
        kv_usage=values.get("vllm:kv_cache_usage_perc", 0.0),
        ckpt_running=optional("lumen:ckpt_requests_running"),
        ckpt_complete=optional("lumen:ckpt_requests_complete"),
    )


def adapter_for(kind: str) -> EngineAdapter:
    adapters: dict[str, EngineAdapter] = {"sim": SimAdapter(), "vllm": VllmAdapter()}
    try:
        return adapters[kind]
    except KeyError:
        raise ValueError(f"engine kind {kind!r} is unknown; use one of {sorted(adapters)}"
                         ) from None

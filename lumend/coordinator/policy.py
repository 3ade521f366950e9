"""LUMEN's placement and routing policies: pure functions of a load snapshot.

The coordinator and the simulator (lumend/sim) call the same functions. Nothing here does
I/O or keeps state between calls; a decision depends only on its arguments.

Load estimate (paper Eq. 4): `L_hat(w) = alpha * sum_{r in C(w)} |KV_r| + beta * Q_w`, with
C(w) the checkpoints held by w (their bytes) and Q_w the requests admitted to w and not
finished (running plus waiting). Workers are indices into the snapshot's columns;
ties go to the lowest index, so every decision is deterministic.

* Algorithm 1 `choose_holder`: argmin L_hat over live workers other than the serving one
  whose host-memory budget fits the checkpoint (Eq. 5), preferring workers on another node;
  None when every budget is full (the request runs without a checkpoint).
* Algorithm 2 `route_interrupted`: resume on the holder if L_hat(holder) <= theta or the
  checkpointed prefix is longer than tau blocks, else recompute on the least-loaded
  survivor (Eq. 6).
* Algorithm 3 `choose_assist_target`: argmax L_hat over live workers.
* Replicated checkpoints (`place_checkpoint_replicas`, `choose_replica`): Algorithm 1 once per
  replica, each on a node holding neither the server nor an earlier replica when one fits.
* `least_loaded_in` / `choose_holder_in` take L_hat values the caller keeps (the simulator
  updates them per change instead of recomputing every worker at each admission).
* Baselines: stop-and-restart (no checkpoints; recompute on the least-loaded survivor) and
  fixed checkpointing (DejaVu: a static neighbour holds the checkpoints and interrupted
  requests always go to it).

`place_checkpoint`, `recover` and `assist_target` dispatch on `PolicyConfig.mode` and on the
mechanism switches (used for ablations: each LUMEN mechanism replaces its fixed-checkpoint
counterpart).

Cost-aware mode (`PolicyConfig.cost_aware`; the simulator's `lumen`, and the coordinator's
default, cluster setting `decisions = cost_aware`; `PolicyConfig()` itself keeps the paper's
forms): decisions in seconds.

* L_hat is seconds (`in_seconds`): `alpha` = 1 / restore bandwidth (s per held byte: the
  restore work a holder faces), `beta` = seconds of work one queued request stands for, one
  mean prompt's prefill (`MEAN_PROMPT_TOKENS` x prefill seconds per token). The simulator
  (`lumend.sim.config.cost_policy`) takes the per-token costs from its cost model; the
  coordinator, whose heartbeats carry request counts only, from `PolicyConfig`'s defaults
  (the cost model in ONE place: `restore_bytes_per_s`, `recompute_s_per_token`,
  `kv_bytes_per_token` below). Algorithm 1 is unchanged over these units.
* Admission (`admission`): "lhat" (paper: argmin L_hat, checkpoint bytes included) or
  "queue" (join the shortest queue: held checkpoints cost no GPU time, so they do not
  unbalance serving). `least_loaded` admits and picks recompute targets by it.
* Algorithm 2 by estimated completion time (`route_by_completion`): resume at the holder
  (its queued work + restore bytes / restore bandwidth + the tail's recompute) against
  recompute at the survivor admission would pick, as stop-and-restart does (its work + the
  whole context's recompute), each plus the delay the request's own seconds impose on the
  requests already there (`delay_weight`; `completion_estimates`); resume on ties. Queued work is
  `LoadSnapshot.work_s` when the caller gives it (seconds of queued prefill and restores
  from its cost model), else beta * queue. theta and tau are not used.
* Algorithm 3 by predicted gain (`assist_gain`, the caller's `LoadSnapshot.assist_gain`):
  the survivor with the highest positive gain, none when no gain is positive or unknown.
  `assist_objective` says what the gain weighs: "ttft" (default) assists only where the
  decode speed-up cannot delay a prompt, "throughput" trades prompt delay for decode speed
  by the share of steps each takes (`assist_gain`).
"""

from __future__ import annotations

import functools
import math
import operator
from collections.abc import Sequence
from dataclasses import dataclass, replace
from enum import StrEnum

GIB = float(1 << 30)
ADMISSIONS = ("lhat", "queue")
ASSIST_OBJECTIVES = ("ttft", "throughput")
# Tokens of prefill one queued request stands for in cost-aware L_hat (beta): the mean prompt
# of the conversation trace the simulator's scenarios run (lumend.sim.workload).
MEAN_PROMPT_TOKENS = 1155.0


class Mode(StrEnum):
    stop_and_restart = "stop_and_restart"
    fixed_checkpoint = "fixed_checkpoint"
    lumen = "lumen"


@dataclass(frozen=True, slots=True)
class PolicyConfig:
    """Cluster-wide policy tunables (etcd `config`, or simulator options).

    alpha weighs held checkpoint bytes (default: 1 per GiB), beta weighs queued requests,
    theta is the L_hat above which a holder is "overloaded" for resumption, tau the prefix
    length in blocks (16 tokens) above which resuming beats recomputing regardless of load.
    The three switches matter in `lumen` mode only; turning one off puts the fixed
    checkpointing counterpart in its place.
    """

    alpha: float = 1.0 / GIB
    beta: float = 1.0
    theta: float = 48.0
    tau: int = 64
    mode: Mode = Mode.lumen
    load_aware_placement: bool = True
    adaptive_routing: bool = True
    draft_assist: bool = True
    # Cost-aware decisions (module docstring); the defaults keep the paper's forms.
    cost_aware: bool = False
    admission: str = "lhat"                 # "lhat" (Eq. 4) or "queue" (shortest queue)
    # The cost model a cost-aware decision uses where the caller measures nothing better (the
    # coordinator today; the simulator replaces them with its cost model's, `cost_policy`):
    # the simulator's default restore bandwidth (SimConfig.restore_bytes_per_s), and the
    # paper-4w scenario's model as its cost model has it (Qwen3-32B on a100-tp4: a full
    # 2048-token chunk's prefill 0.99e-4 s per token, 262144 KV bytes per token).
    restore_bytes_per_s: float = 25e9       # checkpoint pages host -> GPU at the holder
    recompute_s_per_token: float = 1e-4     # prefill seconds per token (a full chunk's)
    kv_bytes_per_token: float = 262144.0    # to turn a checkpointed prefix into bytes
    block_tokens: int = 16
    # Restores run beside the holder's engine (vLLM's asynchronous loads, the sim engine):
    # they overlap the requests queued ahead and delay none of them. False: inside the step
    # that schedules the resumed request (its whole batch waits; vLLM before 2026-12-07).
    restore_beside_engine: bool = True
    delay_weight: float = 1.0               # routing: weight of the delay imposed on others
    assist_objective: str = "ttft"          # what draft-assist's gain weighs (assist_gain)

    def __post_init__(self) -> None:
        if self.alpha < 0 or self.beta < 0:
            raise ValueError(f"alpha and beta must be >= 0, got {self.alpha}, {self.beta}")
        if self.tau < 0:
            raise ValueError(f"tau must be >= 0 blocks, got {self.tau}")
        if self.admission not in ADMISSIONS:
            raise ValueError(f"admission must be one of {', '.join(ADMISSIONS)}, got "
                             f"{self.admission!r}")
        if self.restore_bytes_per_s <= 0 or self.recompute_s_per_token < 0:
            raise ValueError("restore_bytes_per_s must be > 0 and recompute_s_per_token >= 0")
        if self.kv_bytes_per_token < 0 or self.block_tokens < 1:
            raise ValueError("kv_bytes_per_token must be >= 0 and block_tokens >= 1")
        if self.delay_weight < 0:
            raise ValueError(f"delay_weight must be >= 0, got {self.delay_weight}")
        if self.assist_objective not in ASSIST_OBJECTIVES:
            raise ValueError(f"assist_objective must be one of {', '.join(ASSIST_OBJECTIVES)}"
                             f", got {self.assist_objective!r}")

    @property
    def checkpoints(self) -> bool:
        return self.mode is not Mode.stop_and_restart

    @property
    def uses_assist(self) -> bool:
        return self.mode is Mode.lumen and self.draft_assist


@dataclass(frozen=True, slots=True)
class WorkerLoad:
    """One worker as the coordinator reads it from etcd."""

    name: str
    node: str
    ckpt_bytes: float
    queue: int
    budget_bytes: float = math.inf
    alive: bool = True
    work_s: float | None = None       # seconds of queued prefill and restores (cost model)
    assist_gain: float | None = None  # predicted gain of draft-assisting it (assist_gain)


@dataclass(frozen=True, slots=True)
class LoadSnapshot:
    """The cluster's load, column-wise: worker i is index i of every column.

    Columns are read-only sequences; the simulator passes its live lists (cheap), the
    coordinator builds tuples with `from_workers`.
    """

    nodes: Sequence[str]
    ckpt_bytes: Sequence[float]
    queue: Sequence[int]
    budget_bytes: Sequence[float]
    alive: Sequence[bool]
    # Optional (cost-aware mode): None when the caller does not estimate them.
    work_s: Sequence[float] | None = None
    assist_gain: Sequence[float] | None = None

    @classmethod
    def from_workers(cls, workers: Sequence[WorkerLoad]) -> LoadSnapshot:
        work = [w.work_s for w in workers]
        gain = [w.assist_gain for w in workers]
        return cls(
            nodes=tuple(w.node for w in workers),
            ckpt_bytes=tuple(w.ckpt_bytes for w in workers),
            queue=tuple(w.queue for w in workers),
            budget_bytes=tuple(w.budget_bytes for w in workers),
            alive=tuple(w.alive for w in workers),
            work_s=None if None in work else tuple(v for v in work if v is not None),
            assist_gain=None if None in gain else tuple(v for v in gain if v is not None),
        )

    def __len__(self) -> int:
        return len(self.alive)


@dataclass(frozen=True, slots=True)
class Route:
    """Where an interrupted request goes: `resume` from its checkpoint there, or recompute."""

    worker: int
    resume: bool


def in_seconds(cfg: PolicyConfig, mean_prompt_tokens: float = MEAN_PROMPT_TOKENS
               ) -> PolicyConfig:
    """`cfg` with L_hat in seconds from its own cost model: alpha = one held byte's restore
    time (1 / `restore_bytes_per_s`), beta = one queued request's prefill (a mean prompt at
    `recompute_s_per_token`). The simulator and the coordinator both derive them here."""
    return replace(cfg, alpha=1.0 / cfg.restore_bytes_per_s,
                   beta=mean_prompt_tokens * cfg.recompute_s_per_token)


def queued_prefill_s(queue: int, running: int, cfg: PolicyConfig) -> float:
    """`LoadSnapshot.work_s` of a worker known by request counts only (the coordinator's
    and the gateways' views: heartbeats carry counts, not tokens): beta seconds (one mean
    prompt's prefill, `in_seconds`) per request not yet running, `queue - running`. Running
    requests have had their prefill (the simulator's queued work leaves them out too)."""
    return cfg.beta * max(0, queue - running)


def l_hat(ckpt_bytes: float, queue: float, cfg: PolicyConfig) -> float:
    """L_hat of one worker from its checkpoint bytes held and its queue."""
    return cfg.alpha * ckpt_bytes + cfg.beta * queue


def load_hat(snapshot: LoadSnapshot, worker: int, cfg: PolicyConfig) -> float:
    return l_hat(snapshot.ckpt_bytes[worker], snapshot.queue[worker], cfg)


def loads(snapshot: LoadSnapshot, cfg: PolicyConfig) -> list[float]:
    """L_hat of every worker; dead workers get +inf."""
    # map() keeps this loop in C: the simulator calls it for every admission.
    values = list(map(operator.add, map(cfg.alpha.__mul__, snapshot.ckpt_bytes),
                      map(cfg.beta.__mul__, snapshot.queue)))
    if not all(snapshot.alive):
        for i, ok in enumerate(snapshot.alive):
            if not ok:
                values[i] = math.inf
    return values


def _argmin(values: list[float]) -> int | None:
    best = min(values, default=math.inf)
    return None if best == math.inf else values.index(best)


def least_loaded(snapshot: LoadSnapshot, cfg: PolicyConfig) -> int | None:
    """Admission, and recompute targets: argmin L_hat over live workers, or the shortest
    queue with `admission = "queue"`."""
    if cfg.admission == "queue":
        return _argmin(queues(snapshot))
    return _argmin(loads(snapshot, cfg))


def queues(snapshot: LoadSnapshot) -> list[float]:
    """Queue length of every worker as a float; dead workers get +inf."""
    # map() keeps this in C, as `loads`: the coordinator calls it for every admission.
    values = list(map(float, snapshot.queue))
    if not all(snapshot.alive):
        for i, ok in enumerate(snapshot.alive):
            if not ok:
                values[i] = math.inf
    return values


def work(snapshot: LoadSnapshot, cfg: PolicyConfig) -> list[float]:
    """Seconds of queued work per worker (+inf when dead): the snapshot's `work_s`, else
    beta * queue (beta in seconds per request in cost-aware mode)."""
    given = snapshot.work_s
    if given is None:
        given = [cfg.beta * q for q in snapshot.queue]
    return [v if ok else math.inf for v, ok in zip(given, snapshot.alive, strict=True)]


def recompute_s(tokens: float, cfg: PolicyConfig) -> float:
    return max(0.0, tokens) * cfg.recompute_s_per_token


def restore_s(tokens: float, cfg: PolicyConfig) -> float:
    return max(0.0, tokens) * cfg.kv_bytes_per_token / cfg.restore_bytes_per_s


def completion_estimates(
    snapshot: LoadSnapshot, holder: int | None, prefix_blocks: int, total_tokens: int,
    cfg: PolicyConfig,
) -> tuple[float, int | None, float]:
    """(cost of resuming at the holder, the recompute target, cost of recomputing there);
    +inf where impossible. A cost is the request's estimated completion (the worker's queued
    work + its own restore/recompute seconds) plus `delay_weight` times the delay its own
    seconds impose on the requests already there (they share its GPU steps): the extra work
    of recomputing delays everyone behind it, which matters most when the survivors are
    overloaded. A restore beside the engine (`restore_beside_engine`) runs while the queued
    work does and shares no GPU step: the request starts after the longer of the two, and
    only the tokens it recomputes delay the others.

    The recompute target is the survivor admission would pick (`least_loaded`: the shortest
    queue with `admission = "queue"`), where stop-and-restart recomputes too; the estimate
    decides only between resuming at the holder and recomputing there. Picking the target
    by the least estimate instead (`ab47bb0`) sent short requests to survivors with no
    queued prefill but more requests decoding: in the sweep's 1 GB/s cells it made the moved
    requests' first tokens 4% sooner and every other request's 2-7% later (issue 15,
    docs/simulator.md, *Sweep*): the estimate prices one prefill, not the decoding that
    follows it on the target nor the admissions it turns away."""
    queued = work(snapshot, cfg)
    weight, queue = cfg.delay_weight, snapshot.queue

    def cost(worker: int, own: float) -> float:
        return queued[worker] + own * (1.0 + weight * queue[worker])

    target = least_loaded(snapshot, cfg)
    recompute = math.inf if target is None else cost(target, recompute_s(total_tokens, cfg))
    resume = math.inf
    if holder is not None and snapshot.alive[holder] and prefix_blocks > 0:
        tokens = min(prefix_blocks * cfg.block_tokens, max(total_tokens - 1, 0))
        restore, rest = restore_s(tokens, cfg), recompute_s(total_tokens - tokens, cfg)
        if cfg.restore_beside_engine:
            resume = (max(queued[holder], restore)
                      + rest * (1.0 + weight * queue[holder]))
        else:
            resume = cost(holder, restore + rest)
    return resume, target, recompute


def route_by_completion(
    snapshot: LoadSnapshot, holder: int | None, prefix_blocks: int, cfg: PolicyConfig,
    total_tokens: int | None = None,
) -> Route | None:
    """Algorithm 2 by estimated completion time: resume at the holder unless recomputing at
    the survivor admission would pick is estimated strictly faster (`completion_estimates`).
    `total_tokens` (prompt + generated) defaults to the checkpointed prefix."""
    total = prefix_blocks * cfg.block_tokens if total_tokens is None else total_tokens
    resume, target, recompute = completion_estimates(snapshot, holder, prefix_blocks, total,
                                                     cfg)
    if resume != math.inf and resume <= recompute:
        assert holder is not None
        return Route(holder, resume=True)
    return None if target is None else Route(target, resume=False)


def assist_gain(step_s: float, verify_extra_s: float, tokens_per_round: float,
                prefill_waiting: bool, capacity_bound: bool = False,
                prefill_share: float = 0.0, objective: str = "ttft") -> float:
    """Predicted relative gain of draft-assisting a survivor whose step takes `step_s`:
    each assisted step costs `verify_extra_s` more (verifying k drafted tokens per sequence,
    the draft steps, the round trip) and advances every sequence by `tokens_per_round`
    instead of 1, so decode throughput changes by `tpr * T0 / (T0 + extra) - 1`; but every
    longer step also delays the prefill sharing it (TTFT) by `extra / T0`.

    * `capacity_bound` (prefill waits for batch slots or KV, not compute): faster decoding
      frees slots sooner; the gain is the decode gain.
    * `prefill_waiting` otherwise: prefill only slows down; the gain is minus the slowdown.
    * No step carried prefill lately (`prefill_share` 0): the decode gain.
    * Else, by `objective`: "ttft" (the default), minus the slowdown, since each prompt
      that arrives waits longer for its first token and nothing it waits for is freed
      sooner; "throughput", the decode gain over the share of steps that decode only minus
      the slowdown over the share that carry prefill. At light load (survivors at 57%,
      8 workers) "throughput" assisted, giving 1.8-2.4% TPOT for 3-4% TTFT
      (docs/simulator.md, *Sweep*).
    """
    if step_s <= 0:
        return 0.0
    decode = tokens_per_round * step_s / (step_s + verify_extra_s) - 1.0
    slowdown = verify_extra_s / step_s
    if capacity_bound:
        return decode
    if prefill_waiting:
        return -slowdown
    share = min(1.0, max(0.0, prefill_share))
    if share > 0 and objective == "ttft":
        return -slowdown
    return (1.0 - share) * decode - share * slowdown


def least_loaded_in(values: list[float]) -> int | None:
    """`least_loaded` from L_hat values the caller keeps up to date (+inf for dead workers),
    as `loads` returns them: the simulator's per-admission fast path."""
    return _argmin(values)


def choose_holder(
    snapshot: LoadSnapshot, serving: int, kv_bytes: float, cfg: PolicyConfig
) -> int | None:
    """Algorithm 1: the checkpoint holder for a request served by `serving`."""
    return choose_holder_in(loads(snapshot, cfg), snapshot, serving, kv_bytes)


def choose_holder_in(
    values: list[float], snapshot: LoadSnapshot, serving: int, kv_bytes: float,
    exclude: Sequence[int] = (),
) -> int | None:
    """Algorithm 1 from L_hat values as `loads` returns them (+inf for dead workers).

    `exclude` are workers that may not hold it (a replica's other holders); workers on a node
    of neither `serving` nor `exclude` are preferred, then any other node than `serving`'s,
    then the rest.
    """
    nodes = tuple(snapshot.nodes)
    ckpt, budget = snapshot.ckpt_bytes, snapshot.budget_bytes
    inf = math.inf
    if not exclude:
        # Fast path (C-level scans): the least loaded worker on another node, lowest index
        # among ties as _argmin, if its budget fits.
        home = _same_node_indices(nodes, serving)
        if len(home) < len(values):
            masked = values.copy()
            for i in home:
                masked[i] = inf
            low = min(masked)
            if low != inf:
                best = masked.index(low)
                if ckpt[best] + kv_bytes <= budget[best]:
                    return best
    fits = [v if h + kv_bytes <= b else inf
            for v, h, b in zip(values, ckpt, budget, strict=True)]
    fits[serving] = inf
    for i in exclude:
        fits[i] = inf
    homes = {nodes[serving], *(nodes[i] for i in exclude)}
    tiers = [[v if nodes[i] not in homes else inf for i, v in enumerate(fits)]]
    if exclude:
        away_mask = _other_node_mask(nodes, serving)
        tiers.append([v if m else inf for v, m in zip(fits, away_mask, strict=True)])
    tiers.append(fits)
    for tier in tiers:
        choice = _argmin(tier)
        if choice is not None:
            return choice
    return None


def choose_holders(
    snapshot: LoadSnapshot, serving: int, kv_bytes: float, cfg: PolicyConfig, replicas: int
) -> list[int]:
    """Algorithm 1 applied `replicas` times: each replica on the least-loaded worker that
    fits, preferring nodes that hold neither the server nor an earlier replica, so one host
    failing with the server leaves a copy. Fewer holders when budgets run out."""
    values = loads(snapshot, cfg)
    chosen: list[int] = []
    for _ in range(replicas):
        h = choose_holder_in(values, snapshot, serving, kv_bytes, exclude=chosen)
        if h is None:
            break
        chosen.append(h)
    return chosen


@functools.lru_cache(maxsize=1024)
def _same_node_indices(nodes: tuple[str, ...], serving: int) -> tuple[int, ...]:
    home = nodes[serving]
    return tuple(i for i, node in enumerate(nodes) if node == home)


@functools.lru_cache(maxsize=1024)
def _other_node_mask(nodes: tuple[str, ...], serving: int) -> tuple[bool, ...]:
    home = nodes[serving]
    return tuple(node != home for node in nodes)


def route_interrupted(
    snapshot: LoadSnapshot, holder: int | None, prefix_blocks: int, cfg: PolicyConfig,
    total_tokens: int | None = None,
) -> Route | None:
    """Algorithm 2. `holder` is None when the request has no usable checkpoint (never
    placed, or its holder died); `prefix_blocks` is the checkpointed prefix length.
    Cost-aware: `route_by_completion` (`total_tokens`: prompt + generated)."""
    if cfg.cost_aware:
        return route_by_completion(snapshot, holder, prefix_blocks, cfg, total_tokens)
    if holder is not None and snapshot.alive[holder] and prefix_blocks > 0 and (
        load_hat(snapshot, holder, cfg) <= cfg.theta or prefix_blocks > cfg.tau
    ):
        return Route(holder, resume=True)
    target = least_loaded(snapshot, cfg)
    return None if target is None else Route(target, resume=False)


def choose_assist_target(snapshot: LoadSnapshot, cfg: PolicyConfig) -> int | None:
    """Algorithm 3: the most loaded live worker (the one a draft model helps most).
    Cost-aware: the live worker with the highest positive `assist_gain`; None when none is
    positive or the snapshot has no gains."""
    if cfg.cost_aware:
        gains = snapshot.assist_gain
        if gains is None:
            return None
        live = [g if ok else -math.inf for g, ok in zip(gains, snapshot.alive, strict=True)]
        best = max(live, default=-math.inf)
        return live.index(best) if best > 0 else None
    values = loads(snapshot, cfg)
    live = [v if v != math.inf else -math.inf for v in values]
    best = max(live, default=-math.inf)
    return None if best == -math.inf else live.index(best)


# -- baselines ----------------------------------------------------------------------------


def neighbour_holder(snapshot: LoadSnapshot, serving: int, kv_bytes: float) -> int | None:
    """Fixed checkpointing's static holder: the worker at the same position on the next node
    (nodes in order of first appearance; the next worker when there is one node); None if it
    is dead or its budget is full. Static, so it spreads evenly but ignores load."""
    neighbour = _neighbours(tuple(snapshot.nodes))[serving]
    if neighbour is None:
        return None
    fits = snapshot.ckpt_bytes[neighbour] + kv_bytes <= snapshot.budget_bytes[neighbour]
    return neighbour if snapshot.alive[neighbour] and fits else None


@functools.lru_cache(maxsize=64)
def _neighbours(nodes: tuple[str, ...]) -> tuple[int | None, ...]:
    """The static neighbour of every worker; a function of the topology only."""
    n = len(nodes)
    if n < 2:
        return (None,) * n
    by_node: dict[str, list[int]] = {}
    for i, node in enumerate(nodes):
        by_node.setdefault(node, []).append(i)
    groups = list(by_node.values())
    if len(groups) == 1:
        return tuple((i + 1) % n for i in range(n))
    out: list[int | None] = [None] * n
    for k, group in enumerate(groups):
        nxt = groups[(k + 1) % len(groups)]
        for position, i in enumerate(group):
            out[i] = nxt[position % len(nxt)]
    return tuple(out)


def restart_route(snapshot: LoadSnapshot, cfg: PolicyConfig) -> Route | None:
    """Stop-and-restart: recompute on the least-loaded survivor."""
    target = least_loaded(snapshot, cfg)
    return None if target is None else Route(target, resume=False)


def holder_route(
    snapshot: LoadSnapshot, holder: int | None, prefix_blocks: int, cfg: PolicyConfig
) -> Route | None:
    """Fixed checkpointing: always resume on the holder when it has the checkpoint."""
    if holder is not None and snapshot.alive[holder] and prefix_blocks > 0:
        return Route(holder, resume=True)
    return restart_route(snapshot, cfg)


# -- dispatch by mode -----------------------------------------------------------------------


def place_checkpoint(
    snapshot: LoadSnapshot, serving: int, kv_bytes: float, cfg: PolicyConfig
) -> int | None:
    if cfg.mode is Mode.stop_and_restart:
        return None
    if cfg.mode is Mode.lumen and cfg.load_aware_placement:
        return choose_holder(snapshot, serving, kv_bytes, cfg)
    return neighbour_holder(snapshot, serving, kv_bytes)


def recover(
    snapshot: LoadSnapshot, holder: int | None, prefix_blocks: int, cfg: PolicyConfig,
    total_tokens: int | None = None,
) -> Route | None:
    if cfg.mode is Mode.stop_and_restart:
        return restart_route(snapshot, cfg)
    if cfg.mode is Mode.lumen and cfg.adaptive_routing:
        return route_interrupted(snapshot, holder, prefix_blocks, cfg, total_tokens)
    return holder_route(snapshot, holder, prefix_blocks, cfg)


def assist_target(snapshot: LoadSnapshot, cfg: PolicyConfig) -> int | None:
    return choose_assist_target(snapshot, cfg) if cfg.uses_assist else None


# -- replicated checkpoints ------------------------------------------------------------------


def place_checkpoint_replicas(
    snapshot: LoadSnapshot, serving: int, kv_bytes: float, cfg: PolicyConfig, replicas: int
) -> list[int]:
    """Holders of a checkpoint kept on `replicas` workers (1: as `place_checkpoint`).

    Load-aware placement applies Algorithm 1 once per replica (`choose_holders`); fixed
    checkpointing chains static neighbours (the neighbour, then its neighbour)."""
    if replicas < 1:
        raise ValueError(f"replicas must be >= 1, got {replicas}")
    if cfg.mode is Mode.stop_and_restart:
        return []
    if cfg.mode is Mode.lumen and cfg.load_aware_placement:
        return choose_holders(snapshot, serving, kv_bytes, cfg, replicas)
    out: list[int] = []
    neighbours = _neighbours(tuple(snapshot.nodes))
    at: int | None = serving
    for _ in range(replicas):
        at = neighbours[at] if at is not None else None
        if at is None or at == serving or at in out:
            break
        if snapshot.alive[at] and snapshot.ckpt_bytes[at] + kv_bytes <= snapshot.budget_bytes[at]:
            out.append(at)
    return out


def choose_replica(snapshot: LoadSnapshot, holders: Sequence[int], cfg: PolicyConfig) -> int | None:
    """The live holder an interrupted request with several checkpoint replicas is routed
    against (then `recover`): the least loaded, ties to the first listed."""
    best: int | None = None
    best_load = math.inf
    for h in holders:
        if snapshot.alive[h]:
            value = load_hat(snapshot, h, cfg)
            if best is None or value < best_load:
                best, best_load = h, value
    return best

"""Model presets of the sim engine: weights, load bandwidth, KV size and step cost.

`engine = "sim"` workers name one of these as their `model`.
"""

from __future__ import annotations

from dataclasses import dataclass

from lumend.engine.sim_core import SchedulerLimits, StepCost

MiB = 1 << 20
GiB = 1 << 30


@dataclass(frozen=True)
class SimModel:
    name: str
    weight_bytes: int
    disk_bytes_per_s: float
    init_s: float  # engine initialisation after the weights are in place
    kv_bytes_per_token: int
    kv_cache_bytes: int  # KV pool materialised on wake, freed on sleep
    cost: StepCost
    limits: SchedulerLimits

    def load_seconds(self) -> float:
        return self.weight_bytes / self.disk_bytes_per_s


SIM_MODELS: dict[str, SimModel] = {
    # Small and fast: tests and the demo. Loading it "from disk" takes ~0.5 s, initialising
    # 0.5 s more, so a cold restart is visibly slower than a shadow taking over.
    "sim-small": SimModel(
        name="sim-small",
        weight_bytes=128 * MiB,
        disk_bytes_per_s=256 * MiB,
        init_s=0.5,
        kv_bytes_per_token=16 * 1024,
        kv_cache_bytes=32 * MiB,
        cost=StepCost(a=0.004, b=2e-5, c=0.0, d=1e-4, e=1e-7),
        limits=SchedulerLimits(max_batch=64, prefill_chunk=512, kv_blocks=4096),
    ),
}


# A slower-loading model: its cold restart (weights from disk, then initialisation) is long
# enough to watch a recovering worker assist a survivor before it serves again.
SIM_MODELS["sim-medium"] = SimModel(
    name="sim-medium",
    weight_bytes=1 * GiB,
    disk_bytes_per_s=256 * MiB,
    init_s=6.0,
    kv_bytes_per_token=16 * 1024,
    kv_cache_bytes=32 * MiB,
    cost=StepCost(a=0.004, b=2e-5, c=0.0, d=1e-4, e=1e-7),
    limits=SchedulerLimits(max_batch=64, prefill_chunk=512, kv_blocks=4096),
)


@dataclass(frozen=True)
class SimDraft:
    """A sim worker's `draft_model`: the drafter it runs while its engine reloads (a noisy
    copy of the target's token function, lumend.assist.sim_draft)."""

    name: str
    agreement: float  # P(a drafted token is the target's)
    seconds_per_token: float  # the draft model's decode step
    load_s: float  # loading the draft model: far shorter than the target's reload


SIM_DRAFTS: dict[str, SimDraft] = {
    d.name: d for d in (
        SimDraft(name="sim-draft", agreement=0.8, seconds_per_token=0.0005, load_s=0.2),
        SimDraft(name="sim-draft-perfect", agreement=1.0, seconds_per_token=0.0005,
                 load_s=0.2),
        SimDraft(name="sim-draft-noisy", agreement=0.4, seconds_per_token=0.0005,
                 load_s=0.2),
    )
}


def sim_model(name: str) -> SimModel:
    try:
        return SIM_MODELS[name]
    except KeyError:
        raise ValueError(
            f"unknown sim model {name!r}; sim workers name a preset: {', '.join(SIM_MODELS)}"
        ) from None

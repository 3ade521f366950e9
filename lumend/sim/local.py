"""The simulator set up as the local cluster's sim engines: the same step formula and
coefficients (`lumend.engine.sim_models`), times the engines' `--time-scale`, the same batch
and KV limits and KV rule (no preemption: the sim engine admits a prompt that fits and lets
running sequences grow past its pool), and the same way back after a crash (weights mapped
from the node's GMS server, then initialisation). Used by `bench/validate_sim.py` to run
one trace and one fault both on a real local cluster and here.

What is *not* the cost model stays a parameter: the restore bandwidth from a holder over
loopback (the engines move real bytes, not time-scaled ones) and the process start of a
restarted engine, which the cost model does not know.
"""

from __future__ import annotations

from dataclasses import replace

from lumend.engine.costmodel import CostModel, GpuProfile, ModelShape
from lumend.engine.sim_core import BLOCK_SIZE
from lumend.engine.sim_models import SimModel, sim_model
from lumend.sim.config import FaultKind, FaultSpec, SimConfig

GIB = float(1 << 30)


def sim_engine_cost(model: SimModel, time_scale: float) -> CostModel:
    """The cost model of a sim engine of `model` run with `--time-scale time_scale`: its
    step coefficients in wall seconds (the engine sleeps step_time x time_scale)."""
    if time_scale <= 0:
        raise ValueError(f"time scale must be positive, got {time_scale}")
    step = model.cost.scaled(compute=time_scale, kv=time_scale, min_a=0.0)
    shape = ModelShape(name=f"{model.name} x{time_scale:g}",
                       kv_bytes_per_token=model.kv_bytes_per_token,
                       weight_bytes=float(model.weight_bytes), compute_scale=time_scale,
                       draft=None)
    # One engine per node, as the local cluster runs them; memory is not what bounds the
    # KV here (SimConfig.kv_capacity_tokens is the engine's block pool).
    gpu = GpuProfile(name="sim-engine", tensor_parallel=1, gpus_per_node=1,
                     memory_bytes=float(model.weight_bytes + model.kv_cache_bytes) / 0.9,
                     hbm_bytes_per_s=1.0, points=())
    return CostModel(shape, gpu, step, step)


def restart_seconds(model: SimModel, time_scale: float, process_start_s: float) -> float:
    """A crashed sim engine's way back: a new process (`process_start_s`, measured, not
    modelled), weights mapped from the surviving GMS server (no disk read), initialisation."""
    return process_start_s + model.init_s * time_scale


# LocalCluster's nodes run with a 3 s lease and beat every lease / 3
# (`EtcdSection.effective_heartbeat_s`).
LOCAL_HEARTBEAT_S = 1.0


def local_cluster_config(model_name: str, time_scale: float, workers: int, *,
                         fault_at_s: float, restore_bytes_per_s: float,
                         fault_kind: FaultKind = FaultKind.worker,
                         process_start_s: float, request_overhead_s: float = 0.0,
                         victim: int = 0, budget_bytes: float = GIB,
                         heartbeat_s: float = 0.0,
                         base: SimConfig | None = None) -> SimConfig:
    """A SimConfig of `workers` one-engine nodes running sim engines of `model_name` at
    `time_scale`, worker `victim`'s engine SIGKILLed at `fault_at_s` (`fault_kind`
    FaultKind.hang: SIGSTOPped, killed by its supervisor later; no shadows). The
    workers are in the coordinator's order (by name), so that admission's ties go where
    they go on the cluster: `victim` is the killed worker's place in that order. Restores
    run beside the engine, as the sim engine loads pages before it queues the request.
    `request_overhead_s`: the measured time from a client's send until the engine's
    scheduler has the request (HTTP, the gateway, tokenization), which no step cost has.
    `heartbeat_s`: the nodes' heartbeat, whose queue lengths the coordinator's admission
    column holds until the next (`SimConfig.admission_heartbeat_s`; LOCAL_HEARTBEAT_S for
    LocalCluster's nodes); 0: exact counts."""
    model = sim_model(model_name)
    limits = model.limits
    return replace(
        base or SimConfig(),
        workers=workers, model=model.name, gpu="sim-engine",
        cost=sim_engine_cost(model, time_scale),
        chunk_tokens=limits.prefill_chunk, decode_in_budget=False,
        max_batch=limits.max_batch, kv_capacity_tokens=limits.kv_blocks * BLOCK_SIZE,
        kv_preemption=False, prefill_end_decodes=True,
        block_tokens=BLOCK_SIZE, budget_bytes=budget_bytes,
        request_overhead_s=request_overhead_s, admission_heartbeat_s=heartbeat_s,
        restore_bytes_per_s=restore_bytes_per_s, restore_async=True,
        reload_s=restart_seconds(model, time_scale, process_start_s), shadows=False,
        fault=FaultSpec(kind=fault_kind, at_s=fault_at_s, worker=victim),
    )

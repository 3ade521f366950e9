"""The cluster's policy settings (etcd `config`): checked, parsed from `KEY VALUE` text, and
turned into the `PolicyConfig` the policy functions take.

`decisions` selects how (docs/operator-guide.md, "Policy settings"):
* `cost_aware` (default): admission to the shortest queue (checkpoint bytes held cost no
  GPU time, so they do not count as serving load); Algorithm 1 by L_hat in seconds (one held
  byte's restore time, one queued request's mean prefill: `policy.in_seconds` over the cost
  model in `PolicyConfig`'s defaults, shared with the simulator); Algorithm 2 by estimated
  completion time. alpha, beta, theta and tau are kept but not used.
* `paper`: Algorithms 1-3 as published, L_hat = alpha * bytes held + beta * queue, with
  theta and tau.

The cost model's restore bandwidth and prefill cost are measured where the engines count
them (lumend.coordinator.estimates): the coordinator decides with `InForce` settings, the
stored ones plus what it measured from the same view.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable
from dataclasses import replace
from typing import get_args

import msgspec

from lumend.cluster.models import (
    AssistObjective,
    ClusterSettings,
    Costs,
    Decisions,
    PolicyMode,
    WorkerRecord,
)
from lumend.coordinator.estimates import CostEstimates, estimate
from lumend.coordinator.policy import Mode, PolicyConfig, in_seconds

MODES: tuple[str, ...] = get_args(PolicyMode)
DECISIONS: tuple[str, ...] = get_args(Decisions)
COSTS: tuple[str, ...] = get_args(Costs)
ASSIST_OBJECTIVES: tuple[str, ...] = get_args(AssistObjective)
KEYS: dict[str, str] = {
    "alpha": "L_hat weight of one checkpoint byte held (a number >= 0; default 1/GiB; "
             "decisions paper only)",
    "beta": "L_hat weight of one queued request (a number >= 0; decisions paper only)",
    "theta": "L_hat above which a holder is overloaded for resumption (a number >= 0; "
             "decisions paper only)",
    "tau": "prefix length in 16-token blocks above which an interrupted request resumes "
           "from its checkpoint regardless of load (an integer >= 0; decisions paper only)",
    "mode": "policy: " + ", ".join(MODES),
    "decisions": "cost_aware (admission to the shortest queue, placement and recovery by "
                 "estimated seconds) or paper (Algorithms 1-3 as published: L_hat, theta, "
                 "tau)",
    "costs": "measured (cost-aware decisions use the restore bandwidth, KV bytes and "
             "prefill cost the engines measure, where they have) or constant (the built-in "
             "figures only)",
    "assist_objective": "ttft (draft-assist only where faster decoding delays no prompt: "
                        "prefill waiting for batch slots or KV, or none lately) or "
                        "throughput (also trades prompt delay for decode speed by the share "
                        "of steps each takes); decisions cost_aware only",
}


class SettingError(ValueError):
    """A key or value `lumenctl config set` cannot store; the message says what to do."""


def parse_setting(settings: ClusterSettings, key: str, text: str) -> ClusterSettings:
    """`settings` with `key` set from `text`."""
    if key not in KEYS:
        raise SettingError(f"unknown setting {key!r}; the settings are: {', '.join(KEYS)}")
    value: float | int | str
    if key == "mode":
        if text not in MODES:
            raise SettingError(f"mode {text!r} is not a policy; use one of {', '.join(MODES)}")
        value = text
    elif key == "decisions":
        if text not in DECISIONS:
            raise SettingError(f"decisions {text!r} is not a way of deciding; use one of "
                               f"{', '.join(DECISIONS)}")
        value = text
    elif key == "costs":
        if text not in COSTS:
            raise SettingError(f"costs {text!r} is not a source of cost figures; use one of "
                               f"{', '.join(COSTS)}")
        value = text
    elif key == "assist_objective":
        if text not in ASSIST_OBJECTIVES:
            raise SettingError(f"assist_objective {text!r} is not an objective; use one of "
                               f"{', '.join(ASSIST_OBJECTIVES)}")
        value = text
    elif key == "tau":
        try:
            value = int(text)
        except ValueError:
            raise SettingError(f"tau {text!r} is not an integer; give a block count such as "
                               "64") from None
        if value < 0:
            raise SettingError(f"tau {value} is negative; give a block count >= 0")
    else:
        try:
            value = float(text)
        except ValueError:
            raise SettingError(f"{key} {text!r} is not a number; e.g. {key} 1.5 or 9.3e-10"
                               ) from None
        if not math.isfinite(value) or value < 0:
            raise SettingError(f"{key} {text} must be a finite number >= 0")
    return msgspec.structs.replace(settings, **{key: value})


def check(settings: ClusterSettings) -> ClusterSettings:
    """Range checks a decoded value (types are checked by its decoder); SettingError if bad."""
    for key in ("alpha", "beta", "theta"):
        value = getattr(settings, key)
        if not math.isfinite(value) or value < 0:
            raise SettingError(f"{key} = {value} must be a finite number >= 0")
    if settings.tau < 0:
        raise SettingError(f"tau = {settings.tau} must be >= 0")
    return settings


class InForce(ClusterSettings, frozen=True, kw_only=True):
    """The settings a coordinator decides with: the stored ones, and the cost figures it
    measured from the same view (lumend.coordinator.estimates; None: the default constant).
    Never stored: the `config` key holds what operators set, decoded as ClusterSettings."""

    restore_bytes_per_s: float | None = None
    recompute_s_per_token: float | None = None
    kv_bytes_per_token: float | None = None


def costs_in_use(settings: ClusterSettings | None, workers: Iterable[WorkerRecord]
                 ) -> CostEstimates:
    """The cost figures decisions use: measured from `workers`' counters, or (setting
    `costs = constant`) the constants alone."""
    s = settings or ClusterSettings()
    return estimate(workers if s.costs == "measured" else ())


def in_force(settings: ClusterSettings | None, costs: CostEstimates) -> InForce:
    """`settings` (None: the defaults) with the measured figures of `costs`."""
    s = settings or ClusterSettings()
    fields = {name: getattr(s, name) for name in ClusterSettings.__struct_fields__}
    return InForce(**fields,
                   restore_bytes_per_s=costs.restore.value if costs.restore.measured
                   else None,
                   recompute_s_per_token=costs.prefill.value if costs.prefill.measured
                   else None,
                   kv_bytes_per_token=costs.kv.value if costs.kv.measured else None)


def measured_policy_config(settings: ClusterSettings | None,
                           workers: Iterable[WorkerRecord]) -> PolicyConfig:
    """The PolicyConfig a decision from a view uses: its settings, with the cost figures
    measured from its workers (what the coordinator decides with, for callers that take
    views one decision at a time, such as a degraded gateway)."""
    return policy_config(in_force(settings, costs_in_use(settings, workers)))


def policy_config(settings: ClusterSettings | None) -> PolicyConfig:
    s = settings or ClusterSettings()
    if s.decisions == "cost_aware":
        measured = s if isinstance(s, InForce) else None
        return _cost_aware(s.theta, s.tau, s.mode, s.assist_objective,
                           measured and measured.restore_bytes_per_s,
                           measured and measured.recompute_s_per_token,
                           measured and measured.kv_bytes_per_token)
    return PolicyConfig(alpha=s.alpha, beta=s.beta, theta=s.theta, tau=s.tau, mode=Mode(s.mode),
                        assist_objective=s.assist_objective)


@functools.lru_cache(maxsize=16)
def _cost_aware(theta: float, tau: int, mode: str, objective: str = "ttft",
                restore_bytes_per_s: float | None = None,
                recompute_s_per_token: float | None = None,
                kv_bytes_per_token: float | None = None) -> PolicyConfig:
    # Cached: the load book builds one per view (the config is frozen, so sharing is safe).
    # Measured figures change the record a worker writes in steps of 1/128 at most (its
    # counters' rounding), so a few entries cover a cluster's views.
    cfg = PolicyConfig(theta=theta, tau=tau, mode=Mode(mode), cost_aware=True,
                       admission="queue", assist_objective=objective)
    if restore_bytes_per_s is not None:
        cfg = replace(cfg, restore_bytes_per_s=restore_bytes_per_s)
    if recompute_s_per_token is not None:
        cfg = replace(cfg, recompute_s_per_token=recompute_s_per_token)
    if kv_bytes_per_token is not None:
        cfg = replace(cfg, kv_bytes_per_token=kv_bytes_per_token)
    return in_seconds(cfg)


def as_rows(settings: ClusterSettings) -> list[dict[str, object]]:
    """One row per key (key, value, meaning), for `lumenctl config show`."""
    default = ClusterSettings()
    return [{"key": key, "value": getattr(settings, key),
             "default": getattr(settings, key) == getattr(default, key), "meaning": meaning}
            for key, meaning in KEYS.items()]

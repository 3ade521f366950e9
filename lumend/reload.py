"""Config reload (SIGHUP): which changed keys lumend applies live and which need a restart.

Pure: `plan_reload` compares the running config with the new file and returns the config to
run with (the old one plus the live keys' new values) and the changed keys it refuses. A key
becomes live only when the part of lumend that uses it can apply it: today `metrics.listen`,
`gateway.api_keys` and `gateway.log_admissions`. Workers and the checkpoint budget are not
live (a restart, which the Ansible role precedes with a drain).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgspec

from lumend.config import NodeConfig

# Dotted key -> what applying it does (for the log line).
LIVE_KEYS: dict[str, str] = {
    "metrics.listen": "the metrics server moves to the new address",
    "gateway.api_keys": "the gateway checks requests against the keys of the new file",
    "gateway.log_admissions": "the gateway logs its placement decisions, or stops",
}


@dataclass(frozen=True)
class ReloadPlan:
    config: NodeConfig  # what to run with: old values, plus the live keys' new values
    live: list[str]  # changed keys to apply now
    refused: list[str]  # changed keys that need a restart; their old values stay in force


def changed_keys(old: NodeConfig, new: NodeConfig) -> list[str]:
    """Dotted paths of every leaf that differs, e.g. "etcd.endpoints", "workers[0].gpus"."""
    found: list[str] = []
    _diff(msgspec.to_builtins(old), msgspec.to_builtins(new), "", found)
    return found


def _diff(a: Any, b: Any, path: str, found: list[str]) -> None:
    if isinstance(a, dict) and isinstance(b, dict):
        for key in sorted(set(a) | set(b)):
            _diff(a.get(key), b.get(key), f"{path}.{key}" if path else key, found)
    elif path == "workers" and isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _diff(x, y, f"{path}[{i}]", found)
    elif a != b:
        found.append(path)


def plan_reload(old: NodeConfig, new: NodeConfig) -> ReloadPlan:
    changed = changed_keys(old, new)
    live = [key for key in changed if key in LIVE_KEYS]
    refused = [key for key in changed if key not in LIVE_KEYS]
    config = old
    if "metrics.listen" in live:
        config = msgspec.structs.replace(config, metrics=new.metrics)
    if "gateway.api_keys" in live:
        config = msgspec.structs.replace(config, gateway=msgspec.structs.replace(
            config.gateway, api_keys=new.gateway.api_keys))
    if "gateway.log_admissions" in live:
        config = msgspec.structs.replace(config, gateway=msgspec.structs.replace(
            config.gateway, log_admissions=new.gateway.log_admissions))
    return ReloadPlan(config=config, live=live, refused=refused)

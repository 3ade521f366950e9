"""The cluster's policy settings (etcd `config`): checked, parsed from `KEY VALUE` text, and
turned into the `PolicyConfig` the policy functions take."""

from __future__ import annotations

import math
from typing import get_args

import msgspec

from lumend.cluster.models import ClusterSettings, PolicyMode
from lumend.coordinator.policy import Mode, PolicyConfig

MODES: tuple[str, ...] = get_args(PolicyMode)
KEYS: dict[str, str] = {
    "alpha": "L_hat weight of one checkpoint byte held (a number >= 0; default 1/GiB)",
    "beta": "L_hat weight of one queued request (a number >= 0)",
    "theta": "L_hat above which a holder is overloaded for resumption (a number >= 0)",
    "tau": "prefix length in 16-token blocks above which an interrupted request resumes "
           "from its checkpoint regardless of load (an integer >= 0)",
    "mode": "policy: " + ", ".join(MODES),
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


def policy_config(settings: ClusterSettings | None) -> PolicyConfig:
    s = settings or ClusterSettings()
    return PolicyConfig(alpha=s.alpha, beta=s.beta, theta=s.theta, tau=s.tau, mode=Mode(s.mode))


def as_rows(settings: ClusterSettings) -> list[dict[str, object]]:
    """One row per key (key, value, meaning), for `lumenctl config show`."""
    default = ClusterSettings()
    return [{"key": key, "value": getattr(settings, key),
             "default": getattr(settings, key) == getattr(default, key), "meaning": meaning}
            for key, meaning in KEYS.items()]

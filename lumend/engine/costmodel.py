"""Step-time and load-time cost model, shared by the cluster simulator and the sim engine.

Interface (everything a caller needs):

* `load_cost_model(model, gpu) -> CostModel` — a preset from `presets/*.toml`.
* `CostModel.step_time(prefill_tokens, decode_batch, decode_context) -> seconds` for one
  engine iteration: `a + b*P + c*P^2 + d*B + e*C` with P prefill tokens in the step, B
  sequences decoding one token each and C the sum of their context lengths.
* `CostModel.kv_bytes(tokens)`, `CostModel.kv_capacity_tokens`,
  `CostModel.load_time(disk_bytes_per_s, init_s)` (weights / disk bandwidth + init) and
  `CostModel.draft` (the draft model's CostModel, or None).
* `fit_step_coefficients(points, e)` — the reproducible fit: weighted least squares (each
  point weighted by 1/time^2, i.e. relative error) of a, b, c, d over the published points,
  with e fixed from the memory-bandwidth prior. No numpy: a 4x4 normal-equation solve.
* `model_names()`, `gpu_names()`; errors are `PresetError` naming the file and key.

Presets are data: measured points in `presets/gpus.toml`, model shapes in
`presets/models.toml`. Models other than the measured reference are derived by scaling
(see the comment at the top of models.toml).
"""

from __future__ import annotations

import tomllib
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any

PRESETS = Path(__file__).parent / "presets"
GPU_MEMORY_UTILIZATION = 0.9  # vLLM's default share of GPU memory for weights + KV


class PresetError(ValueError):
    """A preset name that does not exist or a preset file that does not parse."""


@dataclass(frozen=True, slots=True)
class StepCoefficients:
    a: float  # s per step
    b: float  # s per prefill token
    c: float  # s per prefill token^2
    d: float  # s per decoding sequence
    e: float  # s per context token of the decoding sequences

    def step_time(self, prefill_tokens: float, decode_batch: float, decode_context: float) -> float:
        p = prefill_tokens
        return (self.a + self.b * p + self.c * p * p + self.d * decode_batch
                + self.e * decode_context)

    def scaled(self, compute: float, kv: float, min_a: float) -> StepCoefficients:
        return StepCoefficients(
            a=max(self.a * compute, min_a), b=self.b * compute, c=self.c * compute,
            d=self.d * compute, e=self.e * kv,
        )


@dataclass(frozen=True, slots=True)
class StepPoint:
    """One measurement: a step with `prefill_tokens`, `decode_batch` sequences decoding
    with `decode_context` context tokens in total, took `seconds`."""

    prefill_tokens: float
    decode_batch: float
    decode_context: float
    seconds: float


@dataclass(frozen=True, slots=True)
class ModelShape:
    name: str
    kv_bytes_per_token: int
    weight_bytes: float
    compute_scale: float
    draft: str | None


@dataclass(frozen=True, slots=True)
class GpuProfile:
    name: str
    tensor_parallel: int
    gpus_per_node: int
    memory_bytes: float
    hbm_bytes_per_s: float
    points: tuple[StepPoint, ...]

    @property
    def workers_per_node(self) -> int:
        return max(1, self.gpus_per_node // self.tensor_parallel)


@dataclass(frozen=True, slots=True)
class CostModel:
    model: ModelShape
    gpu: GpuProfile
    coefficients: StepCoefficients
    reference: StepCoefficients  # the fit for the measured reference model
    draft: CostModel | None = field(default=None)

    def step_time(self, prefill_tokens: float, decode_batch: float, decode_context: float) -> float:
        return self.coefficients.step_time(prefill_tokens, decode_batch, decode_context)

    def kv_bytes(self, tokens: float) -> float:
        return tokens * self.model.kv_bytes_per_token

    @property
    def kv_capacity_tokens(self) -> int:
        free = self.gpu.memory_bytes * GPU_MEMORY_UTILIZATION - self.model.weight_bytes
        if free <= 0:
            raise PresetError(
                f"model {self.model.name} ({self.model.weight_bytes / 1e9:.0f} GB) does not fit "
                f"on {self.gpu.name} ({self.gpu.memory_bytes / 1e9:.0f} GB); pick a larger --gpu"
            )
        return int(free // self.model.kv_bytes_per_token)

    def load_time(self, disk_bytes_per_s: float, init_s: float) -> float:
        """Seconds from process start to serving: read the weights, then initialise."""
        return self.model.weight_bytes / disk_bytes_per_s + init_s


# -- fitting --------------------------------------------------------------------------------


def fit_step_coefficients(points: Sequence[StepPoint], e: float) -> StepCoefficients:
    """Weighted least squares of a, b, c, d (e fixed) minimising relative error."""
    if len(points) < 4:
        raise ValueError(f"need at least 4 points to fit a, b, c, d; got {len(points)}")
    rows = [(1.0, p.prefill_tokens, p.prefill_tokens**2, p.decode_batch) for p in points]
    targets = [p.seconds - e * p.decode_context for p in points]
    weights = [1.0 / (p.seconds * p.seconds) for p in points]
    # Scale columns to unit maximum so the normal equations stay well conditioned.
    scale = [max(abs(r[j]) for r in rows) or 1.0 for j in range(4)]
    x = [[r[j] / scale[j] for j in range(4)] for r in rows]
    normal = [
        [sum(w * xi[j] * xi[k] for w, xi in zip(weights, x, strict=True)) for k in range(4)]
        for j in range(4)
    ]
    rhs = [sum(w * xi[j] * y for w, xi, y in zip(weights, x, targets, strict=True))
           for j in range(4)]
    solution = _solve(normal, rhs)
    a, b, c, d = (solution[j] / scale[j] for j in range(4))
    return StepCoefficients(a=a, b=b, c=c, d=d, e=e)


def _solve(matrix: list[list[float]], rhs: list[float]) -> list[float]:
    """Gaussian elimination with partial pivoting."""
    n = len(rhs)
    m = [[*row, rhs[i]] for i, row in enumerate(matrix)]
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(m[r][col]))
        if abs(m[pivot][col]) < 1e-300:
            raise ValueError("the points do not determine the coefficients (singular system)")
        m[col], m[pivot] = m[pivot], m[col]
        for r in range(col + 1, n):
            f = m[r][col] / m[col][col]
            for k in range(col, n + 1):
                m[r][k] -= f * m[col][k]
    out = [0.0] * n
    for r in range(n - 1, -1, -1):
        out[r] = (m[r][n] - sum(m[r][k] * out[k] for k in range(r + 1, n))) / m[r][r]
    return out


# -- presets --------------------------------------------------------------------------------


def _load_toml(name: str) -> dict[str, Any]:
    path = PRESETS / name
    try:
        with path.open("rb") as f:
            return tomllib.load(f)
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise PresetError(f"cannot read preset file {path}: {exc}") from exc


def _get(table: dict[str, Any], key: str, where: str) -> Any:
    if key not in table:
        raise PresetError(f"{where}: missing key {key!r}")
    return table[key]


@cache
def _gpus() -> tuple[dict[str, GpuProfile], int]:
    data = _load_toml("gpus.toml")
    ref_kv = int(_get(_get(data, "reference", "gpus.toml"), "kv_bytes_per_token",
                      "gpus.toml [reference]"))
    out: dict[str, GpuProfile] = {}
    for name, t in _get(data, "gpu", "gpus.toml").items():
        where = f"gpus.toml [gpu.{name}]"
        ctx = float(_get(t, "decode_context_per_request", where))
        prefill = zip(_get(t, "prefill_tokens", where), _get(t, "prefill_ms", where), strict=True)
        decode = zip(_get(t, "decode_batch", where), _get(t, "decode_ms", where), strict=True)
        points = tuple(StepPoint(float(p), 0.0, 0.0, ms / 1000) for p, ms in prefill) + tuple(
            StepPoint(0.0, float(bs), bs * ctx, ms / 1000) for bs, ms in decode
        )
        out[name] = GpuProfile(
            name=name, tensor_parallel=int(_get(t, "tensor_parallel", where)),
            gpus_per_node=int(_get(t, "gpus_per_node", where)),
            memory_bytes=float(_get(t, "memory_bytes", where)),
            hbm_bytes_per_s=float(_get(t, "hbm_bytes_per_s", where)), points=points,
        )
    return out, ref_kv


@cache
def _models() -> tuple[dict[str, ModelShape], float]:
    data = _load_toml("models.toml")
    out: dict[str, ModelShape] = {}
    for name, t in _get(data, "model", "models.toml").items():
        where = f"models.toml [model.{name}]"
        out[name] = ModelShape(
            name=name, kv_bytes_per_token=int(_get(t, "kv_bytes_per_token", where)),
            weight_bytes=float(_get(t, "weight_bytes", where)),
            compute_scale=float(_get(t, "compute_scale", where)), draft=t.get("draft"),
        )
    min_step = float(_get(_get(data, "defaults", "models.toml"), "min_step_s",
                          "models.toml [defaults]"))
    return out, min_step


def model_names() -> list[str]:
    return sorted(_models()[0])


def gpu_names() -> list[str]:
    return sorted(_gpus()[0])


def reference_fit(gpu: str) -> StepCoefficients:
    """The fit of the measured reference model's points on `gpu`."""
    gpus, ref_kv = _gpus()
    if gpu not in gpus:
        raise PresetError(f"unknown gpu {gpu!r}; known: {', '.join(sorted(gpus))}")
    profile = gpus[gpu]
    return fit_step_coefficients(profile.points, e=ref_kv / profile.hbm_bytes_per_s)


@cache
def load_cost_model(model: str, gpu: str) -> CostModel:
    models, min_step = _models()
    if model not in models:
        raise PresetError(f"unknown model {model!r}; known: {', '.join(sorted(models))}")
    shape = models[model]
    profile = _gpus()[0].get(gpu)
    reference = reference_fit(gpu)  # raises for an unknown gpu
    assert profile is not None
    ref_kv = _gpus()[1]
    coefficients = reference.scaled(shape.compute_scale, shape.kv_bytes_per_token / ref_kv,
                                    min_step)
    draft = load_cost_model(shape.draft, gpu) if shape.draft else None
    return CostModel(shape, profile, coefficients, reference, draft)

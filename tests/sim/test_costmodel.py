from __future__ import annotations

import pytest

from lumend.engine.costmodel import (
    PresetError,
    StepCoefficients,
    StepPoint,
    fit_step_coefficients,
    gpu_names,
    load_cost_model,
    model_names,
    reference_fit,
)


def test_fit_recovers_known_coefficients_exactly() -> None:
    truth = StepCoefficients(a=0.03, b=6e-5, c=1e-8, d=3e-4, e=2e-8)
    points = [StepPoint(p, 0, 0, truth.step_time(p, 0, 0)) for p in (512, 1024, 2048, 4096)]
    points += [StepPoint(0, bs, bs * 1000, truth.step_time(0, bs, bs * 1000)) for bs in (1, 64)]
    fitted = fit_step_coefficients(points, e=truth.e)
    for name in ("a", "b", "c", "d"):
        assert getattr(fitted, name) == pytest.approx(getattr(truth, name), rel=1e-6)


def test_fit_with_the_wrong_prior_is_detectably_off() -> None:
    # Negative control: fixing e far from the truth moves the fitted intercept.
    truth = StepCoefficients(a=0.03, b=6e-5, c=1e-8, d=3e-4, e=2e-6)
    points = [StepPoint(p, 0, 0, truth.step_time(p, 0, 0)) for p in (512, 1024, 4096)]
    points += [StepPoint(0, bs, bs * 1000, truth.step_time(0, bs, bs * 1000)) for bs in (1, 64)]
    fitted = fit_step_coefficients(points, e=0.0)
    assert fitted.d != pytest.approx(truth.d, rel=0.5)


@pytest.mark.parametrize("gpu", ["a100-tp4", "a100-tp8", "h100-tp4", "h100-tp8"])
def test_published_points_are_reproduced_within_ten_percent(gpu: str) -> None:
    fit = reference_fit(gpu)
    model = load_cost_model("llama-3-70b", gpu)
    assert len(model.gpu.points) == 6
    for p in model.gpu.points:
        predicted = fit.step_time(p.prefill_tokens, p.decode_batch, p.decode_context)
        assert predicted == pytest.approx(p.seconds, rel=0.10)
    assert min(fit.a, fit.b, fit.c, fit.d, fit.e) > 0


def test_presets_shapes_and_load_time() -> None:
    assert {"llama-3-70b", "qwen3-32b", "qwen3-14b", "sim-small"} <= set(model_names())
    assert {"a100-tp4", "h100-tp4"} <= set(gpu_names())
    qwen = load_cost_model("qwen3-32b", "h100-tp4")
    assert qwen.model.kv_bytes_per_token == 256 * 1024
    assert load_cost_model("llama-3-70b", "h100-tp4").model.kv_bytes_per_token == 320 * 1024
    qwen14 = load_cost_model("qwen3-14b", "h100-tp4").model
    assert qwen14.kv_bytes_per_token == 40 * 8 * 128 * 2 * 2  # 40 layers, K and V, bf16
    assert qwen.load_time(disk_bytes_per_s=2e9, init_s=10.0) == pytest.approx(65.5 / 2 + 10)
    assert qwen.kv_bytes(100) == 100 * 256 * 1024
    assert qwen.draft is not None and qwen.draft.model.weight_bytes < 5e9
    # Derived models are cheaper per step than the measured 70B reference.
    big = load_cost_model("llama-3-70b", "h100-tp4")
    assert qwen.step_time(2048, 32, 32 * 1000) < big.step_time(2048, 32, 32 * 1000)
    assert qwen.kv_capacity_tokens > 100_000


def test_unknown_presets_are_named() -> None:
    with pytest.raises(PresetError, match="unknown model 'gpt-9'"):
        load_cost_model("gpt-9", "h100-tp4")
    with pytest.raises(PresetError, match="unknown gpu 'tpu'"):
        load_cost_model("qwen3-32b", "tpu")

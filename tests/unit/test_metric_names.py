"""Engine-side metric names follow Prometheus conventions (no colon, counters end in
_total), and the 0.1 names stay exported, with the same values, as deprecated aliases."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from lumend.engine.metric_names import (
    CKPT_REQUESTS_COMPLETE,
    CKPT_REQUESTS_RUNNING,
    ckpt_counter,
    deprecated,
)


def test_names() -> None:
    assert CKPT_REQUESTS_RUNNING == "lumen_ckpt_requests_running"
    assert deprecated(CKPT_REQUESTS_RUNNING) == "lumen:ckpt_requests_running"
    assert ckpt_counter("blocks_saved") == "lumen_ckpt_blocks_saved"
    assert ":" not in CKPT_REQUESTS_COMPLETE


def test_the_vllm_connector_exports_both_names() -> None:
    pytest.importorskip("vllm")
    from lumend.engine.vllm_connector import COUNTERS, LumenPromMetrics

    registry = CollectorRegistry()

    def bound(cls: type) -> object:
        return lambda **kw: cls(registry=registry, **kw)

    metrics = LumenPromMetrics(
        SimpleNamespace(kv_transfer_config=None),  # type: ignore[arg-type]
        {Gauge: bound(Gauge), Counter: bound(Counter), Histogram: bound(Histogram)},
        ["model_name", "engine"], {0: ["m", "0"]})
    metrics.observe({"ckpt_running": 3, "ckpt_complete": 2, "blocks_saved": 5})
    samples = {s.name: s.value for family in text_string_to_metric_families(
        generate_latest(registry).decode()) for s in family.samples}
    assert samples["lumen_ckpt_requests_running"] == samples["lumen:ckpt_requests_running"] == 3
    assert samples["lumen_ckpt_requests_complete"] == samples["lumen:ckpt_requests_complete"] == 2
    assert samples["lumen_ckpt_blocks_saved_total"] == samples["lumen:ckpt_blocks_saved_total"] == 5
    for key in COUNTERS:
        assert f"lumen_ckpt_{key}_total" in samples and f"lumen:ckpt_{key}_total" in samples

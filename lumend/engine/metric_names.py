"""Names of the metrics LUMEN adds to an engine's own /metrics (vLLM's and the sim's), in
one place: lumend's adapter reads what the engines write.

Prometheus conventions: no colon (reserved for recording rules), counters end in
`_total` (prometheus_client adds it to a Counter's name). The names of release 0.1
(`lumen:ckpt_*`) are exported too, as deprecated aliases with the same values, for one
release (docs/operator-guide.md, "Metric names"); queries should move to the new names.
"""

from __future__ import annotations

# Gauges lumend reads as a worker's checkpoint coverage: running requests with a LUMEN
# checkpoint plan, and those of them whose checkpoint has lost no block so far.
CKPT_REQUESTS_RUNNING = "lumen_ckpt_requests_running"
CKPT_REQUESTS_COMPLETE = "lumen_ckpt_requests_complete"
# Control requests an engine's gate refused (vLLM engines), by reason: remote, no_token,
# bad_token (prometheus_client appends `_total`).
ENGINE_CONTROL_REFUSED = "lumen_engine_control_refused"
# Seconds the active engine's core has left a question unanswered (vLLM engines: the core is
# a process apart from the API server that serves /metrics); 0 while it answers.
ENGINE_CORE_SILENT = "lumen_engine_core_silent_seconds"


def ckpt_counter(key: str) -> str:
    """The connector's counter `key` (blocks_saved, ...), without the `_total` that
    prometheus_client appends: lumen_ckpt_blocks_saved -> lumen_ckpt_blocks_saved_total."""
    return f"lumen_ckpt_{key}"


def deprecated(name: str) -> str:
    """The 0.1 name a metric is also exported under until the next release."""
    return "lumen:" + name.removeprefix("lumen_")

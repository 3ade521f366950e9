"""A stalled worker (its active engine missed a probe, or its engine core is silent) is passed
over: the coordinator admits elsewhere, places no checkpoint there and the gateway's local
routing prefers another; when it is the only worker it is still admitted to (a refusal would
be worse than a wait that may end). The supervisor's side is in
tests/failover/test_supervisor.py, the gate's in tests/vllm/test_vllm_failover.py."""

from __future__ import annotations

from collections import Counter

from msgspec.structs import replace

from lumend.cluster.models import WorkerRecord, decode_value, encode_value
from lumend.coordinator.service import CoordinatorService
from lumend.engine.adapter import parse_load
from lumend.engine.metric_names import ENGINE_CORE_SILENT
from lumend.gateway.routing import choose_worker

from .test_coordinator_loadbook import GIB, cluster, worker

STALLED = "engine b0-e missed 1 probe(s) in a row"


def admissions(workers: list[WorkerRecord], n: int = 12) -> tuple[Counter[str], Counter[str],
                                                                   list[str]]:
    """`n` admissions: per worker admitted to, per checkpoint holder, and the reasons."""
    v = cluster(workers, gateways=("gw",))
    service = CoordinatorService("a", 1, lambda: v)
    served: Counter[str] = Counter()
    held: Counter[str] = Counter()
    reasons = []
    for i in range(n):
        a = service.admit(f"r{i}", None, "gw")
        assert a.target is not None, a.reason
        served[a.target.worker] += 1
        if a.checkpoint is not None:
            held[a.checkpoint.holder] += 1
        reasons.append(a.reason)
    return served, held, reasons


def three(stalled: str = "") -> list[WorkerRecord]:
    return [worker("a0", "a", budget=64 * GIB),
            replace(worker("b0", "b", budget=64 * GIB), stalled=stalled),
            worker("c0", "c", budget=64 * GIB)]


def test_a_stalled_worker_gets_no_admission_and_no_checkpoint() -> None:
    served, held, _ = admissions(three(STALLED))
    assert served["b0"] == 0 and served["a0"] + served["c0"] == 12, served
    assert held["b0"] == 0 and sum(held.values()) == 12, held
    # Negative control: the same cluster with b0 answering shares both out.
    served, held, _ = admissions(three())
    assert served["b0"] == 4 and held["b0"] > 0, (served, held)


def test_the_only_worker_is_admitted_to_though_stalled_and_the_reason_says_so() -> None:
    alone = [replace(worker("b0", "b"), stalled=STALLED)]
    served, _, reasons = admissions(alone, n=2)
    assert served == {"b0": 2}
    assert "it is stalled: " + STALLED in reasons[0], reasons[0]
    # A drained or failed worker is not a fallback: only a serving one that is stalled.
    failed = [replace(worker("b0", "b", state="failed"), stalled=STALLED)]
    v = cluster(failed, gateways=("gw",))
    assert CoordinatorService("a", 1, lambda: v).admit("r", None, "gw").target is None


def test_local_routing_prefers_a_worker_that_answers() -> None:
    v = cluster([replace(worker("a0", "a"), stalled=STALLED), worker("b0", "b", running=9)])
    target = choose_worker(v, None, {})
    assert target is not None and target.worker == "b0"
    only = cluster([replace(worker("a0", "a"), stalled=STALLED)])
    target = choose_worker(only, None, {})
    assert target is not None and target.worker == "a0"


def test_the_record_carries_the_reason_and_old_records_decode() -> None:
    record = replace(worker("b0", "b"), stalled=STALLED)
    assert decode_value(encode_value(record), WorkerRecord).stalled == STALLED
    older = encode_value(worker("b0", "b")).replace(b',"stalled":""', b"")
    assert b"stalled" not in older
    assert decode_value(older, WorkerRecord).stalled == ""


def test_the_engines_core_silence_is_read_from_its_metrics() -> None:
    text = (f"# TYPE {ENGINE_CORE_SILENT} gauge\n{ENGINE_CORE_SILENT} 7.5\n"
            "vllm:num_requests_running 3\n")
    assert parse_load(text).core_silent_s == 7.5
    assert parse_load("vllm:num_requests_running 3\n").core_silent_s == 0.0
    assert parse_load(f"{ENGINE_CORE_SILENT} NaN\n").core_silent_s == 0.0

"""Prometheus metrics of the gateway's line to the coordinator."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from lumend.gateway.coordinator import CoordinatorLink

CALLS = ("admit", "recover")


class CoordinatorLinkCollector(Collector):
    def __init__(self, link: CoordinatorLink) -> None:
        self._link = link

    def collect(self) -> Iterator[Metric]:
        degraded = CounterMetricFamily(
            "lumen_gateway_degraded", "Decisions this gateway made locally because the "
            "coordinator could not answer, by call (admit, recover).", labels=["call"])
        answered = CounterMetricFamily(
            "lumen_gateway_coordinated", "Decisions the coordinator made for this gateway, "
            "by call (admit, recover).", labels=["call"])
        for call in CALLS:
            degraded.add_metric([call], self._link.degraded.get(call, 0))
            answered.add_metric([call], self._link.answered.get(call, 0))
        yield degraded
        yield answered
        yield CounterMetricFamily(
            "lumen_gateway_recover_coordinator_changes", "Recoveries answered by a "
            "coordinator elected while the request waited.",
            value=self._link.coordinator_changes)
        yield CounterMetricFamily(
            "lumen_gateway_admit_calls", "Admit calls this gateway sent to the coordinator "
            "(under load one call carries several admissions).",
            value=self._link.admit_calls["calls"])
        yield CounterMetricFamily(
            "lumen_gateway_admit_call_admissions", "Admissions the coordinator answered in "
            "those calls (divided by lumen_gateway_admit_calls_total: the mean batch).",
            value=self._link.admit_calls["admissions"])
        finished = CounterMetricFamily(
            "lumen_gateway_finish_reports", "Finished requests this gateway reported to the "
            "coordinator, by outcome: sent, known (the coordinator had them in flight), "
            "dropped (a failed batch: the coordinator expires them itself).",
            labels=["outcome"])
        for outcome in ("sent", "known", "dropped"):
            finished.add_metric([outcome], self._link.finishes[outcome])
        yield finished
        seconds = HistogramMetricFamily(
            "lumen_gateway_decision_seconds", "Round trip of the coordinator's answers to "
            "this gateway, by call (admit, recover).", labels=["call"])
        for call in CALLS:
            buckets = self._link.decision_seconds[call]
            seconds.add_metric([call], buckets.cumulative(), sum_value=buckets.total)
        yield seconds

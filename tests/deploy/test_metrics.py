"""Metrics of live lumend processes, and the Grafana dashboard checked against a scrape."""

from __future__ import annotations

import json
import re
import signal
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from lumenctl.localcluster import EtcdCluster
from lumend.metrics import DEPRECATED_NAMES

from .conftest import Lumend, metric_value, wait_until

DASHBOARD = Path(__file__).parents[2] / "deploy" / "grafana" / "lumen.json"
# Metric names in PromQL: ours (lumend's lumen_*, the engines' lumen_ckpt_*; lumen:* only
# to catch the deprecated 0.1 names), and the process metrics prometheus_client adds.
METRIC_NAME = re.compile(r"\b((?:lumen|process|python)[_:][a-zA-Z0-9_:]+)\b")


def dashboard_queries(dashboard: dict[str, Any]) -> Iterator[tuple[str, str]]:
    """(where, PromQL) of every panel target and every templating query."""
    def panels(items: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
        for panel in items:
            yield panel
            yield from panels(panel.get("panels", []))

    for panel in panels(dashboard["panels"]):
        for target in panel.get("targets", []):
            yield f"panel {panel['title']!r} target {target['refId']}", target["expr"]
    for variable in dashboard["templating"]["list"]:
        if variable["type"] == "query":
            query = variable["query"]
            yield f"variable {variable['name']}", query if isinstance(query, str) else \
                query["query"]


def unknown_metrics(dashboard: dict[str, Any], exported: set[str]) -> list[str]:
    problems = []
    for where, expr in dashboard_queries(dashboard):
        names = METRIC_NAME.findall(expr)
        if not names:
            problems.append(f"{where}: names no metric: {expr}")
        problems += [f"{where}: {name} is not exported" for name in names
                     if name not in exported]
    return problems


def sample_names(exposition: str) -> set[str]:
    return {sample.name for family in text_string_to_metric_families(exposition)
            for sample in family.samples}


def declared_names(exposition: str) -> set[str]:
    """Sample names a family in the exposition declares, sampled or not yet: a labelled
    counter with no sample (no drain order sent, no draft-assist yet) is exported by its
    `# TYPE` line alone, and a panel over it shows the series once they come."""
    names = set()
    for family in text_string_to_metric_families(exposition):
        suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_count", "_sum"),
                    "summary": ("_count", "_sum")}.get(family.type, ("",))
        names |= {family.name + suffix for suffix in suffixes}
    return names | sample_names(exposition)


def sample_value(exposition: str, name: str, labels: dict[str, str]) -> float:
    for family in text_string_to_metric_families(exposition):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v
                                           for k, v in labels.items()):
                return float(sample.value)
    raise KeyError(f"{name}{labels} not in the scrape")


def post(url: str, body: dict[str, Any]) -> int:
    request = urllib.request.Request(url, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            response.read()
            return int(response.status)
    except urllib.error.HTTPError as exc:
        return int(exc.code)


def engine_scrape(node: Lumend) -> str:
    """The /metrics of whichever engine of the node's first worker answers."""
    for port in node.ports[4:6]:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
                text: str = r.read().decode()
                return text
        except OSError:
            continue
    raise AssertionError(f"no engine of {node.config.stem} serves /metrics")


def test_dashboard_queries_name_only_exported_metrics(
    etcd: EtcdCluster, start_lumend: Callable[..., Lumend]
) -> None:
    first = start_lumend(etcd.endpoints, name="m1")
    wait_until(lambda: "coordinating as m1" in first.log_text(), 30, "m1 to coordinate")
    second = start_lumend(etcd.endpoints, name="m2", workers=2)
    wait_until(lambda: "following coordinator m1" in second.log_text(), 30, "m2 to follow")
    wait_until(lambda: metric_value(second.scrape(), "lumen_node_ready") == 1, 60,
               "m2 ready: the engines of both its workers serving")

    # One request through m2's gateway (admitted by the coordinator on m1), one refused.
    gateway = f"http://127.0.0.1:{second.ports[0]}/v1/completions"
    wait_until(lambda: post(gateway, {"prompt": "hello there", "max_tokens": 4}) == 200 and
               sample_value(second.scrape(), "lumen_gateway_coordinated_total",
                            {"call": "admit"}) >= 1, 30, "an admission by the coordinator")
    assert post(gateway, {"max_tokens": 4}) == 400
    leader, follower = first.scrape(), second.scrape()

    # The values follow what the nodes do.
    assert metric_value(leader, "lumen_coordinator") == 1
    assert metric_value(follower, "lumen_coordinator") == 0
    assert metric_value(leader, "lumen_coordinator_elections_total") == 1
    assert metric_value(follower, "lumen_coordinator_elections_total") == 0
    assert metric_value(follower, "lumen_coordinator_epoch") == metric_value(
        leader, "lumen_coordinator_epoch") > 0
    assert metric_value(follower, "lumen_node_registered") == 1
    assert metric_value(follower, "lumen_node_ready") == 1
    assert metric_value(follower, "lumen_cluster_nodes") == 2
    assert 'lumen_workers{state="serving"} 2.0' in follower
    assert 'lumen_workers{state="starting"} 0.0' in follower
    assert 'lumen_node_info{cluster="deploy",node="m2",version=' in follower
    assert metric_value(leader, "lumen_ha_cycle_duration_seconds_count") > 0

    # The gateway, control-plane and checkpoint panels have live series to show.
    assert sample_value(follower, "lumen_gateway_requests_total", {"outcome": "ok"}) >= 1
    assert sample_value(follower, "lumen_gateway_rejected_total", {}) >= 1
    opened = re.findall(r'^lumen_gateway_streams_opened_total\{worker="[^"]+"\} (\S+)$',
                        follower, re.M)
    assert sum(map(float, opened)) >= sample_value(
        follower, "lumen_gateway_requests_total", {"outcome": "ok"}), opened
    assert {"lumen_gateway_degraded_total", "lumen_gateway_resumes_total"} <= \
        sample_names(follower)
    assert sample_value(leader, "lumen_coordinator_decisions_total", {"kind": "admit"}) >= 1
    assert sample_value(follower, "lumen_ckpt_budget_bytes", {"worker": "m2-w0"}) > 0
    assert metric_value(follower, "lumen_agent_stale_epoch_refused_total") == 0
    # The gateway's latency carries the served model (model_name, as vLLM's metrics).
    assert sample_value(follower, "lumen_gateway_ttft_seconds_count",
                        {"model_name": "sim-small"}) >= 1
    assert sample_value(follower, "lumen_gateway_tpot_seconds_count",
                        {"model_name": "sim-small"}) >= 1
    assert sample_value(follower, "lumen_gateway_migrations_total", {}) == 0

    # Every name a panel queries is a series lumend exports, or for the engine panels one
    # that the engines' own /metrics export.
    engine = engine_scrape(second)
    engines = {name for name in sample_names(engine) if name.startswith("lumen")}
    # The renamed metrics are exported under their deprecated 0.1 names too, same values.
    for new, old in (("lumen_ckpt_requests_running", "lumen:ckpt_requests_running"),
                     ("lumen_ckpt_requests_complete", "lumen:ckpt_requests_complete")):
        assert sample_value(engine, new, {}) == sample_value(engine, old, {}), (new, old)
    assert sample_value(follower, "lumen_ckpt_held_bytes", {"worker": "m2-w0"}) == \
        sample_value(follower, "lumen_ckpt_bytes_held", {"worker": "m2-w0"})
    exported = declared_names(leader) | declared_names(follower) | engines
    dashboard = json.loads(DASHBOARD.read_text())
    queries = list(dashboard_queries(dashboard))
    assert len(queries) >= 40
    assert unknown_metrics(dashboard, exported) == []
    queried = {name for _, expr in queries for name in METRIC_NAME.findall(expr)}
    assert {"lumen_ckpt_held_bytes", "lumen_ckpt_refusals_total", "lumen_gateway_degraded_total",
            "lumen_agent_stale_epoch_refused_total", "lumen_coordinator_decisions_total",
            "lumen_ckpt_requests_complete", "lumen_gateway_ttft_seconds_bucket",
            "lumen_gateway_recovery_seconds_bucket", "lumen_gateway_migrations_total",
            "lumen_coordinator_orders_total", "lumen_assist_drafted_tokens_total",
            "lumen_assist_accepted_tokens_total", "lumen_assist_acceptance",
            "lumen_assist_attached"} <= queried
    # The dashboard queries no deprecated name (nothing with a colon, none of lumend's
    # renamed ones), and lumend exports each of those with the new name's value.
    assert [name for name in queried if ":" in name or name in DEPRECATED_NAMES] == []
    for old, new in DEPRECATED_NAMES.items():
        assert old in declared_names(follower) and new in declared_names(follower), old

    # Negative controls: a misspelt metric and a query without any metric are reported.
    broken = json.loads(DASHBOARD.read_text())
    broken["panels"][1]["targets"][0]["expr"] = "sum(lumen_node_registred)"
    broken["panels"][2]["targets"][0]["expr"] = "vector(1)"
    coverage = next(p for p in broken["panels"] if p["title"] == "Checkpoint coverage (engines)")
    coverage["targets"][0]["expr"] = "sum(lumen_ckpt_requests_completed)"
    assist = next(p for p in broken["panels"] if p["title"] == "Assist acceptance")
    assist["targets"][0]["expr"] = "max(lumen_assist_acceptence)"
    assert unknown_metrics(broken, exported) == [
        "panel 'Nodes registered' target A: lumen_node_registred is not exported",
        "panel 'Nodes ready' target A: names no metric: vector(1)",
        "panel 'Checkpoint coverage (engines)' target A: lumen_ckpt_requests_completed is not "
        "exported",
        "panel 'Assist acceptance' target A: lumen_assist_acceptence is not exported",
    ]

    # A graceful stop of the coordinator: the follower wins and its counters show it.
    first.signal(signal.SIGTERM)
    assert first.proc.wait(timeout=30) == 0
    wait_until(lambda: metric_value(second.scrape(), "lumen_coordinator") == 1, 30,
               "m2 to take over")
    after = second.scrape()
    assert metric_value(after, "lumen_coordinator_elections_total") == 1
    assert metric_value(after, "lumen_coordinator_epoch") > metric_value(
        leader, "lumen_coordinator_epoch")

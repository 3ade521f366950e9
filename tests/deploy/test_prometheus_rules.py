"""deploy/prometheus/lumen-rules.yml: `promtool check rules`, and every rule evaluated by a
real Prometheus scraping a live lumend (etcd, one node with a sim worker).

Each rule must evaluate without error, and each lumen_* series it names must be in the live
scrape (a misspelt metric name would otherwise make an alert silently never fire). On the
healthy node the outage alerts' expressions select nothing, and LumenGatewayOpen (no API keys
here) selects the node: the expressions match real series."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import time
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from lumenctl.localcluster import EtcdCluster, free_ports, stop_process
from lumend.metrics import DEPRECATED_NAMES

from .conftest import Lumend, wait_until

REPO = Path(__file__).parents[2]
RULES = REPO / "deploy" / "prometheus" / "lumen-rules.yml"
PROMTOOL = shutil.which("promtool")
PROMETHEUS = shutil.which("prometheus")

needs_prometheus = pytest.mark.skipif(
    PROMTOOL is None or PROMETHEUS is None,
    reason="needs promtool and prometheus (Debian's prometheus; scripts/system-deps.sh)")


def rules() -> list[dict[str, Any]]:
    document = yaml.safe_load(RULES.read_text())
    return [rule for group in document["groups"] for rule in group["rules"]]


@needs_prometheus
def test_promtool_checks_the_rules(tmp_path: Path) -> None:
    assert PROMTOOL is not None
    checked = subprocess.run([PROMTOOL, "check", "rules", str(RULES)], capture_output=True,
                             text=True, timeout=60)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert f"SUCCESS: {len(rules())} rules found" in checked.stdout

    # Negative control: a broken expression fails the check.
    broken = tmp_path / "broken.yml"
    broken.write_text(RULES.read_text().replace("sum(lumen_coordinator) < 1",
                                                "sum(lumen_coordinator < 1"))
    failed = subprocess.run([PROMTOOL, "check", "rules", str(broken)], capture_output=True,
                            text=True, timeout=60)
    assert failed.returncode != 0


def log_disk_cases(rules_file: Path) -> dict[str, Any]:
    """promtool's unit test of the engine-log disk alerts: worker a at 512 MiB free, b at
    50 GiB, c at 5 GiB steady, d falling from 9 GiB by 50 MiB a minute (empty in about 3 h)."""
    series = 'lumen_engine_log_free_bytes{instance="%s:9440",job="lumend",worker="%s-w0"}'
    mib = 2**20

    shipped = {rule["alert"]: rule for rule in rules()}

    def alert(host: str, name: str, summary: str) -> dict[str, Any]:
        return {"exp_labels": {"severity": "warning", "instance": f"{host}:9440",
                               "job": "lumend", "worker": f"{host}-w0"},
                "exp_annotations": {"summary": summary,
                                    "description": shipped[name]["annotations"]["description"]}}

    return {
        "rule_files": [str(rules_file)],
        "evaluation_interval": "1m",
        "tests": [{
            "interval": "1m",
            "input_series": [
                {"series": series % ("a", "a"), "values": f"{512 * mib}x60"},
                {"series": series % ("b", "b"), "values": f"{50 * 1024 * mib}x60"},
                {"series": series % ("c", "c"), "values": f"{5 * 1024 * mib}x60"},
                {"series": series % ("d", "d"), "values": f"{9 * 1024 * mib}-{50 * mib}x60"},
            ],
            "alert_rule_test": [
                {"eval_time": "5m", "alertname": "LumenEngineLogDiskLow", "exp_alerts": []},
                {"eval_time": "15m", "alertname": "LumenEngineLogDiskLow",
                 "exp_alerts": [alert("a", "LumenEngineLogDiskLow", "a:9440: 512MiB free "
                                      "for the engine logs of a-w0")]},
                {"eval_time": "20m", "alertname": "LumenEngineLogDiskFillingUp",
                 "exp_alerts": []},
                {"eval_time": "40m", "alertname": "LumenEngineLogDiskFillingUp",
                 "exp_alerts": [alert("d", "LumenEngineLogDiskFillingUp", "d:9440: the "
                                      "engine logs of d-w0 fill their disk within 6 hours "
                                      "at the last hour's rate")]},
            ],
        }],
    }


@needs_prometheus
def test_the_engine_log_disk_alerts_fire_for_a_low_or_filling_disk_only(
        tmp_path: Path) -> None:
    """A disk under 1 GiB for 10 min, and one that fills within 6 h at the last hour's rate,
    alert; a full-enough steady disk does not. Negative control: with the threshold moved
    below worker a's free space the same expectations fail."""
    assert PROMTOOL is not None

    def promtool_test(rules_file: Path) -> subprocess.CompletedProcess[str]:
        cases = tmp_path / f"{rules_file.stem}.test.yml"
        cases.write_text(yaml.safe_dump(log_disk_cases(rules_file)))
        return subprocess.run([PROMTOOL, "test", "rules", str(cases)], capture_output=True,
                              text=True, timeout=60)

    tested = promtool_test(RULES)
    assert tested.returncode == 0, tested.stdout + tested.stderr
    moved = tmp_path / "moved.yml"
    moved.write_text(RULES.read_text().replace("lumen_engine_log_free_bytes < 1073741824",
                                               "lumen_engine_log_free_bytes < 268435456"))
    assert promtool_test(moved).returncode != 0


def series_names(expr: str) -> set[str]:
    return set(re.findall(r"\blumen_[a-z_]+\b", expr))


def missing_from(scrape: str, names: set[str]) -> set[str]:
    """Names neither sampled nor declared in the exposition. A labelled counter or histogram
    with no sample yet (no request was ever rejected, or served: the gateway's latency by
    model_name) is declared by its `# TYPE` line only."""
    present = {line.split("{")[0].split()[0] for line in scrape.splitlines()
               if line and not line.startswith("#")}
    for line in scrape.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split()
            if kind == "counter":
                present |= {name, f"{name}_total"}
            elif kind == "histogram":  # by model_name: no sample before a request ran
                present |= {name, *(f"{name}_{part}" for part in ("bucket", "count", "sum"))}
            else:
                present.add(name)
    return {n for n in names if n not in present}


def test_the_name_check_catches_a_misspelt_metric() -> None:
    scrape = "lumen_node_ready 1\nlumen_workers{state=\"failed\"} 0\n"
    assert missing_from(scrape, series_names("lumen_node_ready == 0")) == set()
    assert missing_from(scrape, series_names("lumen_node_redy == 0")) == {"lumen_node_redy"}
    declared = "# TYPE lumen_gateway_ttft_seconds histogram\n"
    assert missing_from(declared, {"lumen_gateway_ttft_seconds_bucket"}) == set()
    assert missing_from(declared, {"lumen_gateway_ttfb_seconds_bucket"}) == {
        "lumen_gateway_ttfb_seconds_bucket"}


@pytest.fixture
def prometheus(tmp_path: Path) -> Iterator[Callable[[int], str]]:
    """Factory: a Prometheus scraping 127.0.0.1:PORT every second with the shipped rules;
    returns its base URL."""
    started: list[subprocess.Popen[bytes]] = []

    def start(metrics_port: int) -> str:
        assert PROMETHEUS is not None
        [web] = free_ports(1)
        config = tmp_path / "prometheus.yml"
        config.write_text(yaml.safe_dump({
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "rule_files": [str(RULES)],
            "scrape_configs": [{"job_name": "lumend", "static_configs": [
                {"targets": [f"127.0.0.1:{metrics_port}"]}]}],
        }))
        log = (tmp_path / "prometheus.log").open("ab")
        started.append(subprocess.Popen(
            [PROMETHEUS, f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
             f"--web.listen-address=127.0.0.1:{web}"], stdout=log, stderr=subprocess.STDOUT,
            start_new_session=True))
        log.close()
        return f"http://127.0.0.1:{web}"

    try:
        yield start
    finally:
        for proc in started:
            stop_process(proc)


def completed(url: str) -> bool:
    request = urllib.request.Request(url, data=b'{"prompt": "hello there", "max_tokens": 4}',
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return bool(response.status == 200)
    except OSError:  # 503 until the worker serves
        return False


def api(base: str, path: str, **params: str) -> Any:
    url = f"{base}/api/v1/{path}" + ("?" + urllib.parse.urlencode(params) if params else "")
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return json.loads(response.read())["data"]
    except OSError:
        return None


@needs_prometheus
def test_every_rule_evaluates_against_a_live_lumend(
        etcd: EtcdCluster, start_lumend: Callable[..., Lumend],
        prometheus: Callable[[int], str]) -> None:
    node = start_lumend(etcd.endpoints)

    def coordinator() -> str | None:
        try:
            scrape = node.scrape()
        except OSError:  # not listening yet
            return None
        return scrape if "\nlumen_coordinator 1.0" in scrape else None

    scrape = wait_until(coordinator, 60, "lumend registered and coordinator")
    base = prometheus(node.metrics_port)

    def up() -> bool:
        result = api(base, "query", query='up{job="lumend"} == 1')
        return bool(result and result["result"])

    wait_until(up, 60, "Prometheus scraping lumend")
    # One completion, so the gateway's latency histograms have a model_name series.
    gateway = f"http://127.0.0.1:{node.ports[0]}/v1/completions"
    wait_until(lambda: completed(gateway), 60, "a completion through the gateway")
    shipped = {rule["alert"]: rule for rule in rules()}

    def evaluated() -> dict[str, dict[str, Any]] | None:
        data = api(base, "rules")
        if not data:
            return None
        found = {r["name"]: r for g in data["groups"] for r in g["rules"]}
        done = all(r.get("lastEvaluation", "").startswith("20") and
                   not r["lastEvaluation"].startswith("0001") for r in found.values())
        return found if set(found) == set(shipped) and done else None

    loaded = wait_until(evaluated, 60, "every rule loaded and evaluated once")
    for name, rule in loaded.items():
        assert rule["health"] == "ok", (name, rule.get("lastError"))
        missing = missing_from(scrape, series_names(shipped[name]["expr"]))
        assert not missing, f"{name} names series lumend does not export: {missing}"

    def selects(alert: str) -> list[Any]:
        result = api(base, "query", query=shipped[alert]["expr"])
        assert result is not None, alert
        return list(result["result"])

    for quiet in ("LumenNodeDown", "LumenNodeNotRegistered", "LumenNoCoordinator",
                  "LumenTwoCoordinators", "LumenWorkerFailed", "LumenHaLoopStalled",
                  "LumenLeaseRenewalLate", "LumenGatewaySlowFirstToken"):
        assert selects(quiet) == [], quiet
    # The engine-log disk alert reads the state dir's free space, per worker.
    free = api(base, "query", query="lumen_engine_log_free_bytes")
    assert free is not None and [r["metric"]["worker"] for r in free["result"]] == [
        "n1-w0"], free
    if shutil.disk_usage(node.config.parent).free > 2**31:  # the state dir is beside it
        assert selects("LumenEngineLogDiskLow") == []
    # The latency alert's histograms carry the served model (model_name), as vLLM's do; the
    # old query without it (sum by (le), the dashboard's) still reads them.
    def by_model() -> list[Any] | None:
        result = api(base, "query",
                     query="sum by (model_name) (lumen_gateway_ttft_seconds_count)")
        return list(result["result"]) if result and result["result"] else None

    [series] = wait_until(by_model, 30, "the TTFT histogram by model_name in Prometheus")
    assert series["metric"] == {"model_name": "sim-small"}
    assert float(series["value"][1]) >= 1
    old = api(base, "query", query="sum by (le) (lumen_gateway_ttft_seconds_bucket)")
    assert old is not None and len(old["result"]) == 14  # 13 bounds and +Inf
    # The positive control: a healthy node without API keys is selected by this one.
    deadline = time.monotonic() + 10
    while not selects("LumenGatewayOpen"):
        assert time.monotonic() < deadline, "LumenGatewayOpen selected nothing"
        time.sleep(0.5)


def test_the_rules_name_no_deprecated_metric() -> None:
    """The old names (engine-side lumen:ckpt_*, lumend's DEPRECATED_NAMES) are aliases for
    one release; the shipped rules use the current names."""
    exprs = " ".join(str(rule["expr"]) for rule in rules())
    assert "lumen:" not in exprs
    assert series_names(exprs) & DEPRECATED_NAMES.keys() == set()
    assert "lumen_ckpt_held_bytes" in series_names(exprs)

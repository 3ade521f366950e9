"""Checkpoint coverage: engines export `lumen_ckpt_requests_running/complete`, lumend
carries them into the worker's etcd record, `lumenctl checkpoints` shows the share of
running requests with a complete checkpoint (unknown, not 0, for an engine without them)."""

from __future__ import annotations

import io
import json
import subprocess
import sys
import threading
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console

from lumenctl.demo import read_view
from lumenctl.localcluster import LocalCluster, free_ports
from lumenctl.render import checkpoints_table
from lumenctl.report import checkpoints_document
from lumend.cluster.keys import Keys
from lumend.cluster.models import WorkerLoad, WorkerRecord, encode_value
from lumend.cluster.store import KeyValue, Snapshot
from lumend.cluster.view import ClusterView, build_view
from lumend.engine.adapter import parse_load
from tests.integration.conftest import wait_until

VLLM_METRICS = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
vllm:num_requests_running{model_name="m"} 3.0
vllm:num_requests_waiting{model_name="m"} 1.0
vllm:kv_cache_usage_perc{model_name="m"} 0.25
"""


def test_parse_load_reads_the_coverage_gauges_or_leaves_them_unknown() -> None:
    old = parse_load(VLLM_METRICS)
    assert (old.running, old.waiting, old.kv_usage) == (3, 1, 0.25)
    assert (old.ckpt_running, old.ckpt_complete) == (None, None)

    new = parse_load(VLLM_METRICS + 'lumen_ckpt_requests_running{model_name="m"} 3\n'
                     'lumen_ckpt_requests_complete{model_name="m"} 0\n')
    assert (new.ckpt_running, new.ckpt_complete) == (3, 0)  # known and 0: not unknown
    # An engine of release 0.1 exports only the deprecated names; one of this release
    # both, and the current names win.
    older = parse_load(VLLM_METRICS + 'lumen:ckpt_requests_running{model_name="m"} 2\n'
                       'lumen:ckpt_requests_complete{model_name="m"} 1\n')
    assert (older.ckpt_running, older.ckpt_complete) == (2, 1)
    both = parse_load(VLLM_METRICS + 'lumen_ckpt_requests_running{model_name="m"} 3\n'
                      'lumen_ckpt_requests_complete{model_name="m"} 2\n'
                      'lumen:ckpt_requests_running{model_name="m"} 3\n'
                      'lumen:ckpt_requests_complete{model_name="m"} 2\n')
    assert (both.ckpt_running, both.ckpt_complete) == (3, 2)


# -- the report ---------------------------------------------------------------------------

KEYS = Keys("t")


def view_of(loads: dict[str, WorkerLoad]) -> ClusterView:
    records = [WorkerRecord(name=name, node=f"n-{name}", gpus=[0], engine="sim", model="m",
                            state="serving", load=load, updated_at=0)
               for name, load in loads.items()]
    return build_view(KEYS, Snapshot([KeyValue(KEYS.worker(r.name), encode_value(r), 1, 1, 0)
                                      for r in records], revision=1))


def test_coverage_per_worker_and_for_the_cluster() -> None:
    doc = checkpoints_document(view_of({
        "a": WorkerLoad(running=4, ckpt_running=4, ckpt_complete=3),
        "b": WorkerLoad(running=2, ckpt_running=2, ckpt_complete=2),
        "c": WorkerLoad(running=0, ckpt_running=0, ckpt_complete=0),
        "old": WorkerLoad(running=5),  # an engine without the gauges
    }))
    rows = {h["worker"]: h for h in doc["holders"]}
    assert rows["a"]["coverage"] == 0.75 and rows["b"]["coverage"] == 1.0
    assert rows["c"]["coverage"] is None and rows["c"]["requests_running"] == 0
    assert rows["old"]["coverage"] is None and rows["old"]["requests_running"] is None
    assert (doc["requests_running"], doc["requests_checkpointed"]) == (6, 5)
    assert doc["coverage"] == pytest.approx(5 / 6)
    assert doc["coverage_unknown"] == ["old"]

    text = render(doc)
    assert "75.0% (3/4)" in text and "100.0% (2/2)" in text and "unknown" in text
    assert "coverage 83.3% (5/6)" in text and "unknown for old" in text


def test_coverage_of_a_cluster_of_old_engines_is_unknown() -> None:
    doc = checkpoints_document(view_of({"old": WorkerLoad(running=5)}))
    assert (doc["coverage"], doc["requests_running"]) == (None, None)
    assert "coverage unknown" in render(doc)


def render(doc: dict[str, Any]) -> str:
    out = io.StringIO()
    Console(width=200, file=out).print(checkpoints_table(doc))
    return out.getvalue()


# -- a real cluster -----------------------------------------------------------------------


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[LocalCluster]:
    # Slow decode (x3), so that requests are still running while lumend publishes loads.
    c = LocalCluster(tmp_path / "cluster", size=2, lease_ttl_s=3, shadows=0,
                     engine_args=("--time-scale", "3.0"))
    try:
        yield c.start()
    finally:
        c.stop()


def lumenctl(cluster: LocalCluster, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "lumenctl", "--config", "/nonexistent/lumend.toml",
         "--endpoints", ",".join(cluster.endpoints), "--cluster", cluster.cluster, *args],
        capture_output=True, text=True, timeout=30, stdin=subprocess.DEVNULL)


class Request(threading.Thread):
    """A streaming completion read to its end in the background."""

    def __init__(self, url: str, body: dict[str, Any]) -> None:
        super().__init__(daemon=True)
        self.url, self.body, self.text, self.error = url, body, "", ""

    def run(self) -> None:
        request = urllib.request.Request(self.url + "/v1/completions",
                                         data=json.dumps({**self.body, "stream": True}).encode(),
                                         headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=120) as response:
                for raw in response:
                    line = raw.decode().strip()
                    if line.startswith("data: {"):
                        self.text += json.loads(line[6:])["choices"][0]["text"]
        except OSError as exc:
            self.error = repr(exc)


def test_lumenctl_shows_the_coverage_of_a_running_cluster(cluster: LocalCluster) -> None:
    def serving() -> ClusterView | None:
        view = read_view(cluster.endpoints, cluster.cluster)
        ok = len(view.workers) == 2 and all(w.state == "serving" for w in view.workers.values())
        return view if ok else None

    view = wait_until(serving, 60, "both workers serving")
    server, holder = sorted(view.workers.values(), key=lambda w: w.name)
    engine = next(e.url for e in server.engines if e.role == "active")
    holder_endpoint = "tcp://" + view.nodes[holder.node].checkpoint
    (nowhere,) = free_ports(1)

    def plan(ckpt_id: str, endpoint: str) -> dict[str, Any]:
        return {"lumen": {"ckpt_id": ckpt_id, "holder": endpoint, "worker": holder.name,
                          "mode": "save"}}

    prompt = "coverage counts the running requests whose checkpoint is whole. " * 3
    # One request checkpoints to the other node's holder (CURVE, with the keys lumend gave
    # its engine); the other names a holder that does not exist: its blocks are dropped.
    requests = [Request(engine, {"prompt": prompt, "max_tokens": 700,
                                 "kv_transfer_params": plan(name, endpoint)})
                for name, endpoint in (("kept", holder_endpoint),
                                       ("lost", f"tcp://127.0.0.1:{nowhere}"))]
    for r in requests:
        r.start()

    def covered() -> WorkerRecord | None:
        record = read_view(cluster.endpoints, cluster.cluster).workers.get(server.name)
        load = record.load if record else None
        return record if load and (load.ckpt_running, load.ckpt_complete) == (2, 1) else None

    wait_until(covered, 30, f"{server.name} to publish 2 running requests, 1 covered")
    result = lumenctl(cluster, "-o", "json", "checkpoints")
    assert result.returncode == 0, result.stderr
    doc = json.loads(result.stdout)
    rows = {h["worker"]: h for h in doc["holders"]}
    assert rows[server.name]["coverage"] == 0.5
    assert (rows[server.name]["requests_running"], rows[server.name]["requests_checkpointed"]
            ) == (2, 1)
    assert rows[holder.name]["requests_running"] == 0 and rows[holder.name]["coverage"] is None
    assert doc["coverage"] == 0.5 and doc["coverage_unknown"] == []
    # The pages of the covered request crossed to the other node's holder.
    wait_until(lambda: read_view(cluster.endpoints, cluster.cluster).workers[holder.name]
               .checkpoints.bytes_held > 0, 10, "the holder to publish the pages it holds")

    table = lumenctl(cluster, "checkpoints")
    assert table.returncode == 0, table.stderr
    assert "50.0% (1/2)" in table.stdout

    for r in requests:
        r.join(60)
        assert not r.is_alive() and not r.error, r.error
        assert len(r.text) == 700

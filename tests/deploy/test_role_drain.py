"""The lumend role's drain before a restart (tasks/drain.yml, tasks/undrain.yml: what the
Restart lumend handler runs around the restart), run by a real ansible-playbook against a
live two-node cluster: the node is drained with --migrate and waited for, then undrained;
a node an operator drained is left alone; the last serving worker of a model is restarted
with a warning, or stops the roll with lumend_drain_required. The whole Restart lumend
handler (drain, restart, undrain) under streaming load is test_role_restart_under_load.py;
the streams a drain moves, tests/integration/test_rolling_restart.py."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import pytest
import yaml

from lumenctl.localcluster import LocalCluster, free_ports
from lumenctl.recovery import read_view

from .conftest import wait_until

TASKS = Path(__file__).parents[2] / "ansible" / "roles" / "lumend" / "tasks"
BIN = Path(sys.executable).parent

pytestmark = pytest.mark.skipif(not (BIN / "ansible-playbook").exists(),
                                reason="needs ansible-core (the dev extra)")


def play(cluster: LocalCluster, node: str, tmp_path: Path, **extra: object
         ) -> subprocess.CompletedProcess[str]:
    """The handler's drain and undrain tasks for `node`, as the role includes them."""
    config = cluster.node(node).config_path
    metrics = tomllib.loads(config.read_text())["metrics"]["listen"]
    playbook = [{
        "hosts": "localhost", "connection": "local", "gather_facts": False,
        "vars": {"ansible_python_interpreter": sys.executable, "lumend_venv": sys.prefix,
                 "lumend_config_file": str(config), "lumend_node_name": node,
                 "lumend_metrics_listen": metrics,
                 "lumend_drain_timeout": 60, "lumend_drain_required": False,
                 "lumend_gateway_drain_s": 30, "lumend_service": "lumend", **extra},
        "tasks": [
            {"name": "Drain before the restart",
             "ansible.builtin.include_tasks": str(TASKS / "drain.yml")},
            {"name": "Undrain after the restart",
             "ansible.builtin.include_tasks": str(TASKS / "undrain.yml")},
        ],
    }]
    path = tmp_path / f"drain-{node}.yml"
    path.write_text(yaml.safe_dump(playbook, sort_keys=False))
    env = {**os.environ, "ANSIBLE_NOCOLOR": "1", "ANSIBLE_RETRY_FILES_ENABLED": "0",
           "ANSIBLE_LOCALHOST_WARNING": "0", "ANSIBLE_INVENTORY_UNPARSED_WARNING": "0",
           "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}"}
    return subprocess.run([str(BIN / "ansible-playbook"), "-i", "localhost,", str(path)],
                          capture_output=True, text=True, env=env, timeout=300)


def lumenctl(cluster: LocalCluster, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "lumenctl", "--config", "/nonexistent",
                           "--endpoints", ",".join(cluster.endpoints), "--cluster",
                           cluster.cluster, *args],
                          capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)


def events(cluster: LocalCluster) -> list[dict[str, Any]]:
    found: list[dict[str, Any]] = json.loads(
        lumenctl(cluster, "-o", "json", "events", "-n", "1000").stdout)["events"]
    return found


def intents(cluster: LocalCluster) -> list[str]:
    return sorted(i.target for i in read_view(cluster.endpoints, cluster.cluster).intents)


def test_the_handlers_drain(tmp_path: Path) -> None:
    cluster = LocalCluster(tmp_path / "cluster", size=2, shadows=0, cluster="roledrain").start()
    try:
        def serving() -> bool:
            view = read_view(cluster.endpoints, cluster.cluster)
            return view.coordinator is not None and sorted(
                w.name for w in view.workers.values() if w.state == "serving") == [
                "node-1-w0", "node-2-w0"]

        wait_until(serving, 90, "both workers serving")

        # The plain case: drained (and waited for), then undrained.
        done = play(cluster, "node-1", tmp_path)
        assert done.returncode == 0, done.stdout + done.stderr
        kinds = [(e["kind"], e["message"]) for e in events(cluster)]
        requested = [m for k, m in kinds if k == "drain_requested" and "node node-1" in m]
        assert requested and "ansible: restart of lumend" in requested[-1]
        assert any(k == "drained" and "node-1-w0" in m for k, m in kinds), kinds
        assert any(k == "drain_withdrawn" and "node-1" in m for k, m in kinds), kinds
        assert intents(cluster) == []
        wait_until(serving, 60, "node-1-w0 serving again after the undrain")

        # An operator's drain of node-2 is left alone: no drain, no undrain.
        assert lumenctl(cluster, "drain", "node-2", "--yes").returncode == 0
        kept = play(cluster, "node-2", tmp_path)
        assert kept.returncode == 0, kept.stdout + kept.stderr
        assert intents(cluster) == ["node-2"]

        # With node-2 drained, node-1 holds the last serving worker of sim-small: the drain
        # refuses, the play warns and goes on to the restart (no undrain: nothing to undo) ...
        warned = play(cluster, "node-1", tmp_path)
        assert warned.returncode == 0, warned.stdout + warned.stderr
        assert "WARNING: lumenctl: draining node-1 would leave no serving worker" in \
            warned.stdout, warned.stdout
        assert intents(cluster) == ["node-2"]
        # ... or, with lumend_drain_required, stops the roll before the restart.
        stopped = play(cluster, "node-1", tmp_path, lumend_drain_required=True)
        assert stopped.returncode != 0
        assert "Stop the roll (the drain did not finish" in stopped.stdout, stopped.stdout
        assert "would leave no serving worker" in stopped.stdout

        # etcd out of reach: the cluster cannot be read, so no drain; the play says so, and
        # stops with lumend_drain_required.
        config = cluster.node("node-1").config_path
        unreachable = tmp_path / "unreachable.toml"
        unreachable.write_text(re.sub(r'endpoints = \[[^]]*\]',
                                      f'endpoints = ["http://127.0.0.1:{free_ports(1)[0]}"]',
                                      config.read_text()))
        blind = play(cluster, "node-1", tmp_path, lumend_config_file=str(unreachable))
        assert blind.returncode == 0, blind.stdout + blind.stderr
        assert "WARNING: lumenctl status failed (exit 3)" in blind.stdout, blind.stdout
        blind = play(cluster, "node-1", tmp_path, lumend_config_file=str(unreachable),
                     lumend_drain_required=True)
        assert blind.returncode != 0
        assert "Stop the roll (the cluster could not be read" in blind.stdout, blind.stdout
    finally:
        cluster.stop()

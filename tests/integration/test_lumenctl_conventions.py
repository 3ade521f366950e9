"""lumenctl's conventions against real etcd and lumend processes: -o after the command,
version, shell completion, `events --watch` following new events, `drain` refusing the last
serving worker of a model without --force, `config set` showing the change and asking."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from lumenctl.localcluster import LocalCluster
from lumend import __version__

from .conftest import wait_until
from .test_coordinator import all_serving

MakeCluster = Callable[..., LocalCluster]


def base(cluster: LocalCluster) -> list[str]:
    return [sys.executable, "-m", "lumenctl", "--config", "/nonexistent/lumend.toml",
            "--endpoints", ",".join(cluster.endpoints), "--cluster", cluster.cluster]


def ctl(cluster: LocalCluster, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*base(cluster), *args], capture_output=True, text=True,
                          stdin=subprocess.DEVNULL, timeout=60)


def test_version_and_completion() -> None:
    for args in (["--version"], ["version"]):
        result = subprocess.run([sys.executable, "-m", "lumenctl", *args], capture_output=True,
                                text=True, timeout=30)
        assert result.returncode == 0, result.stderr
        assert result.stdout.strip() == f"lumenctl {__version__} (distribution lumen-serving)"
    # The completion protocol, as the script `--install-completion` installs calls it.
    env = {**os.environ, "_LUMENCTL_COMPLETE": "complete_bash", "COMP_WORDS": "lumenctl st",
           "COMP_CWORD": "1", "_TYPER_COMPLETE_ARGS": "lumenctl st"}
    completion = subprocess.run([str(Path(sys.executable).parent / "lumenctl")], env=env,
                                capture_output=True, text=True, timeout=30)
    assert "status" in completion.stdout.split(), completion.stdout + completion.stderr
    assert "events" not in completion.stdout.split()


def test_conventions_on_a_running_cluster(local_cluster: MakeCluster) -> None:
    cluster = local_cluster(size=2, lease_ttl_s=3, shadows=0)
    wait_until(all_serving(cluster), 60, "both workers serving")

    # -o after the command, as before it: the same document.
    after = ctl(cluster, "status", "-o", "json")
    assert after.returncode == 0, after.stderr
    assert sorted(n["name"] for n in json.loads(after.stdout)["nodes"]) == ["node-1", "node-2"]
    assert ctl(cluster, "config", "show", "--output=yaml").stdout.startswith("cluster:")

    # events --watch follows: a drain written after it started shows up as a JSON line.
    follow = subprocess.Popen([*base(cluster), "events", "--watch", "0.2", "-o", "json",
                               "-n", "1"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, start_new_session=True)
    try:
        assert follow.stdout is not None
        first = json.loads(follow.stdout.readline())  # the newest event, shown at once
        assert set(first) >= {"at", "kind", "source", "message"}
        drained = ctl(cluster, "drain", "node-1", "--yes")
        assert drained.returncode == 0, drained.stderr
        deadline = time.monotonic() + 30
        kinds: list[str] = []
        while "drain_requested" not in kinds:
            assert time.monotonic() < deadline, f"events --watch never showed the drain: {kinds}"
            kinds.append(json.loads(follow.stdout.readline())["kind"])
    finally:
        os.killpg(follow.pid, signal.SIGTERM)
        follow.wait(timeout=10)

    # node-1 drained: node-2's worker is the last serving one of sim-small.
    def state(worker: str) -> str:
        doc = json.loads(ctl(cluster, "-o", "json", "status").stdout)
        return str(next(w["state"] for w in doc["workers"] if w["name"] == worker))

    wait_until(lambda: state("node-1-w0") in ("drained", "draining"), 30, "node-1-w0 drained")
    refused = ctl(cluster, "drain", "node-2-w0", "--yes")
    assert refused.returncode == 1
    assert "no serving worker for sim-small" in refused.stderr and "--force" in refused.stderr
    forced = ctl(cluster, "drain", "node-2-w0", "--yes", "--force")
    assert forced.returncode == 0, forced.stderr
    for target in ("node-1", "node-2-w0"):
        assert ctl(cluster, "undrain", target).returncode == 0

    # config set: without a terminal and without --yes it refuses and writes nothing; with
    # --yes it shows the change; the same value again is no change.
    unconfirmed = ctl(cluster, "config", "set", "beta", "2")
    assert unconfirmed.returncode == 2 and "--yes" in unconfirmed.stderr
    assert ctl(cluster, "config", "get", "beta").stdout.strip() != "2.0"
    applied = ctl(cluster, "config", "set", "beta", "2", "--yes")
    assert applied.returncode == 0, applied.stderr
    assert "+ beta = 2.0" in applied.stdout and "- beta = " in applied.stdout
    assert ctl(cluster, "config", "get", "beta").stdout.strip() == "2.0"
    again = ctl(cluster, "config", "set", "beta", "2", "--yes")
    assert again.returncode == 0 and "nothing to change" in again.stdout
    bad = ctl(cluster, "config", "set", "beta", "lots", "--yes")
    assert bad.returncode == 2 and "beta" in bad.stderr

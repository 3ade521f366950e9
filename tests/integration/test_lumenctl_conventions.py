"""lumenctl's conventions against real etcd and lumend processes: -o after the command,
version, shell completion, `events --watch` following new events, `drain` refusing the last
serving worker of a model without --force, `config set` showing the change and asking.
The checks on a running cluster run inside test_graceful_stop.py's cluster (one start)."""

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


def lumenctl_conventions(cluster: LocalCluster, node: str,
                         while_drained: Callable[[], None]) -> None:
    """On a running one-node cluster (tests/integration/test_graceful_stop.py starts it, to
    share its processes): -o after the command, events --watch, drain refusing the last
    serving worker, config set. `while_drained` runs while `node` is drained."""
    # -o after the command, as before it: the same document.
    after = ctl(cluster, "status", "-o", "json")
    assert after.returncode == 0, after.stderr
    assert [n["name"] for n in json.loads(after.stdout)["nodes"]] == [node]
    assert ctl(cluster, "config", "show", "--output=yaml").stdout.startswith("cluster:")

    # The node's worker is the last serving one of its model: refused without --force, and
    # no intent is written.
    refused = ctl(cluster, "drain", node, "--yes")
    assert refused.returncode == 1
    assert "no serving worker for sim-small" in refused.stderr and "--force" in refused.stderr
    assert json.loads(ctl(cluster, "-o", "json", "status").stdout)["workers"][0]["state"] == \
        "serving"

    # events --watch follows: the forced drain, written after it started, shows up as a
    # JSON line.
    follow = subprocess.Popen([*base(cluster), "events", "--watch", "0.2", "-o", "json",
                               "-n", "1"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, start_new_session=True)
    try:
        assert follow.stdout is not None
        first = json.loads(follow.stdout.readline())  # the newest event, shown at once
        assert set(first) >= {"at", "kind", "source", "message"}
        forced = ctl(cluster, "drain", node, "--yes", "--force")
        assert forced.returncode == 0, forced.stderr
        deadline = time.monotonic() + 30
        kinds: list[str] = []
        while "drain_requested" not in kinds:
            assert time.monotonic() < deadline, f"events --watch never showed the drain: {kinds}"
            kinds.append(json.loads(follow.stdout.readline())["kind"])
    finally:
        os.killpg(follow.pid, signal.SIGTERM)
        follow.wait(timeout=10)
    while_drained()
    undrain = ctl(cluster, "undrain", node)
    assert undrain.returncode == 0, undrain.stderr

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

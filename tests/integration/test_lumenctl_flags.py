"""lumenctl's option conventions against a real etcd: -o/--output after every command that
prints data, and the 0.1 timeout names (--timeout) still working, hidden from --help, with a
deprecation warning."""

from __future__ import annotations

import asyncio
import json
import time

import yaml
from typer.testing import CliRunner

from lumenctl.localcluster import EtcdCluster
from lumenctl.main import app
from lumend.cluster.keys import Keys
from lumend.cluster.models import NodeRecord, encode_value
from lumend.cluster.store import EtcdStore
from tests.unit.test_lumenctl_args import complete

CLUSTER = "flags"


def ctl(etcd: EtcdCluster, *args: str) -> tuple[int, str, str]:
    result = CliRunner().invoke(app, ["--config", "/nonexistent/lumend.toml", "--endpoints",
                                      ",".join(etcd.endpoints), "--cluster", CLUSTER, *args])
    return result.exit_code, result.stdout, result.stderr


def register_node(etcd: EtcdCluster, name: str) -> None:
    """A node record with no workers, as a lumend that just joined writes it."""
    now = time.time()
    record = NodeRecord(name=name, address="127.0.0.1", pid=1, version="0.1.0", started_at=now,
                        updated_at=now, gateway="127.0.0.1:1", rpc="127.0.0.1:2",
                        checkpoint="127.0.0.1:3", metrics="127.0.0.1:4")

    async def put() -> None:
        store = EtcdStore(etcd.endpoints)
        try:
            await store.put(Keys(CLUSTER).node(name), encode_value(record))
        finally:
            await store.close()

    asyncio.run(put())


def test_output_after_each_command_that_prints_data(etcd: EtcdCluster) -> None:
    register_node(etcd, "n1")
    for command in (["status"], ["events"], ["checkpoints"], ["config", "show"],
                    ["config", "get", "alpha"]):
        code, out, err = ctl(etcd, *command, "-o", "json")
        assert code == 0, (command, err)
        json.loads(out)
        code, out, err = ctl(etcd, *command, "--output=yaml")
        assert code == 0, (command, err)
        # status ends its YAML with "---", so that --watch -o yaml is a stream.
        assert isinstance(next(yaml.safe_load_all(out)), dict), (command, out)
    code, out, _ = ctl(etcd, "status", "-o", "json")
    assert [n["name"] for n in json.loads(out)["nodes"]] == ["n1"]
    # After the command it wins over the global option before it.
    code, out, _ = ctl(etcd, "-o", "yaml", "config", "get", "alpha", "-o", "json")
    assert json.loads(out)["key"] == "alpha"
    # drain --wait reports in the format chosen after the command.
    code, out, err = ctl(etcd, "drain", "n1", "--yes", "--force", "--wait", "-o", "json")
    assert code == 0, err
    assert json.loads(out[out.index("{"):])["outcome"] == "drained"
    # A command that prints no data takes no -o.
    code, _, err = ctl(etcd, "undrain", "n1", "-o", "json")
    assert code == 2 and "No such option" in err


def test_the_old_timeout_names_still_work_with_a_warning(etcd: EtcdCluster) -> None:
    register_node(etcd, "n2")
    # drain --timeout is --wait-timeout's 0.1 name: a node with nothing on it counts as
    # drained once it stayed empty for a second, so a shorter wait times out, naming it.
    code, out, err = ctl(etcd, "--timeout", "5", "drain", "n2", "--yes", "--force", "--wait",
                         "--timeout", "0.2")
    assert code == 1, out + err
    assert "--timeout is deprecated, use --etcd-timeout" in err
    assert "--timeout is deprecated, use --wait-timeout" in err
    assert "did not finish within 0.2 s: it has no workers, and a drain is done once" in err
    assert ctl(etcd, "undrain", "n2")[0] == 0
    # Both names at once: a usage error, nothing written.
    code, _, err = ctl(etcd, "drain", "n2", "--yes", "--force", "--wait-timeout", "1",
                       "--timeout", "2")
    assert code == 2 and "give only --wait-timeout" in err
    code, out, _ = ctl(etcd, "-o", "json", "status")
    assert json.loads(out)["intents"] == []
    # The new names print no warning.
    code, _, err = ctl(etcd, "--etcd-timeout", "5", "status")
    assert code == 0 and "deprecated" not in err


def test_completion_offers_the_clusters_names(etcd: EtcdCluster) -> None:
    register_node(etcd, "gpu-a")
    register_node(etcd, "gpu-b")
    line = (f"lumenctl --config /nonexistent/lumend.toml --endpoints {etcd.endpoints[0]} "
            f"--cluster {CLUSTER} ")
    assert complete(line + "drain gpu-") == ["gpu-a", "gpu-b"]
    assert complete(line + "agent gpu-b") == ["gpu-b"]
    assert complete(line + "undrain ") == []  # nothing is drained
    assert ctl(etcd, "drain", "gpu-b", "--yes", "--force")[0] == 0
    assert complete(line + "undrain ") == ["gpu-b"]
    assert complete(line + "failover ") == []  # no workers registered
    # etcd out of reach: no suggestions.
    dead = "lumenctl --config /nonexistent/lumend.toml --endpoints http://127.0.0.1:1 "
    assert complete(dead + "drain ") == []

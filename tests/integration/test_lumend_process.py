"""`lumend` as systemd runs it: config errors, etcd down at start, clean stop."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from lumenctl.demo import read_view
from lumenctl.localcluster import EtcdCluster, LumendNode, free_ports, node_config_toml
from lumend.checkpoint.security import CurveKeys

from .conftest import wait_until

EXAMPLE = Path(__file__).parents[2] / "examples" / "lumend.toml"


def lumend(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "lumend", *args], capture_output=True,
                          text=True, timeout=30)


def test_check_config_exit_codes(tmp_path: Path) -> None:
    example = tmp_path / "example.toml"  # the example, with a real CURVE key file
    CurveKeys.generate().write(tmp_path / "checkpoint.keys")
    example.write_text(EXAMPLE.read_text().replace("/etc/lumen/checkpoint.keys",
                                                   str(tmp_path / "checkpoint.keys")))
    ok = lumend("check-config", str(example))
    assert ok.returncode == 0, ok.stderr

    bad = tmp_path / "bad.toml"
    bad.write_text(example.read_text().replace("lease_ttl_s = 10", "lease_ttl = 10"))
    result = lumend("check-config", str(bad))
    assert result.returncode == 2
    assert 'etcd.lease_ttl = 10: unknown key; did you mean "lease_ttl_s"?' in result.stderr

    missing = lumend("run", "--config", str(tmp_path / "nope.toml"))
    assert missing.returncode == 2 and "nope.toml" in missing.stderr


def test_waits_for_etcd_then_joins(tmp_path: Path) -> None:
    etcd = EtcdCluster(tmp_path / "etcd", size=1)  # ports chosen, not started yet
    config = tmp_path / "n1.toml"
    config.write_text(node_config_toml("n1", etcd.endpoints, "late", free_ports(6),
                                       lease_ttl_s=3, workdir=tmp_path))
    node = LumendNode("n1", config, tmp_path / "n1.log").start()
    try:
        wait_until(lambda: "waiting for etcd at " + etcd.endpoints[0] in node.log_text(), 20,
                   "lumend to say it is waiting for etcd")
        assert node.running
        assert "elected coordinator" not in node.log_text()

        etcd.start()
        view = wait_until(
            lambda: (v := read_view(etcd.endpoints, "late")).coordinator is not None and v, 30,
            "the node to join and win the election once etcd is up",
        )
        assert "n1" in view.nodes and view.coordinator is not None
        assert view.coordinator.record.node == "n1"

        assert node.stop() == 0
        after = read_view(etcd.endpoints, "late")
        assert after.nodes == {} and after.workers == {} and after.coordinator is None
    finally:
        node.stop()
        etcd.stop()

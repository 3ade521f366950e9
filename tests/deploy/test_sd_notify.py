"""lumend under a stand-in for systemd: a NOTIFY_SOCKET the test owns, WATCHDOG_USEC set.

Real etcd, real lumend processes, real datagrams. No timings are asserted: each wait has a
generous deadline, and the watchdog's negative control waits until lumend itself reports
(on /metrics) that its HA loop is older than the watchdog interval before listening.
"""

from __future__ import annotations

import signal
import socket
import urllib.error
from collections.abc import Callable
from pathlib import Path

import pytest

from lumenctl.localcluster import EtcdCluster, free_ports

from .conftest import Lumend, NotifySocket, metric_value, read_view, unused_etcd, wait_until

WATCHDOG_USEC = 1_000_000  # 1 s: pings every 0.5 s; a stalled loop is silent after 1 s


def test_ready_status_watchdog_reload_stop(
    etcd: EtcdCluster, notify_socket: NotifySocket, start_lumend: Callable[..., Lumend]
) -> None:
    node = start_lumend(etcd.endpoints, notify=notify_socket, watchdog_usec=WATCHDOG_USEC)
    ready = notify_socket.wait_for("READY", 30, "READY=1")
    # READY follows registration: the node's keys are in etcd when READY arrives.
    view = read_view(etcd.endpoints, "deploy")
    assert "n1" in view.nodes and "n1-w0" in view.workers
    assert "via systemd-python" in node.log_text()
    assert "coordinating as n1 (epoch" in notify_socket.messages[ready]["STATUS"]
    # READY waits for the worker's engines: it serves (or stands by) when READY arrives.
    assert notify_socket.messages[ready]["STATUS"].startswith("1 worker serving; ")
    assert any(m.get("STATUS", "").startswith("1 worker starting; ")
               for m in notify_socket.messages[:ready])

    wait_until(lambda: notify_socket.pump() is not None
               and notify_socket.count("WATCHDOG", after=ready) >= 3, 30,
               "three WATCHDOG=1 pings after READY")
    assert all(m["WATCHDOG"] == "1" for m in notify_socket.messages if "WATCHDOG" in m)

    # SIGHUP with one live change (metrics.listen) and one that needs a restart.
    old_metrics = node.metrics_port
    new_metrics = free_ports(1)[0]
    text = node.config.read_text()
    node.config.write_text(
        text.replace(f"127.0.0.1:{old_metrics}", f"127.0.0.1:{new_metrics}")
        .replace("lease_ttl_s = 3", "lease_ttl_s = 4")
    )
    mark = len(notify_socket.messages)
    node.signal(signal.SIGHUP)
    reloading = notify_socket.wait_for("RELOADING", 30, "RELOADING=1", after=mark)
    assert "MONOTONIC_USEC" in notify_socket.messages[reloading]
    again = notify_socket.wait_for("READY", 30, "READY=1 after the reload", after=reloading)
    assert notify_socket.messages[again]["STATUS"].startswith(
        "reloaded: applied metrics.listen; needs a restart for etcd.lease_ttl_s")
    log = node.log_text()
    assert "reload: etcd.lease_ttl_s changed but cannot change while lumend runs" in log
    assert "reload: applied metrics.listen" in log
    assert "lumen_node_registered 1.0" in node.scrape(new_metrics)
    with pytest.raises(urllib.error.URLError):
        node.scrape(old_metrics)
    assert 'lumen_config_reloads_total{result="refused"} 1.0' in node.scrape(new_metrics)

    # An invalid file is rejected as a whole; the node keeps running.
    node.config.write_text(text.replace("lease_ttl_s = 3", "lease_ttl = 3"))
    mark = len(notify_socket.messages)
    node.signal(signal.SIGHUP)
    again = notify_socket.wait_for("READY", 30, "READY=1 after a rejected reload", after=mark)
    assert notify_socket.messages[again]["STATUS"].startswith("reload rejected: ")
    assert 'etcd.lease_ttl = 3: unknown key; did you mean "lease_ttl_s"?' in node.log_text()

    mark = len(notify_socket.messages)
    node.signal(signal.SIGTERM)
    assert node.proc.wait(timeout=30) == 0
    stopping = notify_socket.wait_for("STOPPING", 5, "STOPPING=1", after=mark)
    assert "resigning" in notify_socket.messages[stopping]["STATUS"]
    after = read_view(etcd.endpoints, "deploy")
    assert after.nodes == {} and after.coordinator is None


def test_not_ready_while_etcd_is_down_then_ready(
    tmp_path: Path, abstract_notify_socket: NotifySocket, start_lumend: Callable[..., Lumend]
) -> None:
    """Fallback transport (no systemd-python), abstract socket, etcd started late."""
    etcd = unused_etcd(tmp_path)
    sock = abstract_notify_socket
    node = start_lumend(etcd.endpoints, notify=sock, watchdog_usec=WATCHDOG_USEC,
                        env={"LUMEN_TEST_NO_SYSTEMD_PYTHON": "1"})
    try:
        wait_until(lambda: sock.pump() is not None
                   and any(("; waiting for etcd at " + etcd.endpoints[0]) in s
                           for s in sock.statuses()), 30,
                   "STATUS naming the etcd endpoint lumend waits for")
        wait_until(lambda: sock.pump() is not None and sock.count("EXTEND_TIMEOUT_USEC") >= 2,
                   30, "EXTEND_TIMEOUT_USEC while not ready")
        assert int(next(m for m in sock.messages if "EXTEND_TIMEOUT_USEC" in m)
                   ["EXTEND_TIMEOUT_USEC"]) >= 1_000_000
        assert sock.count("READY") == 0
        assert f"via datagram to {sock.address}" in node.log_text()

        etcd.start()
        ready = sock.wait_for("READY", 30, "READY=1 once etcd is up")
        assert "n1" in read_view(etcd.endpoints, "deploy").nodes
        assert sock.count("EXTEND_TIMEOUT_USEC", after=ready + 1) == 0
    finally:
        node.signal(signal.SIGTERM)
        node.proc.wait(timeout=30)
        etcd.stop()


def test_no_watchdog_while_the_ha_loop_is_stuck(
    tmp_path: Path, etcd: EtcdCluster, notify_socket: NotifySocket,
    start_lumend: Callable[..., Lumend],
) -> None:
    stall = tmp_path / "stall"
    node = start_lumend(etcd.endpoints, notify=notify_socket, watchdog_usec=WATCHDOG_USEC,
                        env={"LUMEN_TEST_STALL_FILE": str(stall)})
    ready = notify_socket.wait_for("READY", 30, "READY=1")
    wait_until(lambda: notify_socket.pump() is not None
               and notify_socket.count("WATCHDOG", after=ready) >= 2, 30,
               "WATCHDOG=1 pings while the loop is healthy (positive control)")

    stall.touch()
    wait_until(lambda: "TEST: HA loop stalled" in node.log_text(), 30, "the loop to stall")
    # lumend itself says its loop is older than the watchdog interval; the scrape also
    # shows that the event loop (which runs the sd_notify task) is alive.
    wait_until(lambda: metric_value(node.scrape(), "lumen_ha_last_cycle_age_seconds")
               > WATCHDOG_USEC / 1e6, 30, "the HA loop's last cycle to age past WatchdogSec")
    notify_socket.pump()
    mark = len(notify_socket.messages)
    # Four ping periods: a watchdog that ignored the loop's health would ping here.
    wait_until(lambda: node.proc.poll() is None
               and metric_value(node.scrape(), "lumen_ha_last_cycle_age_seconds")
               > 3 * WATCHDOG_USEC / 1e6, 30, "three watchdog intervals of stall")
    notify_socket.pump()
    assert notify_socket.count("WATCHDOG", after=mark) == 0, notify_socket.messages[mark:]
    assert node.proc.poll() is None

    stall.unlink()
    notify_socket.wait_for("WATCHDOG", 30, "WATCHDOG=1 again once the loop resumes",
                           after=mark)
    node.signal(signal.SIGTERM)
    assert node.proc.wait(timeout=30) == 0



def test_metrics_port_taken_fails_the_start_clearly(
    tmp_path: Path, start_lumend: Callable[..., Lumend]
) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        taken = busy.getsockname()[1]
        node = start_lumend(unused_etcd(tmp_path).endpoints, metrics_port=taken)
        assert node.proc.wait(timeout=30) == 1
    assert (f'cannot start: metrics.listen = "127.0.0.1:{taken}": cannot listen there'
            in node.log_text())

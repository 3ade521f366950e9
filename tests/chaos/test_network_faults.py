"""Network faults on a namespace lab (see `netlab.py`, `scenarios.py`): real etcd and lumend
processes, each in a network namespace of its own, under streaming load. Each scenario is
also a row of `bench/chaos.py`'s fault matrix."""

from __future__ import annotations

import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from . import netlab
from .scenarios import (
    coordinator_cut_off_from_etcd,
    etcd_member_black_holed,
    etcd_quorum_lost_and_back,
    node_cut_off_from_its_peers,
    node_state_dir_full,
    packet_loss,
    two_nodes_lost_at_once,
)

pytestmark = [pytest.mark.etcd, pytest.mark.skipif(netlab.available() is not None,
                                                   reason=str(netlab.available()))]


def test_a_coordinator_cut_off_from_etcd_is_replaced_and_stops_answering(
        tmp_path: Path) -> None:
    row = coordinator_cut_off_from_etcd(tmp_path)
    assert "THE OLD COORDINATOR STILL ANSWERS ADMIT" not in row.notes, row
    assert row.streams == row.identical, row
    assert row.admissions_resumed_s is not None


def test_a_black_holed_etcd_member_is_left_behind(tmp_path: Path) -> None:
    row = etcd_member_black_holed(tmp_path)
    assert row.streams == row.identical, row
    assert row.admissions_resumed_s is not None


def test_streams_on_a_node_cut_off_from_its_peers_resume_elsewhere(tmp_path: Path) -> None:
    row = node_cut_off_from_its_peers(tmp_path)
    assert not [note for note in row.notes if note.startswith("VOID")], row
    assert row.streams == row.identical, row
    assert any(note.endswith("streams resumed elsewhere") and not note.startswith("0 ")
               for note in row.notes), f"no stream was on the node cut off: void ({row})"


def test_lumend_outlives_an_etcd_quorum_loss_and_admits_again(tmp_path: Path) -> None:
    """Found by this scenario: a watch etcd could not confirm escaped the HA loop and
    lumend stopped (its engines with it) when etcd lost quorum."""
    row = etcd_quorum_lost_and_back(tmp_path)
    assert row.streams == row.identical, row
    assert row.admissions_resumed_s is not None


def test_two_nodes_lost_at_once_their_streams_continue_on_the_third(tmp_path: Path) -> None:
    row = two_nodes_lost_at_once(tmp_path)
    assert row.streams == row.identical, row
    assert not any(note.startswith("0 streams") for note in row.notes), f"void: {row}"


def test_a_full_state_dir_leaves_lumend_and_its_streams_running_and_is_reported(
        tmp_path: Path) -> None:
    """Found by this scenario: on a full state dir lumend and its engine went on (the engine
    restarted), but nothing said so: the engine's output, the reason it exited included,
    went nowhere, and neither lumend's log nor its metrics named the disk."""
    row = node_state_dir_full(tmp_path)
    assert not [n for n in row.notes if n.startswith("VOID")], row
    assert row.streams == row.identical == 16, row
    assert "lumend still running" in row.notes, row
    assert any(n.startswith("lumend said") and "is full" in n for n in row.notes), row
    assert "lumen_engine_log_free_bytes 0.0" in row.notes, row
    assert row.admissions_resumed_s is not None


def test_the_lab_makes_a_black_hole_not_a_refusal(tmp_path: Path) -> None:
    """The control for every scenario here: across a lab black hole a connection neither
    succeeds nor is refused; it times out. Healed, it succeeds."""
    lab = netlab.NetLab(tmp_path)
    try:
        a, b = lab.host("a"), lab.host("b")
        a.popen([sys.executable, "-m", "http.server", "9000", "--bind", a.ip], tmp_path / "a.log")

        def connect() -> str:
            code = (f"import socket; s = socket.socket(); s.settimeout(2)\n"
                    f"try:\n s.connect(('{a.ip}', 9000)); print('connected')\n"
                    f"except socket.timeout: print('timeout')\n"
                    f"except OSError as e: print('refused', e)")
            done = subprocess.run(["ip", "netns", "exec", b.ns, sys.executable, "-c", code],
                                  capture_output=True, text=True, timeout=30)
            return done.stdout.strip()

        for _ in range(50):  # the server starting
            if connect() == "connected":
                break
        assert connect() == "connected"
        lab.black_hole(a, b)
        assert connect() == "timeout"
        lab.heal(a, b)
        assert connect() == "connected"
    finally:
        lab.close()


@pytest.mark.skipif(netlab.nft_available() is not None, reason=str(netlab.nft_available()))
def test_streams_and_admissions_outlive_30_percent_packet_loss(tmp_path: Path) -> None:
    """30 % of the packets between every node and etcd and between nodes vanish: streams
    come out identical, Admit keeps being answered (elections, if any, are counted in the
    row, not asserted), and the loss really happened (nft's counters)."""
    row = packet_loss(tmp_path, 30, hold_s=12.0)
    note = next(n for n in row.notes if "packets dropped" in n)
    assert int(note.split()[0]) > 0, f"control: the loss rules dropped nothing ({row})"
    assert row.streams == row.identical, row
    assert not any(n.startswith("0/") for n in row.notes), f"no Admit answered ({row})"


@pytest.mark.skipif(netlab.nft_available() is not None, reason=str(netlab.nft_available()))
def test_the_lab_loses_the_share_of_packets_it_is_told(tmp_path: Path) -> None:
    """The control for the loss scenarios: with 30 % loss between two hosts about that share
    of 400 datagrams never arrives, and nft counts them; with the loss removed all arrive."""
    lab = netlab.NetLab(tmp_path)
    try:
        a, b = lab.host("a"), lab.host("b")

        def arrived(count: int = 400) -> int:
            receive = (f"import socket\ns = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)\n"
                       f"s.bind(('{a.ip}', 9001)); s.settimeout(1.5); n = 0\n"
                       f"try:\n while True: s.recv(64); n += 1\n"
                       f"except socket.timeout: print(n)")
            receiver = subprocess.Popen(["ip", "netns", "exec", a.ns, sys.executable, "-c",
                                         receive], stdout=subprocess.PIPE, text=True)
            time.sleep(0.5)
            send = (f"import socket, time\ns = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)\n"
                    f"for _ in range({count}):\n s.sendto(b'x', ('{a.ip}', 9001)); "
                    f"time.sleep(0.001)")
            subprocess.run(["ip", "netns", "exec", b.ns, sys.executable, "-c", send],
                           check=True, timeout=30)
            out, _ = receiver.communicate(timeout=30)
            return int(out)

        assert arrived() == 400
        lab.lossy(a, b, 30)
        got = arrived()
        assert 200 < got < 360, got  # 280 expected; binomial sd ~9
        assert a.dropped() == 400 - got and b.dropped() == 0
        lab.lossy(a, b, 0)
        assert arrived() == 400
        assert a.dropped() == 400 - got  # counted before the rule went, kept
    finally:
        lab.close()


def test_the_lab_delays_what_it_is_told(tmp_path: Path) -> None:
    """The control for the delay rows: through a relay set to 150 ms each way a round trip
    takes at least 300 ms and the relay counts the chunks it held; set to 0 it holds none."""
    lab = netlab.NetLab(tmp_path)
    try:
        a, b = lab.host("a"), lab.host("b")
        a.popen([sys.executable, "-m", "http.server", "9000", "--bind", a.ip], tmp_path / "a.log")
        relay = netlab.DelayProxy(b, f"{b.ip}:9100", f"{a.ip}:9000", tmp_path / "relay").start()

        def round_trip() -> float:
            began = time.monotonic()
            with urllib.request.urlopen(f"{relay.url}/", timeout=10) as r:
                r.read()
            return time.monotonic() - began

        for _ in range(50):  # the server and the relay starting
            try:
                round_trip()
                break
            except OSError:
                time.sleep(0.1)
        time.sleep(0.3)  # the relay's first report
        assert relay.stats()["chunks"] > 0 and relay.stats()["chunks_delayed"] == 0
        relay.delay(150)
        time.sleep(0.3)  # read ten times a second
        assert round_trip() >= 0.3
        time.sleep(0.3)  # its next report
        held = relay.stats()
        assert held["chunks_delayed"] >= 2, held
        relay.delay(0)
        time.sleep(0.3)
        round_trip()
        time.sleep(0.3)
        assert relay.stats()["chunks_delayed"] == held["chunks_delayed"]
        assert relay.stats()["chunks"] > held["chunks"]
    finally:
        lab.close()


@pytest.mark.skipif(netlab.nft_available() is not None, reason=str(netlab.nft_available()))
def test_the_lab_delays_what_a_host_receives_from_others(tmp_path: Path) -> None:
    """The control for the peer-link delay rows (etcd members, nodes): with a host's port
    relayed inbound and 150 ms set, a round trip from another host takes at least 300 ms
    and the relay counts what it held; the host's own connection to the port does not pass
    the relay; set to 0, the other host's round trip passes it and nothing is held."""
    lab = netlab.NetLab(tmp_path)
    try:
        a, b = lab.host("a"), lab.host("b")
        [relay] = a.relay_inbound([9000])
        a.popen([sys.executable, "-m", "http.server", "9000", "--bind", a.ip], tmp_path / "a.log")
        fetch = (f"import time, urllib.request\nfor _ in range(100):\n"
                 f" try:\n  urllib.request.urlopen('http://{a.ip}:9000/', timeout=5).read()\n"
                 f"  break\n except OSError: time.sleep(0.1)\n"
                 f"began = time.monotonic()\n"
                 f"urllib.request.urlopen('http://{a.ip}:9000/', timeout=10).read()\n"
                 f"print(time.monotonic() - began)")

        def round_trip(host: netlab.Host) -> float:
            done = subprocess.run(["ip", "netns", "exec", host.ns, sys.executable, "-c", fetch],
                                  capture_output=True, text=True, timeout=60)
            assert done.returncode == 0, done.stderr
            return float(done.stdout)

        round_trip(b)
        relay.delay(150)
        time.sleep(0.3)  # read ten times a second
        assert round_trip(b) >= 0.3
        time.sleep(0.3)  # its next report
        held = relay.stats()
        assert held["chunks_delayed"] >= 2, held
        round_trip(a)  # its own connection bypasses the relay
        time.sleep(0.3)
        assert relay.stats() == held
        relay.delay(0)
        time.sleep(0.3)
        round_trip(b)
        time.sleep(0.3)
        assert relay.stats()["chunks"] > held["chunks"]
        assert relay.stats()["chunks_delayed"] == held["chunks_delayed"]
    finally:
        lab.close()

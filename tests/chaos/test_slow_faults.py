"""Chaos scenarios too slow for CI's budget (marked `slow_chaos`: CI skips them; they run
with LUMEN_SLOW_CHAOS=1, and `make chaos` prints their rows). Real etcd and lumend
processes on the namespace lab under streaming load; each asserts what must hold and its
control (the fault really happened), never a time: times go in the fault matrix."""

from __future__ import annotations

from pathlib import Path

import pytest

from . import netlab
from .peer_faults import (
    etcd_disks_full_in_turn,
    etcd_peer_rtt,
    etcd_peer_rtt_1000ms,
    node_peer_rtt,
    node_peer_rtt_1000ms,
)
from .scenarios import (
    Row,
    coordinator_paused_past_its_ttl,
    etcd_disk_full,
    etcd_rtt_1000ms,
    etcd_rtt_delay,
    gateway_node_killed_under_load,
    packet_loss,
)

pytestmark = [pytest.mark.etcd, pytest.mark.slow_chaos,
              pytest.mark.skipif(netlab.available() is not None,
                                 reason=str(netlab.available()))]


def void(row: Row) -> None:
    notes = [n for n in row.notes if n.startswith("VOID")]
    if notes:
        pytest.fail(f"the fault did not happen: {notes} ({row})")


def dropped(row: Row) -> int:
    note = next(n for n in row.notes if n.endswith("s") and "packets dropped" in n)
    return int(note.split()[0])


@pytest.mark.skipif(netlab.nft_available() is not None, reason=str(netlab.nft_available()))
def test_streams_and_admissions_outlive_10_percent_packet_loss(tmp_path: Path) -> None:
    row = packet_loss(tmp_path, 10)
    assert dropped(row) > 0, f"control: the loss rules dropped nothing ({row})"
    assert row.streams == row.identical, row
    assert not any(n.startswith("0/") for n in row.notes), f"no Admit answered ({row})"


def test_etcd_out_of_disk_leaves_streams_and_lumend_running(tmp_path: Path) -> None:
    row = etcd_disk_full(tmp_path)
    void(row)
    assert row.streams == row.identical == 16, row
    assert "every lumend still running" in row.notes, row
    assert any(n.startswith("lumenctl status exit 3") for n in row.notes), row
    assert row.admissions_resumed_s is not None


def test_streams_outlive_a_coordinator_paused_past_its_ttl_in_the_lab(
        tmp_path: Path) -> None:
    """What the lab adds to tests/integration/test_coordinator_lease.py (which asserts the
    queued calls' answers): streams through another gateway, some on the paused node's
    engine, come out whole, and the node rejoins (the scenario waits for it)."""
    row = coordinator_paused_past_its_ttl(tmp_path)
    void(row)
    assert row.streams == row.identical, row


def test_a_killed_gateways_node_leaves_the_other_gateways_streams_whole(
        tmp_path: Path) -> None:
    """What the lab adds to tests/integration/test_coordinator_purge.py (which asserts the
    coordinator forgets the dead gateway's requests: here a number in the row)."""
    row = gateway_node_killed_under_load(tmp_path)
    void(row)
    assert row.streams == row.identical, row


def test_streams_and_admissions_outlive_200_ms_more_to_etcd(tmp_path: Path) -> None:
    row = etcd_rtt_delay(tmp_path)
    void(row)
    assert row.streams == row.identical, row
    assert not any(n.startswith("0/") for n in row.notes), f"no Admit answered ({row})"


def test_a_round_trip_to_etcd_past_the_request_timeout_is_named_in_the_log(
        tmp_path: Path) -> None:
    """Found by this scenario: with the round trip to etcd past `[etcd] request_timeout_s`
    every call timed out, no coordinator could hold a lease, and the nodes' logs said only
    "check that etcd runs there" (it did). Streams went on (they need no etcd); the log now
    names the setting; once the delay is gone the cluster settles by itself."""
    row = etcd_rtt_1000ms(tmp_path)
    void(row)
    assert row.streams == row.identical, row
    assert any(n.endswith("nodes' logs name [etcd] request_timeout_s")
               and not n.startswith("0 ") for n in row.notes), row


@pytest.mark.skipif(netlab.nft_available() is not None, reason=str(netlab.nft_available()))
def test_streams_outlive_200_ms_more_between_etcd_members(tmp_path: Path) -> None:
    row = etcd_peer_rtt(tmp_path)
    void(row)
    assert row.streams == row.identical == 16, row
    assert any(n.startswith("a write committed in") and n.endswith("under it")
               for n in row.notes), row


@pytest.mark.skipif(netlab.nft_available() is not None, reason=str(netlab.nft_available()))
def test_streams_outlive_a_round_trip_between_etcd_members_at_its_election_timeout(
        tmp_path: Path) -> None:
    """+1000 ms between members: etcd's writes take a round trip between members (past the
    lab's 1 s request timeout); what that does to leases and elections is in the row."""
    row = etcd_peer_rtt_1000ms(tmp_path)
    void(row)
    assert row.streams == row.identical == 16, row


@pytest.mark.skipif(netlab.nft_available() is not None, reason=str(netlab.nft_available()))
def test_streams_outlive_200_ms_more_between_nodes(tmp_path: Path) -> None:
    row = node_peer_rtt(tmp_path)
    void(row)
    assert row.streams == row.identical == 16, row
    assert not any(n.startswith("0/") for n in row.notes), f"no Admit answered ({row})"


@pytest.mark.skipif(netlab.nft_available() is not None, reason=str(netlab.nft_available()))
def test_streams_outlive_1000_ms_more_between_nodes(tmp_path: Path) -> None:
    row = node_peer_rtt_1000ms(tmp_path)
    void(row)
    assert row.streams == row.identical == 16, row


def test_etcd_members_filling_their_disks_in_turn_keep_quorum_and_streams(
        tmp_path: Path) -> None:
    row = etcd_disks_full_in_turn(tmp_path)
    void(row)
    assert row.streams == row.identical == 24, row
    assert sum(n.startswith("a write committed") and " exited" in n
               for n in row.notes) == 2, row
    assert sum(" healthy " in n for n in row.notes) == 2, row

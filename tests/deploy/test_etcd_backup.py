"""The operator guide's etcd backup and restore (section 20), run as written on a local
three-member etcd: a snapshot taken with `etcdctl snapshot save`, restored into every
member's data directory with the flags the guide's restore command gives, brings the
cluster back as one cluster holding LUMEN's keys as they were at the snapshot. The negative
control restores without the member flags (what the guide said before): every member then
comes up as a cluster of its own."""

from __future__ import annotations

import asyncio
import json
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from lumenctl.localcluster import EtcdCluster, EtcdMember, LocalCluster
from lumenctl.recovery import read_view
from lumend.cluster.store import EtcdStore
from lumend.cluster.view import ClusterView, Coordinator

from .conftest import wait_until

GUIDE = Path(__file__).parents[2] / "docs" / "operator-guide.md"
CLUSTER = "backup"
# What the restore needs for each member to join the others instead of starting alone.
MEMBER_FLAGS = ("--name", "--initial-cluster", "--initial-cluster-token",
                "--initial-advertise-peer-urls", "--data-dir")

pytestmark = pytest.mark.skipif(shutil.which("etcdctl") is None,
                                reason="needs etcdctl (the etcd-client package)")


def guide_restore_flags() -> list[str]:
    """The flags of the guide's `etcdctl snapshot restore` command, in its order."""
    text = GUIDE.read_text()
    section = text[text.index("## 20. etcd maintenance"):text.index("## 21.")]
    blocks = re.findall(r"```sh\n(.*?)```", section, re.S)
    lines = [line for block in blocks for line in block.replace("\\\n", " ").splitlines()]
    restore = [line for line in lines if "etcdctl snapshot restore" in line]
    assert len(restore) == 1, "the guide's section 20 shows one snapshot restore command"
    return [word for word in shlex.split(restore[0], comments=True) if word.startswith("--")]


def etcdctl(*args: str, endpoint: str | None = None) -> str:
    command = ["etcdctl", *(["--endpoints", endpoint] if endpoint else []), *args]
    done = subprocess.run(command, capture_output=True, text=True, timeout=60,
                          env={"ETCDCTL_API": "3", "PATH": "/usr/bin:/bin"})
    assert done.returncode == 0, f"{command}: {done.stderr}"
    return done.stdout


def lumenctl(etcd: EtcdCluster, *args: str, cluster: str = CLUSTER
             ) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "lumenctl", "--config", "/nonexistent",
                           "--endpoints", ",".join(etcd.endpoints), "--cluster", cluster,
                           "--etcd-timeout", "1", *args],
                          capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)


def restore(snapshot: Path, etcd: EtcdCluster, flags: list[str]) -> None:
    """Every member stopped, its data moved aside and restored from the snapshot with the
    given flags (each filled in with that member's value)."""
    for member in etcd.members:
        member.stop()
    initial = ",".join(f"{m.name}={m.peer_url}" for m in etcd.members)
    for member in etcd.members:
        member.data_dir.rename(member.data_dir.with_suffix(".before-restore"))
        values = {"--name": member.name, "--data-dir": str(member.data_dir),
                  "--initial-cluster": initial, "--initial-cluster-token": "lumen-etcd",
                  "--initial-advertise-peer-urls": member.peer_url}
        etcdctl("snapshot", "restore", str(snapshot),
                *[part for flag in flags for part in (flag, values[flag])])


def members_seen(member: EtcdMember) -> int:
    return len(json.loads(etcdctl("member", "list", "-w", "json",
                                  endpoint=member.client_url))["members"])


def test_the_guides_backup_and_restore(tmp_path: Path) -> None:
    flags = guide_restore_flags()
    assert set(MEMBER_FLAGS) <= set(flags), flags
    etcd = EtcdCluster(tmp_path / "etcd", size=3).start()
    try:
        assert lumenctl(etcd, "config", "set", "beta", "2", "--yes").returncode == 0
        snapshot = tmp_path / "lumen.db"
        etcdctl("snapshot", "save", str(snapshot), endpoint=etcd.endpoints[0])
        # Written after the snapshot: the restore takes it back.
        assert lumenctl(etcd, "config", "set", "beta", "3", "--yes").returncode == 0

        restore(snapshot, etcd, [f for f in flags if f in MEMBER_FLAGS])
        etcd.start()
        assert [members_seen(m) for m in etcd.members] == [3, 3, 3]
        assert lumenctl(etcd, "config", "get", "beta").stdout.strip() == "2.0"
        # Writable: one cluster with a quorum.
        assert lumenctl(etcd, "config", "set", "beta", "4", "--yes").returncode == 0
    finally:
        etcd.stop()


def test_a_restore_without_the_member_flags_splits_the_cluster(tmp_path: Path) -> None:
    etcd = EtcdCluster(tmp_path / "etcd", size=3).start()
    try:
        snapshot = tmp_path / "lumen.db"
        etcdctl("snapshot", "save", str(snapshot), endpoint=etcd.endpoints[0])
        restore(snapshot, etcd, ["--data-dir"])
        etcd.start()
        assert [members_seen(m) for m in etcd.members] == [1, 1, 1]
    finally:
        etcd.stop()


def agent_doc(cluster: LocalCluster, node: str) -> dict[str, Any]:
    done = subprocess.run([sys.executable, "-m", "lumenctl", "--config", "/nonexistent",
                           "--endpoints", ",".join(cluster.endpoints), "--cluster",
                           cluster.cluster, "-o", "json", "agent", node],
                          capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
    assert done.returncode == 0, done.stderr
    doc: dict[str, Any] = json.loads(done.stdout)
    return doc


def test_after_a_restore_lumend_follows_the_new_coordinator_without_a_restart(
        tmp_path: Path) -> None:
    """A restore takes etcd's revision back to the snapshot's, and so the coordinator epochs
    etcd hands out next (create revisions) fall below the highest epoch a running lumend has
    seen. lumend notices (a read answered below that epoch: lumend/cluster/fencing.py) and
    follows the coordinator elected since: its drain order is carried out, no restart. (Before
    it noticed, the order was refused as stale until lumend restarted: this test failed.)"""
    cluster = LocalCluster(tmp_path / "cluster", size=1, shadows=0, cluster="restore").start()
    node = cluster.nodes[0]
    worker = f"{node.name}-w0"

    def view() -> ClusterView:
        return read_view(cluster.endpoints, cluster.cluster)

    def serving(min_epoch: int = 0) -> Coordinator | None:
        v = view()
        w = v.workers.get(worker)
        ok = v.coordinator is not None and v.coordinator.epoch > min_epoch and \
            w is not None and w.state == "serving"
        return v.coordinator if ok else None

    try:
        wait_until(serving, 60, "a serving worker")
        snapshot = tmp_path / "lumen.db"
        etcdctl("snapshot", "save", str(snapshot), endpoint=cluster.endpoints[0])
        # Revisions after the snapshot (a busy cluster's heartbeats and events), then an
        # election: the epoch the node has seen is far above the snapshot's revision.
        churn(cluster.endpoints, 1000)
        node.kill()
        node.start()
        high = wait_until(lambda: serving(min_epoch=1000), 60, "a new coordinator, serving")
        assert agent_doc(cluster, node.name)["highest_epoch"] == high.epoch

        restore(snapshot, cluster.etcd, list(MEMBER_FLAGS))
        cluster.etcd.start()

        def elected_after_the_restore() -> Coordinator | None:
            c = view().coordinator
            return c if c is not None and c.epoch < 1000 else None

        low = wait_until(elected_after_the_restore, 60, "a coordinator after the restore")
        wait_until(lambda: agent_doc(cluster, node.name)["highest_epoch"] == low.epoch, 60,
                   f"the node's fence at the new coordinator's epoch {low.epoch}")
        drain = lumenctl(cluster.etcd, "drain", worker, "--yes", "--force",
                         cluster=cluster.cluster)
        assert drain.returncode == 0, drain.stderr
        wait_until(lambda: (w := view().workers.get(worker)) is not None and
                   w.state == "drained", 90, "the drain carried out, lumend not restarted")
        doc = agent_doc(cluster, node.name)
        assert doc["stale_refused"] == 0, doc
        assert "etcd answered at revision" in node.log_text(), "the rewind was not logged"
    finally:
        cluster.stop()


def churn(endpoints: list[str], revisions: int) -> None:
    async def put() -> None:
        store = EtcdStore(endpoints)
        try:
            for i in range(revisions):
                await store.put("/churn", str(i).encode())
        finally:
            await store.close()

    asyncio.run(put())

"""etcd out of space (NOSPACE): the node says so with the command that clears it and keeps
its lease, `lumenctl status` shows the alarm and the command, the documented command
clears it, and the node coordinates again (real etcd with a tiny quota, a real lumenctl,
an in-process HA loop)."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from lumenctl.localcluster import EtcdCluster
from lumend.cluster.agent import AgentTiming, ClusterAgent, NodeIdentity
from lumend.cluster.keys import Keys
from lumend.cluster.store import NOSPACE_FIX, EtcdStore, StoreError

CLUSTER = "full"
KEYS = Keys(CLUSTER)


def run_ctl(etcd: EtcdCluster, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "lumenctl", "--config", "/nonexistent.toml",
                           "--endpoints", ",".join(etcd.endpoints), "--cluster", CLUSTER,
                           *args], capture_output=True, text=True, timeout=30,
                          stdin=subprocess.DEVNULL)


async def ctl(etcd: EtcdCluster, *args: str) -> subprocess.CompletedProcess[str]:
    """lumenctl, off the event loop (the HA loop under test shares it)."""
    return await asyncio.to_thread(run_ctl, etcd, *args)


async def until(check: object, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():  # type: ignore[operator]
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.05)


def test_nospace_is_reported_and_cleared_by_the_documented_command(tmp_path: Path) -> None:
    etcd = EtcdCluster(tmp_path / "etcd", auto_compaction_retention=None,
                       quota_backend_bytes=2 << 20).start()
    try:
        asyncio.run(scenario(etcd))
    finally:
        etcd.stop()


async def scenario(etcd: EtcdCluster) -> None:
    store = EtcdStore(etcd.endpoints)
    me = NodeIdentity(name="n1", address="127.0.0.1", gateway="127.0.0.1:1", rpc="127.0.0.1:2",
                      checkpoint="127.0.0.1:3", metrics="127.0.0.1:4")
    # The coordinator's own compaction off: the alarm stays until an operator clears it.
    agent = ClusterAgent(store, KEYS, me, AgentTiming.for_ttl(4),
                         compact_every_s=float("inf"))
    stop = asyncio.Event()
    task = asyncio.create_task(agent.run(stop))
    try:
        await until(lambda: agent.is_coordinator, 15, "n1 elected")
        healthy = json.loads((await ctl(etcd, "-o", "json", "status")).stdout)
        assert healthy["etcd"]["alarms"] == [] and healthy["etcd"]["fix"] is None
        lease = agent.lease.lease_id
        # Something else fills etcd's history (three keys rewritten) to the quota.
        i = 0
        try:
            while True:
                await store.put(f"/other/{i % 3}", os.urandom(100_000))
                i += 1
        except StoreError as exc:
            assert "database space exceeded" in str(exc)
        await until(lambda: "NOSPACE" in agent.status, 15, "the node reporting NOSPACE")
        assert "etcdctl alarm disarm" in agent.status
        assert not agent.is_coordinator  # it cannot write: it stopped deciding
        assert agent.lease.lease_id == lease, "a full etcd is no reason to drop the lease"

        status = await ctl(etcd, "-o", "json", "status")
        assert status.returncode == 0, status.stderr
        doc = json.loads(status.stdout)
        assert doc["etcd"]["alarms"] == ["NOSPACE"]
        assert doc["etcd"]["fix"] == NOSPACE_FIX
        table = await ctl(etcd, "status")
        assert "etcd alarm NOSPACE" in table.stdout and "etcdctl alarm disarm" in table.stdout
        # Seconds of cycles under the alarm: it stepped down once, no resume-and-fail flapping.
        assert agent.step_downs == 1 and not agent.is_coordinator, agent.status

        # The documented command, as an operator would paste it.
        command = NOSPACE_FIX.split("`")[1]
        env = {**os.environ, "ETCDCTL_ENDPOINTS": ",".join(etcd.endpoints), "ETCDCTL_API": "3"}
        cleared = await asyncio.to_thread(subprocess.run, ["bash", "-c", command],
                                          capture_output=True, text=True, timeout=60, env=env)
        assert cleared.returncode == 0, cleared.stdout + cleared.stderr
        assert "alarm:NOSPACE" in cleared.stdout  # what `alarm disarm` disarmed

        await until(lambda: agent.is_coordinator, 20, "n1 coordinating again")
        await until(lambda: agent.alarms == (), 20, "the node seeing the alarm cleared")
        after = json.loads((await ctl(etcd, "-o", "json", "status")).stdout)
        assert after["etcd"]["alarms"] == [] and after["coordinator"]["node"] == "n1"

        for _ in range(100):
            out = (await ctl(etcd, "-o", "json", "events")).stdout
            if any(e["kind"] == "etcd_alarm_cleared" for e in json.loads(out)["events"]):
                break
            await asyncio.sleep(0.1)
        else:
            raise AssertionError("no etcd_alarm_cleared event")
    finally:
        stop.set()
        await task
        await store.close()

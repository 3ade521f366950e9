"""Coordinator takeover after SIGKILL and after a graceful stop, and heartbeat write rates.

Runs a local cluster (one etcd member, N lumend processes on loopback) and prints tables.
Asserts nothing about time: these machines are shared and noisy.

    python bench/takeover.py [--runs 10] [--ttl 3] [--nodes 3]
"""

from __future__ import annotations

import argparse
import signal
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from lumenctl.demo import read_view
from lumenctl.localcluster import LocalCluster
from lumend.cluster.view import ClusterView


def poll(cluster: LocalCluster, check: Callable[[ClusterView], bool], timeout_s: float,
         what: str) -> ClusterView:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        view = read_view(cluster.endpoints, cluster.cluster)
        if check(view):
            return view
        time.sleep(0.01)
    raise TimeoutError(f"timed out waiting for {what}")


def full(cluster: LocalCluster) -> ClusterView:
    return poll(
        cluster,
        lambda v: v.coordinator is not None and len(v.nodes) == cluster.size,
        60, "every node registered and a coordinator",
    )


def takeover(cluster: LocalCluster, graceful: bool) -> float:
    view = full(cluster)
    assert view.coordinator is not None
    leader, epoch = view.coordinator.record.node, view.coordinator.epoch
    node = cluster.node(leader)
    started = time.monotonic()
    if graceful:
        node.signal(signal.SIGTERM)  # measured to the handover, not to the process's exit
    else:
        node.kill()
    poll(cluster, lambda v: v.coordinator is not None and v.coordinator.epoch > epoch,
         cluster.lease_ttl_s * 4 + 10, "a new coordinator")
    took = time.monotonic() - started
    node.stop()
    node.start()
    return took


def heartbeat_rate(cluster: LocalCluster, seconds: float) -> tuple[float, float]:
    full(cluster)
    time.sleep(cluster.lease_ttl_s)  # let start-up writes settle
    first = read_view(cluster.endpoints, cluster.cluster).revision
    time.sleep(seconds)
    last = read_view(cluster.endpoints, cluster.cluster).revision
    total = (last - first) / seconds
    return total, total / cluster.size


def row(label: str, samples: list[float], ttl: int) -> str:
    return (f"| {label:<22} | {ttl:>5} | {len(samples):>4} | {statistics.median(samples):>8.2f} "
            f"| {max(samples):>8.2f} | {statistics.median(samples) / ttl:>12.2f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--ttl", type=int, default=3, help="node lease TTL, seconds")
    parser.add_argument("--nodes", type=int, default=3)
    parser.add_argument("--rate-window", type=float, default=20.0)
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="lumen-bench-") as tmp:
        cluster = LocalCluster(Path(tmp), size=args.nodes, lease_ttl_s=args.ttl)
        try:
            cluster.start()
            killed = [takeover(cluster, graceful=False) for _ in range(args.runs)]
            stopped = [takeover(cluster, graceful=True) for _ in range(args.runs)]
            total, per_node = heartbeat_rate(cluster, args.rate_window)
        finally:
            cluster.stop()

    print(f"\ncoordinator takeover, {args.nodes} lumend nodes, 1 etcd member, loopback")
    print("| case                   | ttl s | runs | median s |    max s | median / ttl |")
    print("|------------------------|-------|------|----------|----------|--------------|")
    print(row("SIGKILL coordinator", killed, args.ttl))
    print(row("SIGTERM (resign)", stopped, args.ttl))
    print(f"\ngraceful handover is {statistics.median(killed) / statistics.median(stopped):.0f}x "
          "faster than waiting for the lease (median vs median)")
    print(f"\netcd writes in steady state over {args.rate_window:.0f} s: {total:.2f}/s in all, "
          f"{per_node:.2f}/s per node (heartbeat interval {args.ttl / 3:.2f} s; the "
          "coordinator's status writes included)")


if __name__ == "__main__":
    main()

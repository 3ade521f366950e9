"""lumend serves the checkpoint holder on `[checkpoint] listen` and publishes its stats."""

from __future__ import annotations

import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from lumenctl.demo import read_view
from lumenctl.localcluster import LocalCluster
from lumend.checkpoint.security import CurveKeys
from lumend.checkpoint.streamer import CheckpointStreamer
from lumend.config import load_config
from tests.integration.conftest import wait_until

from .conftest import LAYOUT, PAGE, RawPeer, block_hash, page

pytestmark = pytest.mark.etcd


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[LocalCluster]:
    c = LocalCluster(tmp_path / "cluster", size=1, lease_ttl_s=3)
    try:
        yield c.start()
    finally:
        c.stop()


def scrape(url: str) -> str:
    with urllib.request.urlopen(url, timeout=5) as response:
        return str(response.read().decode())


def test_a_node_holds_checkpoints_and_publishes_them(cluster: LocalCluster) -> None:
    node = cluster.nodes[0]
    config = load_config(node.config_path)
    worker = config.workers[0].name
    keys = CurveKeys.load(cluster.keys_file)
    assert config.checkpoint.keys == str(cluster.keys_file)  # a local cluster runs secure
    streamer = CheckpointStreamer(f"tcp://{config.checkpoint.listen}", LAYOUT, curve=keys)
    peer = RawPeer(f"tcp://{config.checkpoint.listen}", curve=keys)
    intruder = CheckpointStreamer(f"tcp://{config.checkpoint.listen}", LAYOUT)  # no keys
    try:
        assert streamer.wait_connected(30), node.log_text()[-2000:]
        for i in range(3):
            assert streamer.put_block(ckpt_id="c1", request_id="r1", worker=worker,
                                      block_index=i, block_hash=block_hash("c1", i),
                                      page=page(i), token_count=16 * (i + 1))
        assert streamer.wait_acks("c1", 10).complete
        assert peer.ask([b"not a header"]).reason == "malformed"
        assert not intruder.wait_connected(1.0)

        def published() -> object:
            record = read_view(cluster.endpoints, cluster.cluster).workers.get(worker)
            return record is not None and record.checkpoints.bytes_held == 3 * PAGE and record

        record = wait_until(published, 30, "the checkpoint usage in etcd")
        assert record.checkpoints.requests == 1  # type: ignore[attr-defined]
        assert record.checkpoints.budget_bytes == config.checkpoint.budget_bytes  # type: ignore[attr-defined]

        metrics = scrape(f"http://{config.metrics.listen}/metrics")
        assert f'lumen_ckpt_held_bytes{{worker="{worker}"}} {3.0 * PAGE}' in metrics
        # The 0.1 name, a deprecated alias for one release.
        assert f'lumen_ckpt_bytes_held{{worker="{worker}"}} {3.0 * PAGE}' in metrics
        assert f'lumen_ckpt_requests{{worker="{worker}"}} 1.0' in metrics
        assert f'lumen_ckpt_evictions_total{{worker="{worker}"}} 0.0' in metrics
        assert f'lumen_ckpt_refusals_total{{worker="{worker}"}} 0.0' in metrics
        assert 'lumen_ckpt_bad_frames_total{reason="malformed"} 1.0' in metrics
        refused = [line for line in metrics.splitlines() if line.startswith(
            'lumen_ckpt_bad_frames_total{reason="unauthenticated"}')]
        assert refused and float(refused[0].split()[-1]) >= 1, "the intruder was not counted"

        assert streamer.finish("c1", "r1")
        wait_until(lambda: (r := read_view(cluster.endpoints, cluster.cluster).workers[worker])
                   .checkpoints.bytes_held == 0 and r, 30, "the usage to drop after FINISH")
    finally:
        streamer.close()
        peer.close()
        intruder.close()

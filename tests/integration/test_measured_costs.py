"""Issue 15: the running product measures its own restore bandwidth. Two lumend nodes on
loopback (sim engines, real etcd); `lumenctl config show -o json` says the restore bandwidth
is the default constant; streams run, one worker's engine is SIGKILLed mid-stream and its
requests resume on the other worker from the checkpoints it held; then `config show` reports
a bandwidth measured from that worker's restores and the prefill seconds per token from
the requests that finished (the pair used together), the KV bytes per token measured and
used, and the coordinator logs its cost model ("cost model: ...")."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from collections.abc import Callable
from typing import Any

import aiohttp
import pytest

from lumenctl.demo import read_view
from lumenctl.localcluster import LocalCluster
from lumenctl.recovery import lumenctl
from lumend.engine.sim_models import SIM_MODELS

from ..gateway.test_gateway import chat_prompt, expected, stream
from .conftest import wait_until
from .test_coordinator import all_serving, metric
from .test_recovery_e2e import coordinator_in_mode, engine_running

MakeCluster = Callable[..., LocalCluster]

STREAMS = 12
RESUMED = ("lumen_gateway_coordinated_total", '{call="recover"}')
SIM_SMALL_KV_BYTES_PER_TOKEN = SIM_MODELS["sim-small"].kv_bytes_per_token


def rows(cluster: LocalCluster) -> dict[str, dict[str, Any]]:
    doc = json.loads(lumenctl(cluster, "config", "show", "-o", "json"))
    assert doc["costs_used"] is True  # decisions = cost_aware, the default
    return {row["key"]: row for row in doc["costs"]}


def restore_row(cluster: LocalCluster) -> dict[str, Any]:
    return rows(cluster)["restore_bytes_per_s"]


async def streams_through_a_fault(cluster: LocalCluster) -> None:
    """STREAMS streams through node-1's gateway; the engine running the most of them
    SIGKILLed once all are going; every stream still equals the failure-free one."""
    prompts = [f"stream {i} of {STREAMS}, a prompt long enough to fill a few KV blocks of "
               "sixteen tokens each before the fault" for i in range(STREAMS)]
    received = [[0] for _ in prompts]
    timeout = aiohttp.ClientTimeout(total=None, sock_read=120)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        base = cluster.node("node-1").gateway
        tasks = [asyncio.create_task(stream(session, base, i % 2 == 1, p, received[i]))
                 for i, p in enumerate(prompts)]
        deadline = time.monotonic() + 60
        while min(r[0] for r in received) < 32:  # each with two more full KV blocks
            assert time.monotonic() < deadline, "the streams never got going"
            assert not any(t.done() for t in tasks), "a stream ended before the fault"
            await asyncio.sleep(0.02)
        # The victim: the worker running more of them (its checkpoints are on the other).
        view = await asyncio.to_thread(read_view, cluster.endpoints, cluster.cluster)
        engines = [next(e for e in w.engines if e.role == "active")
                   for w in view.workers.values()]
        running = [await asyncio.to_thread(engine_running, e.url) for e in engines]
        victim = engines[running.index(max(running))]
        assert max(running) >= 3, f"only {running} streams per worker: too little to restore"
        assert victim.pid is not None
        os.kill(victim.pid, signal.SIGKILL)
        results = await asyncio.gather(*tasks)
    for i, (prompt, (ids, text, errors)) in enumerate(zip(prompts, results, strict=True)):
        assert errors == [] and len(ids) == 1, f"stream {i}: {errors}, ids {sorted(ids)}"
        assert text == expected(chat_prompt(prompt) if i % 2 == 1 else prompt), (
            f"stream {i} differs from the failure-free stream")


def test_config_show_reports_the_restore_bandwidth_measured_by_resumes(
    local_cluster: MakeCluster,
) -> None:
    cluster = local_cluster(size=2, lease_ttl_s=3, shadows=0,
                            engine_args=("--time-scale", "3.0"))
    wait_until(all_serving(cluster), 90, "2 serving workers and one coordinator")
    asyncio.run(coordinator_in_mode(cluster, "lumen", 2))
    before = restore_row(cluster)
    assert before["source"] == "default" and before["workers"] == 0, before
    assert before["value"] == 25e9 and before["age_s"] is None

    gateway = cluster.node("node-1")
    asked = metric(gateway, *RESUMED)
    asyncio.run(streams_through_a_fault(cluster))
    recovered = int(metric(gateway, *RESUMED) - asked)
    assert recovered >= 1, "no stream was on the victim: nothing resumed, test void"

    # The survivor's restores measure the restore bandwidth; the requests that finished
    # measure the prefill seconds per token it is weighed against (both engine kinds
    # export vLLM's request_prefill_time_seconds): both used, as a pair (a figure measured
    # alone is held, tests/unit/test_cost_estimates.py).
    def measured() -> dict[str, Any] | None:
        row = restore_row(cluster)
        return row if row["source"] == "measured" else None

    try:
        row = wait_until(measured, 60, "config show reporting a measured restore bandwidth")
    except BaseException:
        view = read_view(cluster.endpoints, cluster.cluster)
        print({name: w.load for name, w in view.workers.items()})  # what the records say
        print(rows(cluster))  # and what config show makes of them
        raise
    # The survivor restored what the victim's requests had checkpointed on it: at least
    # MIN_RESTORE_BYTES (4 sim pages of 256 KiB), in real seconds on loopback.
    assert row["value"] != 25e9 and row["workers"] >= 1, row
    assert row["value"] > 0 and row["unit"] == ["bytes", "s"]
    prefill = rows(cluster)["recompute_s_per_token"]
    assert prefill["source"] == "measured" and prefill["workers"] >= 1, prefill
    assert prefill["value"] > 0 and prefill["unit"] == ["tokens", "s"], prefill
    # and the KV bytes of a token from the same restores: the sim model's, not the constant's
    kv = rows(cluster)["kv_bytes_per_token"]
    assert kv["source"] == "measured", kv
    assert kv["value"] == pytest.approx(SIM_SMALL_KV_BYTES_PER_TOKEN, rel=1 / 64), kv
    assert kv["age_s"] is not None and kv["age_s"] >= 0
    how = (f"the marginal cost fitted from {prefill['fit_steps']} engine steps"
           if prefill["fit_steps"] else "per-request prefill time / tokens")
    print(f"measured: {row['value'] / 1e6:.1f} MB/s restored, {prefill['value'] * 1e6:.0f} us"
          f" per prefilled token ({how}; the cost model's marginal b x time scale: "
          f"{SIM_MODELS['sim-small'].cost.b * 3e6:.0f} us), {kv['value']:.0f} KV bytes per "
          "token")
    # The coordinator decides with the same figure (it logs the change).
    logs = "".join(p.read_text(errors="replace") for p in cluster.workdir.rglob("*.log"))
    assert "cost model: restore bandwidth" in logs and "measured from 1 worker" in logs
    # The operator's switch back to the constants: the same records, the default again.
    lumenctl(cluster, "config", "set", "costs", "constant", "--yes")
    pinned = restore_row(cluster)
    assert pinned["source"] == "default" and pinned["value"] == 25e9, pinned

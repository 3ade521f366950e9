"""etcd hygiene under heartbeats (real etcd, in-process HA loops, compressed time):

* a heartbeat writes a record only when it changed meaningfully: load and checkpoint
  jitter does not rewrite it every TTL/3; what decisions turn on is written at once;
* a soak of many nodes x workers whose records change all the time, for many compressed
  hours: with the coordinator's fenced compaction etcd's database stays bounded; without
  it (the negative control) it keeps growing. Sizes are etcd's own (Maintenance Status).
"""

from __future__ import annotations

import asyncio
import functools
import random
from pathlib import Path

import msgspec

from lumenctl.localcluster import EtcdCluster
from lumend.cluster.agent import COUNTER_REFRESH_S, AgentTiming, ClusterAgent, NodeIdentity
from lumend.cluster.keys import Keys
from lumend.cluster.lease import LeaseKeeper
from lumend.cluster.models import (
    CheckpointUsage,
    EngineInfo,
    WorkerLoad,
    WorkerRecord,
    decode_value,
)
from lumend.cluster.store import EtcdStore
from lumend.coordinator.estimates import StepTracker

MiB = 1 << 20


class Clock:
    def __init__(self, start: float) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now


def identity(name: str) -> NodeIdentity:
    return NodeIdentity(name=name, address="127.0.0.1", gateway="127.0.0.1:1",
                        rpc="127.0.0.1:2", checkpoint="127.0.0.1:3", metrics="127.0.0.1:4")


def compressed(agent: ClusterAgent, store: EtcdStore, ttl_s: int = 60) -> ClusterAgent:
    """The agent's schedules (heartbeat refresh, compaction, trimming) run on the test's
    compressed clock; its lease lives in real time, as etcd keeps it."""
    agent.lease = LeaseKeeper(store, ttl_s)
    return agent


def worker(name: str, node: str, running: int, kv: float, held: int,
           state: str = "serving") -> WorkerRecord:
    engines = [EngineInfo(id=f"{name}/a", role="active", state="active", url="http://e:1",
                          pid=100),
               EngineInfo(id=f"{name}/b", role="shadow", state="standby", url="http://e:2",
                          pid=101)]
    return WorkerRecord(name=name, node=node, gpus=[0], engine="sim", model="sim-small",
                        state=state, engines=engines,  # type: ignore[arg-type]
                        load=WorkerLoad(running=running, waiting=0, kv_usage=kv),
                        checkpoints=CheckpointUsage(bytes_held=held, budget_bytes=1 << 30,
                                                    requests=running),
                        updated_at=0.0)


def test_heartbeats_skip_jitter_and_write_meaningful_changes_at_once(
        etcd: EtcdCluster) -> None:
    keys = Keys("beats")
    rng = random.Random(7)
    mono, wall = Clock(0.0), Clock(1.8e9)
    records: dict[str, WorkerRecord] = {}

    def jitter() -> None:
        for i in range(4):
            name = f"w{i}"
            records[name] = worker(name, "n1", 20 + rng.randint(0, 1),
                                   0.40 + rng.uniform(-0.01, 0.01),
                                   496 * MiB + rng.randint(1, 10) * MiB)

    async def scenario() -> None:
        store = EtcdStore(etcd.endpoints)
        agent = compressed(ClusterAgent(store, keys, identity("n1"), AgentTiming.for_ttl(30),
                                        lambda: list(records.values()), wall_clock=wall,
                                        monotonic=mono), store)
        writes: dict[str, int] = {}
        last: dict[str, int] = {}

        async def step() -> None:
            mono.now += agent._timing.heartbeat_s
            wall.now += agent._timing.heartbeat_s
            await agent.lease.renew() if agent.lease.held else None
            await agent.cycle()
            for kv in (await store.get_prefix(keys.workers)).kvs:
                if last.get(kv.key) != kv.mod_revision:
                    writes[kv.key] = writes.get(kv.key, 0) + 1
                    last[kv.key] = kv.mod_revision

        try:
            jitter()
            steps = int(50 / agent._timing.heartbeat_s)  # 50 s: under WORKER_REFRESH_S
            for _ in range(steps):
                jitter()
                await step()
            assert agent.is_coordinator
            # Written once on registration; the jitter never again (before: every step).
            assert sorted(writes.values()) == [1, 1, 1, 1], writes
            # What decisions turn on is written in the very next heartbeat: the queue
            # emptying (drain --wait), a state change, a load that moved a step.
            changes = {
                "w0": msgspec.structs.replace(records["w0"], load=WorkerLoad(kv_usage=0.4)),
                "w1": msgspec.structs.replace(records["w1"], state="recovering"),
                "w2": msgspec.structs.replace(records["w2"], load=WorkerLoad(running=40)),
            }
            records.update(changes)
            await step()
            w = {k.removeprefix(keys.workers): n for k, n in writes.items()}
            assert w == {"w0": 2, "w1": 2, "w2": 2, "w3": 1}, w
            # And an unchanged record is refreshed at the latest after WORKER_REFRESH_S.
            for _ in range(int(15 / agent._timing.heartbeat_s)):
                await step()
            assert writes[keys.worker("w3")] == 2, writes
        finally:
            await store.close()

    asyncio.run(scenario())


def test_a_month_old_engines_step_counters_still_give_its_recent_step_time(
        etcd: EtcdCluster) -> None:
    """The step counters are cumulative since the engine started. After a month of a busy
    engine a few seconds' growth is a millionth of them: the records must still carry it
    (exact, written every COUNTER_REFRESH_S when only they grew: neither per heartbeat nor
    never), and the coordinator's tracker, fed what etcd holds, must read the step time of
    the last seconds, not the month's."""
    keys = Keys("month")
    month = 30 * 86400.0
    mono, wall = Clock(month), Clock(1.8e9)
    step = {"s": 0.005}  # the engine's step time now; it changes below
    counters = {"steps": int(month / 0.005), "step_s": month, "prefill": 10**11}
    base = worker("w0", "n1", 8, 0.5, 0)

    def records() -> list[WorkerRecord]:
        load = WorkerLoad(running=8, waiting=0, kv_usage=0.5, steps=counters["steps"],
                          step_s=round(counters["step_s"], 6),
                          prefill_tokens=counters["prefill"])
        return [msgspec.structs.replace(base, load=load, updated_at=wall.now)]

    async def scenario() -> tuple[list[WorkerRecord], int, int]:
        store = EtcdStore(etcd.endpoints)
        agent = compressed(ClusterAgent(store, keys, identity("n1"), AgentTiming.for_ttl(10),
                                        records, wall_clock=wall, monotonic=mono), store,
                           ttl_s=10)  # lumend's default: a heartbeat every 3.3 s
        seen: list[WorkerRecord] = []
        beats = 0
        try:
            for t in range(int(240 / agent._timing.heartbeat_s)):
                if t == int(120 / agent._timing.heartbeat_s):
                    step["s"] = 0.020  # the survivor got busier: 20 ms a step from here
                dt = agent._timing.heartbeat_s
                mono.now += dt
                wall.now += dt
                counters["steps"] += int(dt / step["s"])
                counters["step_s"] += int(dt / step["s"]) * step["s"]
                counters["prefill"] += 300
                await agent.lease.renew() if agent.lease.held else None
                await agent.cycle()
                beats += 1
                kv = (await store.get_prefix(keys.workers)).kvs[0]
                record = decode_value(kv.value, WorkerRecord)
                if not seen or seen[-1] != record:
                    seen.append(record)
        finally:
            await store.close()
        return seen, beats, int(240 / agent._timing.heartbeat_s * dt)

    seen, beats, span = asyncio.run(scenario())
    # Written about every COUNTER_REFRESH_S: not at every heartbeat, not never.
    assert span / (COUNTER_REFRESH_S + AgentTiming.for_ttl(10).heartbeat_s) - 1 <= len(seen)
    assert len(seen) <= span / COUNTER_REFRESH_S + 2 < beats, (len(seen), beats)
    tracker = StepTracker()
    rates = []
    for record in seen:
        tracker.observe([record])
        rates.append(tracker.rate("w0"))
    print(f"{len(seen)} records in {beats} heartbeats; step time read after each: "
          f"{[None if r is None else round(r.step_s * 1000, 2) for r in rates]} ms")
    before = [r for rec, r in zip(seen, rates, strict=True) if rec.updated_at < 1.8e9 + 110]
    assert before[-1] is not None and abs(before[-1].step_s - 0.005) < 0.0005
    assert rates[-1] is not None and abs(rates[-1].step_s - 0.020) < 0.002
    # The control: the same records with the counters rounded to 10 significant bits of
    # their total (as they were published before) hide a month-old engine's growth.
    control = StepTracker()
    for record in seen:
        load = record.load
        assert load.steps is not None and load.step_s is not None
        control.observe([msgspec.structs.replace(record, load=msgspec.structs.replace(
            load, steps=_top_bits(load.steps, 10), step_s=float(_top_bits(int(load.step_s),
                                                                           10))))])
    assert control.rate("w0") is None


def _top_bits(n: int, bits: int) -> int:
    shift = max(0, n.bit_length() - bits)
    return (n >> shift) << shift


NODES = 4
WORKERS = 16
STEP_S = 60.0  # compressed time: each step is a minute of the cluster's life
STEPS = 600  # ten hours, in which every worker record changes every minute
COMPACT_EVERY_S = 300.0


async def soak(endpoints: list[str], compact: bool, seed: int, steps: int) -> list[int]:
    """Run the soak; returns etcd's database size after each compaction interval."""
    keys = Keys("soak")
    rng = random.Random(seed)
    mono, wall = Clock(0.0), Clock(1.8e9)
    store = EtcdStore(endpoints, request_timeout_s=5.0)
    loads: dict[str, int] = {}

    def workers_of(node: str) -> list[WorkerRecord]:
        # Every record changes meaningfully at every step: the worst case for etcd.
        out = []
        for i in range(WORKERS):
            name = f"{node}-w{i}"
            loads[name] = rng.randint(0, 15)
            out.append(worker(name, node, loads[name], rng.random(), rng.randint(0, 1 << 30)))
        return out

    agents = [
        compressed(ClusterAgent(
            store, keys, identity(f"n{i}"),
            AgentTiming(lease_ttl_s=60, heartbeat_s=STEP_S, loop_s=1.0),
            functools.partial(workers_of, f"n{i}"), wall_clock=wall, monotonic=mono,
            compact_every_s=COMPACT_EVERY_S if compact else float("inf"),
            compact_keep_revisions=500, trim_every_s=COMPACT_EVERY_S), store)
        for i in range(NODES)
    ]
    sizes = []
    try:
        for step in range(steps):
            mono.now += STEP_S
            wall.now += STEP_S
            for agent in agents:
                if agent.lease.held and step % 10 == 0:
                    await agent.lease.renew()
            await asyncio.gather(*(a.cycle() for a in agents))
            if (step + 1) % int(COMPACT_EVERY_S / STEP_S) == 0:
                sizes.append((await store.status()).db_size_bytes)
        assert sum(a.is_coordinator for a in agents) == 1
        assert sum(a.step_downs for a in agents) == 0
        leader = next(a for a in agents if a.is_coordinator)
        assert leader.compact_failures == 0
        assert (leader.compacted_revision > 0) == compact
    finally:
        await store.close()
    return sizes


def test_a_soak_of_compressed_hours_keeps_etcds_database_bounded(tmp_path: Path) -> None:
    # etcd's own auto-compaction off: the coordinator's compaction is what is tested.
    compacted = EtcdCluster(tmp_path / "a", auto_compaction_retention=None).start()
    try:
        with_compaction = asyncio.run(soak(compacted.endpoints, compact=True, seed=1,
                                           steps=STEPS))
    finally:
        compacted.stop()
    plain = EtcdCluster(tmp_path / "b", auto_compaction_retention=None).start()
    try:
        # The control needs only half the time to show the growth.
        without = asyncio.run(soak(plain.endpoints, compact=False, seed=1, steps=STEPS // 2))
    finally:
        plain.stop()
    hourly = int(3600 / COMPACT_EVERY_S)
    print(f"etcd db size each compressed hour with compaction "
          f"{[round(s / MiB, 1) for s in with_compaction[hourly - 1::hourly]]} MiB; without "
          f"{[round(s / MiB, 1) for s in without[hourly - 1::hourly]]} MiB")
    # Bounded: the second half of the soak adds (almost) nothing to the database ...
    half = with_compaction[len(with_compaction) // 2]
    assert with_compaction[-1] <= half * 1.1 + MiB, with_compaction
    # ... while without compaction it keeps growing (the control shows the check bites).
    assert without[-1] >= without[len(without) // 2] * 1.5, without
    assert without[-1] >= 2 * with_compaction[-1], (with_compaction, without)

"""bench/validate_sim.py: its summary over seeds on a case with a known answer, --resimulate,
and the simulator against the real runs saved in bench/data."""

from __future__ import annotations

import argparse
import contextlib
import gzip
import io
import json
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from .. import benchmod

DATA = benchmod.BENCH_DIR / "data"


def load_bench() -> ModuleType:
    return benchmod.load_bench("validate_sim")


def test_the_summary_gives_mean_ratios_counts_and_the_paired_ttft_ratio() -> None:
    v = load_bench()

    def side(ttft: float, recovery: float | None) -> object:
        return v.Side(ttft_s=ttft, tpot_s=0.1, recovery_s=recovery, recovery_strict_s=60.0,
                      interrupted=10, failure_free_ttft_s=0.5, completed=300,
                      back_after_s=48.0)

    runs = [
        # sim / real TTFT 0.9 and 1.3: mean 1.1, one of two within 15%
        v.Validation(1, "lumen", side(1.0, 50.0), side(0.9, 50.0)),
        v.Validation(2, "lumen", side(1.0, 50.0), side(1.3, 50.0)),
        # the simulated side never recovered in seed 2: one ratio, said so
        v.Validation(1, "stop_and_restart", side(2.0, 50.0), side(2.0, 60.0)),
        v.Validation(2, "stop_and_restart", side(4.0, 50.0), side(2.6, None)),
    ]
    lines = v.summary(runs).splitlines()
    ttft = next(line for line in lines if line.startswith("lumen ") and "mean TTFT" in line)
    assert "1.100 ±" in ttft and "1/2" in ttft and "1:0.90 2:1.30" in ttft
    recovery = next(line for line in lines if line.startswith("stop_and_restart")
                    and "recovery time (50%)" in line)
    assert "1.200 ± 0.000" in recovery and "0/1" in recovery  # 1.2 is outside 15%
    assert "(1 without a ratio)" in recovery
    # lumen / stop_and_restart real TTFT: 1.0/2.0 and 1.0/4.0 -> mean 0.375
    real = next(line for line in lines if "stop_and_restart mean TTFT, real" in line)
    assert "(2 seeds paired): 0.375" in real
    sim = next(line for line in lines if "stop_and_restart mean TTFT, sim" in line)
    assert "(2 seeds paired): 0.475" in sim  # 0.9/2.0 = 0.45, 1.3/2.6 = 0.5


def test_the_phase_draws_summary_gives_the_draws_mean_and_whether_real_lies_in_range() -> None:
    v = load_bench()

    def side(ttft: float, recovery: float | None = 50.0) -> object:
        return v.Side(ttft_s=ttft, tpot_s=0.1, recovery_s=recovery, recovery_strict_s=60.0,
                      interrupted=10, failure_free_ttft_s=0.5, completed=300,
                      back_after_s=48.0)

    runs = [
        # draws 0.8 and 1.4 around real 1.0: mean 1.1, in range
        v.Validation(1, "lumen", side(1.0), side(2.0), (side(0.8), side(1.4))),
        # draws 1.2 and 1.4 above real 1.0: mean 1.3, out of range; one never recovered
        v.Validation(2, "lumen", side(1.0), side(1.0), (side(1.2), side(1.4, None))),
        v.Validation(3, "lumen", side(1.0), side(1.0)),  # no draws: left out
    ]
    lines = v.spread_summary(runs).splitlines()
    ttft = next(line for line in lines if line.startswith("lumen ") and "mean TTFT" in line)
    assert "1.200 ±" in ttft and " 1/2 " in ttft and " 1/2  " in ttft, ttft
    assert ttft.endswith("1:1.10 2:1.30"), ttft
    recovery = next(line for line in lines if "recovery time (50%)" in line)
    assert "(1 draws never recovered)" in recovery and " 1/1 " in recovery, recovery
    assert v.spread_of((side(0.8), side(1.4)), side(1.0), "mean TTFT") == (0.8, 1.4, True)
    assert v.spread_of((side(1.2), side(1.4)), side(1.0), "mean TTFT") == (1.2, 1.4, False)
    assert v.spread_summary([runs[2]]) == ""  # nothing drawn, nothing said


def test_the_phase_draws_are_seeded_and_move_the_simulated_side() -> None:
    """The phase draws of one saved real run (seed 7 under LUMEN, the engine hung): the same
    seed gives the same draws, and the draws differ from each other (the phases decide
    ties), so the spread says something."""
    v = load_bench()
    data = (DATA / "validation-2026-12-07-hang-stalled.json.gz").read_bytes()
    [record] = [r for r in json.loads(gzip.decompress(data))["runs"]
                if r["seed"] == 7 and r["policy"] == "lumen"]
    args = argparse.Namespace(**{"fault_kind": "kill", "hang_stall_s": None,
                                 **record["settings"]}, policy=record["policy"],
                              admission_heartbeat_s=1.0)
    given = record["given"]
    sent = [tuple(x) for x in record["sent"]]

    def draws(seed: int) -> list[float]:
        spread = v.phase_spread(sent, record["fault"], given["victim"],
                                given["process_start_s"], given["overhead_s"], args, 4, seed)
        return [side.ttft_s for side in spread]

    first = draws(7)
    assert first == draws(7)
    assert len(set(first)) > 1, first
    assert draws(8) != first
    # Exact counts (no heartbeats): nothing to draw.
    assert v.phase_spread(sent, record["fault"], given["victim"], given["process_start_s"],
                          given["overhead_s"],
                          argparse.Namespace(**{**vars(args), "admission_heartbeat_s": 0.0}),
                          4, 7) == ()


def test_resimulate_runs_the_saved_requests_again_and_refuses_an_older_file(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    v = load_bench()
    # Two workers, 40 requests over 20 s, the victim's engine killed at 10 s.
    sent = [[0.5 * i, 800, 40] for i in range(40)]
    real = v.Side(ttft_s=1.0, tpot_s=0.1, recovery_s=5.0, recovery_strict_s=8.0,
                  interrupted=4, failure_free_ttft_s=0.5, completed=40, back_after_s=49.0)
    record = {"seed": 3, "policy": "stop_and_restart", "fault": 10.0,
              "settings": {"model": "sim-medium", "nodes": 2, "time_scale": 8.0,
                           "restore_mbps": 500.0, "warmup": 2.0},
              "given": {"process_start_s": 1.0, "overhead_s": 0.01, "victim": 1},
              "sent": sent,
              "metrics": {"real": v.asdict(real)}}
    saved = tmp_path / "runs.json"
    saved.write_text(json.dumps({"runs": [record]}))
    v.resimulate(saved)
    out = capsys.readouterr().out
    assert "seed 3, policy stop_and_restart" in out
    completed = next(line for line in out.splitlines() if "requests completed" in line)
    assert completed.split()[2:4] == ["40", "40"]  # real as saved, every request simulated
    # A victim that is not one of the workers: the record is refused, naming the seed.
    record["given"] = {"process_start_s": 1.0, "overhead_s": 0.01, "victim": 2}
    saved.write_text(json.dumps({"runs": [record]}))
    with pytest.raises(SystemExit, match=r"seed 3: a malformed record \(ValueError: fault "
                       r"worker 2 is not one of the 2 workers"):
        v.resimulate(saved)
    # A serving split that is not one this bench wrote: refused the same way.
    record["given"] = {"process_start_s": 1.0, "overhead_s": 0.01, "victim": 1}
    record["splits"] = [{"since": 0.0, "gateway": 1}]
    saved.write_text(json.dumps({"runs": [record]}))
    with pytest.raises(SystemExit, match=r"seed 3: a malformed record \(TypeError"):
        v.resimulate(saved)
    del record["given"]
    saved.write_text(json.dumps({"runs": [record]}))
    with pytest.raises(SystemExit, match=r"no given .*run it again with --save"):
        v.resimulate(saved)
    saved.write_text("not json")
    with pytest.raises(SystemExit, match="not a file --save wrote"):
        v.resimulate(saved)


def test_the_simulator_still_agrees_with_the_saved_real_runs() -> None:
    # Sixteen real runs of the local cluster (bench/data, 2026-12-06: seeds 7 11 13 17 19,
    # then 23 29 31 held out while the simulator was being fixed; lumen and
    # stop-and-restart; the real side is frozen, the simulator deterministic): a change to
    # the simulator that takes it away from what the cluster did fails here. Interrupted
    # streams are a count of ~10, within 15% or two streams; recovery is judged on the mean
    # over runs: one run's is a threshold crossing that one burst of arrivals decides
    # (docs/simulator.md, Validation). Mean TTFT is held to 10%, tighter than the issue's
    # 15%: every run is within 8% now, and with the victim placed first (the fault on the
    # worker the admission ties favour, not the real victim) seed 17 is 11% off: the
    # negative control below.
    # These runs predate the engines' TTFT: the simulator is given their idle probe, and
    # they are held to what it reproduced then, on exact admission counts.
    v = load_bench()
    saved = DATA / "validation-2026-12-06.json.gz"
    with contextlib.redirect_stdout(io.StringIO()):
        runs = v.resimulate(saved, heartbeat_s=0.0)
    recovery = agrees_run_by_run(v, runs, interrupted_slack=2)
    assert abs(sum(recovery) / len(recovery) - 1) <= v.AGREEMENT


def agrees_run_by_run(v: ModuleType, runs: list[Any], interrupted_slack: int,
                      count: int = 16) -> list[float]:
    """Every one of the `count` runs: mean TTFT within 10%, TPOT within 15%, interrupted
    streams within 15% or `interrupted_slack`; returns the recovery ratios at 50% (every
    run has one)."""
    assert len(runs) == count
    for run in runs:
        where = (run.seed, run.policy)
        assert abs(run.sim.ttft_s / run.real.ttft_s - 1) <= 0.10, where
        assert abs(run.sim.tpot_s / run.real.tpot_s - 1) <= v.AGREEMENT, where
        assert abs(run.sim.interrupted - run.real.interrupted) <= max(
            interrupted_slack, v.AGREEMENT * run.real.interrupted), where
    recovery = [float(run.sim.recovery_s / run.real.recovery_s) for run in runs
                if run.sim.recovery_s is not None and run.real.recovery_s]
    assert len(recovery) == len(runs)
    return recovery


def test_the_victim_placed_first_takes_the_simulator_away_from_the_real_runs(
        tmp_path: Path) -> None:
    v = load_bench()
    saved = DATA / "validation-2026-12-06.json.gz"
    data = json.loads(gzip.decompress(saved.read_bytes()))
    for record in data["runs"]:
        record["given"]["victim"] = 0
    moved = tmp_path / "victim-first.json"
    moved.write_text(json.dumps(data))
    with contextlib.redirect_stdout(io.StringIO()):
        runs = v.resimulate(moved, heartbeat_s=0.0)
    worst = max(runs, key=lambda run: abs(run.sim.ttft_s / run.real.ttft_s - 1))
    assert (worst.seed, worst.policy) == (17, "stop_and_restart")
    assert abs(worst.sim.ttft_s / worst.real.ttft_s - 1) > 0.10


def test_the_simulator_agrees_with_the_runs_that_measured_the_serving_path() -> None:
    # Sixteen more real runs (bench/data, 2026-12-06, second batch: seeds 7-31, both
    # policies), with the engines' TTFT scraped before the fault: the simulator is given the
    # serving path measured under load and reads the queues as the coordinator does
    # (heartbeats), the defaults. Bounds as above, except that the interrupted streams (a
    # count of 6-15) are held to 15% or three (stop-and-restart's seed 7: 15 real, 12
    # simulated) and recovery at 50% to 14 of 16 runs besides the mean. Negative control:
    # exact admission counts with the same overhead leave the failure-free TTFT 4-6% low on
    # average (real 470-527 ms where simulated 438-450 in seed 7), outside the 3% the
    # default holds.
    v = load_bench()
    saved = DATA / "validation-2026-12-06-split.json.gz"
    with contextlib.redirect_stdout(io.StringIO()):
        runs = v.resimulate(saved)
        exact = v.resimulate(saved, heartbeat_s=0.0)
    recovery = agrees_run_by_run(v, runs, interrupted_slack=3)
    assert abs(sum(recovery) / len(recovery) - 1) <= v.AGREEMENT
    assert sum(abs(r - 1) <= v.AGREEMENT for r in recovery) >= 14

    def failure_free(runs: list[Any]) -> float:
        ratios = [float(r.sim.failure_free_ttft_s / r.real.failure_free_ttft_s) for r in runs]
        return sum(ratios) / len(ratios)

    assert abs(failure_free(runs) - 1) <= 0.03
    assert failure_free(exact) < 0.97


def test_the_simulator_agrees_with_the_runs_where_the_engine_hung(tmp_path: Path) -> None:
    # Ten real runs (bench/data, 2026-12-07: seeds 7 11 13 17 19, both policies) where the
    # victim's engine was SIGSTOPped, not killed: alive, answering nothing, still admitted
    # to, until its supervisor's probes killed it (6.20-6.26 s after; the simulator is given
    # its modelled 6.25 s, not the measured moment). The product did not stall a hung
    # worker then: the runs carry no hang_stall_s and are simulated so. Mean TTFT within 10%
    # and TPOT 15% in every run, the streams cut off within 15% or two, the worker back
    # within 1%, recovery
    # at 50% within 15% on the mean. Negative control: the same runs simulated as a crash
    # at the SIGSTOP's moment: the backlog starts 6 s early and every run's mean TTFT comes
    # out more than 10% low.
    v = load_bench()
    saved = DATA / "validation-2026-12-07-hang.json.gz"
    with contextlib.redirect_stdout(io.StringIO()):
        runs = v.resimulate(saved)
    recovery = agrees_run_by_run(v, runs, interrupted_slack=2, count=10)
    for run in runs:
        assert abs(run.sim.back_after_s / run.real.back_after_s - 1) <= 0.01, (run.seed,
                                                                                run.policy)
    assert abs(sum(recovery) / len(recovery) - 1) <= v.AGREEMENT

    data = json.loads(gzip.decompress(saved.read_bytes()))
    for record in data["runs"]:
        assert record["settings"]["fault_kind"] == "hang"
        record["settings"]["fault_kind"] = "kill"
    as_kill = tmp_path / "as-kill.json"
    as_kill.write_text(json.dumps(data))
    with contextlib.redirect_stdout(io.StringIO()):
        crashed = v.resimulate(as_kill)
    assert all(run.sim.ttft_s / run.real.ttft_s < 0.90 for run in crashed)


def test_the_simulator_agrees_with_the_runs_where_the_hung_worker_was_stalled(
        tmp_path: Path) -> None:
    # The same ten seeds and policies again (2026-12-07, later) with the product that takes a
    # hung worker as stalled from its first missed probe and admits elsewhere from then on
    # (saved with hang_stall_s 3). Every run's mean TTFT within 15% (seeds 7 and 17 under
    # LUMEN come out 12-13% high: the simulator admits more of the first seconds' arrivals
    # to the hung worker than the coordinator did), TPOT within 15%, the streams cut off
    # within 15% or three (seed 7 LUMEN: 15 real, 12 simulated), the worker back within 1%.
    # Negative control: the same runs simulated without the stall (admitted to until the
    # kill, as the product did before): mean TTFT further off on the mean and in at least
    # two runs beyond 15% (three before the requests a hung engine never read went to the
    # survivor ahead of its broken streams, which brought those runs closer too).
    v = load_bench()
    saved = DATA / "validation-2026-12-07-hang-stalled.json.gz"
    with contextlib.redirect_stdout(io.StringIO()):
        runs = v.resimulate(saved)
    assert len(runs) == 10
    for run in runs:
        where = (run.seed, run.policy)
        assert abs(run.sim.ttft_s / run.real.ttft_s - 1) <= v.AGREEMENT, where
        assert abs(run.sim.tpot_s / run.real.tpot_s - 1) <= v.AGREEMENT, where
        assert abs(run.sim.interrupted - run.real.interrupted) <= max(
            3, v.AGREEMENT * run.real.interrupted), where
        assert abs(run.sim.back_after_s / run.real.back_after_s - 1) <= 0.01, where
    stalled = [run.sim.ttft_s / run.real.ttft_s for run in runs]

    data = json.loads(gzip.decompress(saved.read_bytes()))
    for record in data["runs"]:
        assert record["settings"]["hang_stall_s"] == 3.0
        del record["settings"]["hang_stall_s"]
    unstalled = tmp_path / "not-stalled.json"
    unstalled.write_text(json.dumps(data))
    with contextlib.redirect_stdout(io.StringIO()):
        before = [run.sim.ttft_s / run.real.ttft_s for run in v.resimulate(unstalled)]
    assert abs(sum(before) / 10 - 1) > abs(sum(stalled) / 10 - 1) + 0.02, (before, stalled)
    assert sum(abs(r - 1) > v.AGREEMENT for r in before) >= 2, before


def test_the_simulator_is_given_the_serving_path_under_load_where_a_run_measured_it() -> None:
    """Client - engine mean TTFT over the first tokens before the fault (the engines'
    queueing is the simulator's to model, not given); the idle probe for runs saved
    before the engines exported their TTFT, when asked for, or when no engine counted."""
    v = load_bench()
    # Three requests with first tokens by 40 s: client TTFTs 0.30, 0.40, 0.50 s (mean 0.40);
    # one after: not in the window.
    real = [v.Served(t, t + ttft, t + 5, 50, False)
            for t, ttft in ((1.0, 0.3), (10.0, 0.4), (20.0, 0.5), (45.0, 2.0))]
    split = v.ServingSplit(0.0, 40.0, 0.39, 0.38, (3, 3), {"w0": (2, 0.4), "w1": (1, 0.34)})
    given = {"overhead_s": 0.030}
    overhead, source = v.given_overhead_s(given, [split], real, "loaded")
    assert overhead == pytest.approx(0.02) and source == "under load"
    assert v.given_overhead_s(given, [split], real, "idle") == (0.030, "idle probe")
    assert v.given_overhead_s(given, [], real, "loaded") == (0.030, "idle probe")
    uncounted = v.ServingSplit(0.0, 40.0, 0.39, float("nan"), (3, 0))
    assert v.given_overhead_s(given, [uncounted], real, "loaded") == (0.030, "idle probe")
    # A record written by this bench keeps the idle probe beside what it used.
    assert v.given_overhead_s({"overhead_s": 0.02, "idle_overhead_s": 0.03}, [], real,
                              "idle") == (0.03, "idle probe")
    line = v.split_line(split, real, [v.Served(t, t + 0.45, t + 5, 50, False, i % 2)
                                      for i, t in enumerate((1.0, 10.0, 20.0))], 0.02)
    assert "client - engine 20.0 ms" in line
    assert "at the engines real - simulated -50.0 ms" in line  # 0.38 - (0.45 - 0.02)
    assert "w0 2 / 2 requests, 400 / 430 ms" in line


def test_a_stopped_engine_is_not_gone_until_it_is_killed() -> None:
    """The hang's kill is timed by `process_running` (lumenctl.localcluster): a SIGSTOPped
    process runs; killed, it is gone even before its parent reaps it (a zombie), and after."""
    import signal
    import subprocess
    import sys

    from lumenctl.localcluster import process_running

    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        child.send_signal(signal.SIGSTOP)
        assert process_running(child.pid)
        child.kill()
        deadline = time.monotonic() + 10
        while process_running(child.pid):  # a zombie until waited for
            assert time.monotonic() < deadline, "a killed process never showed as gone"
            time.sleep(0.01)
    finally:
        child.kill()
        child.wait()
    assert not process_running(child.pid) and not process_running(None)


def test_admissions_are_compared_per_request_by_window_and_after_the_fault() -> None:
    v = load_bench()

    def served(sent: float, admitted: int) -> Any:
        return v.Served(sent=sent, first=sent + 0.2, last=sent + 1.0, tokens=5,
                        interrupted=False, admitted=admitted)

    # Warm-up 10 s, fault at 30 s: before it the two sides agree but for the request at 25 s;
    # after it real sends 3 of 4 to worker 0, the simulator all 4 to worker 1.
    real = [served(5.0, 0), served(15.0, 1), served(25.0, 0),
            served(30.5, 0), served(31.0, 0), served(32.0, 0), served(33.0, 1)]
    sim = [served(5.0, 0), served(15.0, 1), served(25.0, 1),
           served(30.5, 1), served(31.0, 1), served(32.0, 1), served(33.0, 1),
           served(50.0, 0)]  # no real counterpart (failed there): left out
    text = v.admissions_compared(real, sim, fault=30.0, warmup=10.0)
    assert "(7 requests; workers by name order)" in text
    assert "warm-up: 1/1 to the same worker; per worker w0 1/1" in text
    assert "before the fault: 1/2 to the same worker; per worker w0 1/0, w1 1/2" in text
    assert "10 s after it: 1/4 to the same worker; per worker w0 3/0, w1 1/4" in text
    assert "first parted: the request sent at 25.00 s" in text
    assert "+0.50:0/1! +1.00:0/1! +2.00:0/1! +3.00:1/1" in text
    # Negative control: runs saved before the gateways logged admissions say so.
    unknown = [served(s.sent, -1) for s in real]
    assert "none recorded on the real side" in v.admissions_compared(unknown, sim, 30.0, 10.0)


def misses(runs: list[Any], v: ModuleType, drawn: bool) -> int:
    """Summarised metrics outside AGREEMENT over `runs`: the one default phase's simulated
    side, or (`drawn`) the mean over the phase draws."""
    count = 0
    for run in runs:
        for metric in v.SUMMARISED:
            real, sim = next((r, s) for name, r, s, _ in v.rows(run.real, run.sim)
                             if name == metric)
            if drawn:
                sim, _ = v.drawn_mean(run.spread, run.real, metric)
            if real and sim is not None and abs(sim / real - 1) > v.AGREEMENT:
                count += 1
    return count


def test_the_runs_that_started_quiet_agree_and_say_where_each_request_went() -> None:
    # Four runs (2026-12-07; the engine hung; seeds 17 and 7 under both policies) with the
    # gateways' admission log and the trace started once the coordinator saw an idle
    # cluster. Every summarised metric within 15% with the mean of 16 phase draws, and
    # all but one with the default phases (seed 17's stop-and-restart recovery at 50%,
    # 0.74: a threshold crossing; the draws' mean 0.93); every real request's first
    # admission known; seed 17's two
    # sides first part at 9.86 s (they parted at its first request, 0.30 s, when the trace
    # started while the coordinator still counted the last probe).
    v = load_bench()
    saved = DATA / "validation-2026-12-07-quiet.json.gz"
    with contextlib.redirect_stdout(io.StringIO()):
        runs = v.resimulate(saved, phase_draws=16)
    assert len(runs) == 4 and all(len(run.spread) == 16 for run in runs)
    assert misses(runs, v, drawn=True) == 0
    assert misses(runs, v, drawn=False) <= 1
    for record in json.loads(gzip.decompress(saved.read_bytes()))["runs"]:
        real = [v.Served(**x) for x in record["real"]]
        assert all(x.admitted >= 0 for x in real)
        simulated = {round(x["sent"], 6): v.Served(**x) for x in record["simulated"]}
        parted = min(x.sent for x in real if simulated[round(x.sent, 6)].admitted != x.admitted)
        if record["seed"] == 17:
            assert 9.8 < parted < 9.9, parted


def test_the_mean_over_phase_draws_agrees_with_more_saved_runs_than_one_phase() -> None:
    # The 52 runs saved before the quiet start (four files): 23 summarised metrics outside
    # 15% with the default phases, 10 with the mean of 16 draws of them.
    v = load_bench()
    default = drawn = 0
    for name in ("validation-2026-12-06.json.gz", "validation-2026-12-06-split.json.gz",
                 "validation-2026-12-07-hang.json.gz",
                 "validation-2026-12-07-hang-stalled.json.gz"):
        with contextlib.redirect_stdout(io.StringIO()):
            runs = v.resimulate(DATA / name, phase_draws=16)
        default += misses(runs, v, drawn=False)
        drawn += misses(runs, v, drawn=True)
    assert drawn < default, (drawn, default)
    assert drawn <= 12, drawn

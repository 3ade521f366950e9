"""Item 6's metrics: every one reported for every policy; assist acceptance measured from
the draft rounds the run verified."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from dataclasses import replace
from functools import cache

import pytest

from lumend.sim.assist import DraftFunction, binomial
from lumend.sim.config import (
    EXTENDED_POLICIES,
    PAPER_POLICY,
    FaultKind,
    FaultSpec,
    SimConfig,
    apply_policy,
)
from lumend.sim.metrics import PolicyMetrics
from lumend.sim.runner import run_policy
from lumend.sim.workload import Workload, synthetic

MODEL, GPU = "sim-small", "h100-tp4"
TINY = ["--synthetic", "--workers", "4", "--model", "sim-small", "--gpu", "h100-tp4",
        "--rate", "30", "--duration", "60", "--fail-at", "20", "--seed", "1"]
EXTENDED = ",".join(EXTENDED_POLICIES)
PAPER = PAPER_POLICY
METRICS = ("mean_ttft_s", "p99_ttft_s", "mean_tpot_s", "p99_tpot_s", "recovery_time_s",
           "replay_ttft_mean_s", "replay_ttft_p99_s", "checkpoint_coverage", "holder_balance",
           "assist_acceptance")


@cache
def workload() -> Workload:
    return synthetic(rate=4 * 35.0, duration_s=100.0, seed=3)


def measure(policy_name: str, **kw: object) -> PolicyMetrics:
    base = SimConfig(workers=4, model=MODEL, gpu=GPU,
                     fault=FaultSpec(kind=FaultKind.worker, at_s=40.0))
    cfg = apply_policy(replace(base, **kw), policy_name)  # type: ignore[arg-type]
    return run_policy(workload(), cfg, policy_name).metrics


@cache
def lumen() -> PolicyMetrics:
    # The paper's assist (always on while the drafter is up): what the acceptance tests
    # measure. The cost-aware `lumen` assists only while the predicted gain is positive.
    return measure(PAPER)


def expected_acceptance(agreement: float, k: int) -> float:
    """Accepted / drafted when each drafted token agrees with probability `agreement` given
    the ones before it did: sum of agreement^i for i = 1..k, over k."""
    return sum(agreement ** i for i in range(1, k + 1)) / k


def lumenctl(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "lumenctl", *args], capture_output=True,
                          text=True, timeout=120, check=False)


# -- every metric, every policy, both outputs -------------------------------------------------


def test_every_metric_is_in_the_json_of_every_policy() -> None:
    done = lumenctl("sim", *TINY, "--policy", EXTENDED + ",lumen-assist,lumen-routing", "-o",
                    "json")
    assert done.returncode == 0, done.stderr
    policies = {p["policy"]: p for p in json.loads(done.stdout)["policies"]}
    assert len(policies) == 10
    for name, p in policies.items():
        missing = [k for k in METRICS if k not in p]
        assert not missing, f"{name} lacks {missing}"
        for key in ("mean_ttft_s", "p99_ttft_s", "mean_tpot_s", "p99_tpot_s",
                    "replay_ttft_mean_s"):
            assert p[key] > 0, (name, key)
        assert p["p99_ttft_s"] >= p["mean_ttft_s"] and p["p99_tpot_s"] >= p["mean_tpot_s"]
    for name in ("stop_and_restart", "shadow_only"):  # no checkpoints
        assert policies[name]["checkpoint_coverage"] == 0
        assert policies[name]["holder_balance"] is None
    for name in ("fixed_checkpoint", "lumen", "lumen_paper", "lumen_dual", "lumen-routing"):
        assert 0 < policies[name]["checkpoint_coverage"] <= 1
        assert policies[name]["holder_balance"] >= 1
    with_assist = {n for n, p in policies.items() if p["assist_acceptance"] is not None}
    # The paper's assist always runs; cost-aware ones only where their gain is positive.
    assert "lumen_paper" in with_assist
    assert with_assist <= {"lumen_paper", "lumen", "lumen_dual", "lumen-assist"}
    # A shadow serves again 0.5 s after the crash: the drafter never loads.
    assert policies["lumen_shadow"]["draft_rounds"] == 0


def test_the_table_shows_every_metric() -> None:
    done = lumenctl("sim", *TINY, "--policy", "stop_and_restart,lumen_paper")
    assert done.returncode == 0, done.stderr
    for header in ("TTFT P99", "TPOT P99", "RECOVERY", "REPLAY TTFT", "CKPT COVERAGE",
                   "HOLDER BALANCE", "ASSIST ACCEPT"):
        assert header in done.stdout
    rows = {line.split()[1]: line for line in done.stdout.splitlines()
            if line.startswith("│ ")}
    assert rows["stop_and_restart"].rstrip(" │").endswith("-")  # no assist
    assert rows["lumen_paper"].rstrip(" │").endswith("%")


# -- assist acceptance --------------------------------------------------------------------


def test_assist_acceptance_is_null_without_assist() -> None:
    for name in ("stop_and_restart", "fixed_checkpoint", "lumen-placement+routing"):
        m = measure(name)
        assert m.assist_acceptance is None and m.draft_rounds == 0, name


def test_assist_acceptance_is_measured_from_the_draft_rounds() -> None:
    m = lumen()
    assert m.draft_rounds > 10_000
    assert m.assist_acceptance is not None and 0 < m.assist_acceptance <= 1
    # Not the per-token agreement (0.6) echoed: the share of the k = 4 drafted tokens kept.
    assert m.assist_acceptance == pytest.approx(expected_acceptance(0.6, 4), abs=0.01)


def test_assist_acceptance_follows_the_draft_functions_agreement() -> None:
    # Negative control: a constant echoed into the metric would not move.
    default = lumen().assist_acceptance
    worse = measure(PAPER, spec_acceptance=0.3).assist_acceptance
    better = measure(PAPER, spec_acceptance=0.9).assist_acceptance
    assert worse is not None and better is not None and default is not None
    assert worse < default < better
    assert worse == pytest.approx(expected_acceptance(0.3, 4), abs=0.01)
    assert better == pytest.approx(expected_acceptance(0.9, 4), abs=0.01)
    shorter = measure(PAPER, spec_tokens=2)
    assert shorter.assist_acceptance == pytest.approx(expected_acceptance(0.6, 2), abs=0.01)


def test_assist_acceptance_is_zero_when_the_draft_never_agrees() -> None:
    m = measure(PAPER, spec_acceptance=0.0)
    assert m.draft_rounds > 0 and m.assist_acceptance == 0.0


def test_same_seed_same_metrics_other_seed_other_draft_samples() -> None:
    again = measure(PAPER)
    assert again == lumen()
    other = measure(PAPER, seed=1)  # same workload and fault: only the draft rounds' samples
    assert other.draft_rounds == again.draft_rounds
    assert other.assist_acceptance != again.assist_acceptance
    assert other.assist_acceptance == pytest.approx(again.assist_acceptance, abs=0.01)


# -- the sampling ---------------------------------------------------------------------------


@pytest.mark.parametrize(("n", "p"), [(100, 0.03), (2000, 0.4), (300, 0.9), (5, 0.5)])
def test_binomial_draws_have_the_binomial_mean_and_variance(n: int, p: float) -> None:
    rng = random.Random(7)
    draws = [binomial(rng, n, p) for _ in range(20_000)]
    mean = sum(draws) / len(draws)
    var = sum((d - mean) ** 2 for d in draws) / (len(draws) - 1)
    assert all(0 <= d <= n for d in draws)
    assert mean == pytest.approx(n * p, rel=0.02)
    assert var == pytest.approx(n * p * (1 - p), rel=0.06)


def test_thinned_rounds_match_rounds_drafted_one_token_at_a_time() -> None:
    draft = DraftFunction(agreement=0.7, k=4)
    rng = random.Random(11)
    rounds = 200_000
    one_by_one = 0
    for _ in range(rounds):
        for _ in range(draft.k):
            if rng.random() >= draft.agreement:
                break
            one_by_one += 1
    batched = sum(draft.accepted(rng, 200) for _ in range(rounds // 200))
    assert batched == pytest.approx(one_by_one, rel=0.01)
    # The engine advances an assisted batch at this rate: one own token plus the accepted.
    assert draft.tokens_per_round() == pytest.approx(1 + one_by_one / rounds, rel=0.01)


def test_help_names_the_metrics() -> None:
    done = lumenctl("sim", "--help")
    assert done.returncode == 0, done.stderr
    text = " ".join(done.stdout.split())
    for words in ("p99 TTFT and TPOT", "recovery time", "replay TTFT", "checkpoint coverage",
                  "holder balance", "assist acceptance"):
        assert words in text

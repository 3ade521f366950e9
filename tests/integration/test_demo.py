"""`lumenctl demo --short`: the policy comparison of the demo on a real 4-node local cluster,
with a short trace. Its output names each recovery decision and the draft-assist, and
closes with the table."""

from __future__ import annotations

import re
import subprocess
import sys

DECISION = re.compile(r"decision \((\S+)'s gateway\): (resume|recompute) on (\S+) after")


def sections(output: str) -> dict[str, str]:
    """The output of each policy's run, by policy."""
    found: dict[str, str] = {}
    parts = re.split(r"─+ policy (\S+): the same trace, the same fault ─+\n", output)
    for mode, text in zip(parts[1::2], parts[2::2], strict=True):
        found[mode] = text.split("the policies side by side")[0]
    return found


def test_demo_compares_the_policies_on_the_same_fault() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "lumenctl", "--config", "/nonexistent.toml", "demo", "--short",
         "--trace", "12", "--fault-at", "6"],
        capture_output=True, text=True, timeout=420, stdin=subprocess.DEVNULL)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-4000:]

    runs = sections(output)
    assert list(runs) == ["stop_and_restart", "fixed_checkpoint", "lumen"], output[-4000:]
    # (kind, worker) of each recovery decision the live view printed
    decisions = {mode: [(m.group(2), m.group(3)) for m in DECISION.finditer(text)]
                 for mode, text in runs.items()}
    for mode, text in runs.items():
        assert "fault: SIGKILL node-4-w0's active engine" in text, mode
        assert "held: node-1-w0" in text, f"{mode}: no checkpoint placement shown"
        assert re.search(r"TTFT \d+ ms, TPOT \d+\.\d ms", text), f"{mode}: no latency shown"
        assert decisions[mode], f"{mode}: the fault interrupted no stream: the run is void"
        assert all(worker != "node-4-w0" for _, worker in decisions[mode]), mode
    # stop_and_restart has no checkpoints: every interrupted request is recomputed;
    # fixed_checkpoint resumes them all on the one neighbour that holds its checkpoints.
    assert {kind for kind, _ in decisions["stop_and_restart"]} == {"recompute"}
    assert {kind for kind, _ in decisions["fixed_checkpoint"]} == {"resume"}
    assert len({worker for _, worker in decisions["fixed_checkpoint"]}) == 1
    assert "resume" in {kind for kind, _ in decisions["lumen"]}
    # The victim has no shadow and a drafter: while it reloads it drafts for the most loaded
    # survivor, under lumen only (Algorithm 3).
    assert "assist: node-4-w0 loads its model and drafts for node-" in runs["lumen"]
    assert "assist:" not in runs["stop_and_restart"]

    table = output.split("the policies side by side")[1]
    for mode in ("stop_and_restart", "fixed_checkpoint", "lumen"):
        row = next((line for line in table.splitlines()
                    if re.match(rf"\W*{mode} ", line)), None)
        assert row is not None, f"no row for {mode} in the table:\n{table}"
        # failed / differ: every stream completed, token for token the failure-free one.
        assert re.search(r"\b0 / 0\W*$", row), row
    assert "paper: LUMEN" in table and "(-44%)" in table

"""The demo's closing comparison (lumenctl/demo_sim.py, shown by `lumenctl demo`):
simulated over seeds, said so, with a plain sentence per restore bandwidth and the paper's
ratios beside."""

from __future__ import annotations

import io

from rich.console import Console

from lumenctl.demo_sim import SimScenario, simulated_comparison, simulated_table, simulated_verdicts

SMALL = SimScenario(model="sim-small", gpu="h100-tp4", load=0.6, prompt_scale=2.0,
                    restore_gbps=(25.0, 1.0), duration_s=60.0, fault_at_s=20.0)


def test_the_simulated_comparison_is_labelled_paired_and_read_out() -> None:
    cells = simulated_comparison(2, SMALL)
    assert [bw for bw, _ in cells] == [25.0, 1.0]
    for _, doc in cells:
        assert set(doc["policies"]) == {"stop_and_restart", "fixed_checkpoint", "shadow_only",
                                        "lumen", "lumen_shadow"}
        for pair in ("lumen_vs_stop_and_restart", "lumen_shadow_vs_fixed_checkpoint",
                     "lumen_shadow_vs_shadow_only"):
            ratio = doc["ratios"][pair]["ttft_ratio"]
            assert ratio["pairs"] == 2 and ratio["mean"] > 0
        assert "lumen_vs_shadow_only" not in doc["ratios"]
    out = io.StringIO()
    Console(file=out, width=250).print(simulated_table(cells, 2, SMALL))
    text = out.getvalue()
    assert "SIMULATED" in text and "not the local cluster" in text and "2 seeds" in text
    assert "0.56x" in text and "0.93x" in text  # the paper's LUMEN / S&R and / fixed TTFT
    lines = simulated_verdicts(cells)
    assert len(lines) == 4
    assert lines[0].startswith("restores at 25 GB/s: LUMEN as deployed ")
    assert lines[1].startswith("restores at 25 GB/s: LUMEN's checkpoints alone ")
    for line in lines:
        assert "against stop-and-restart" in line and "against fixed checkpointing" in line
        assert any(word in line for word in ("wins", "ties", "LOSES"))
        assert "paper -44%" in line
    assert "against shadow engines alone" in lines[0]
    assert "against shadow engines alone" not in lines[1]

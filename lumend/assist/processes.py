"""How a recovering worker's draft server is started, per engine kind.

The supervisor starts the command while the worker has no engine serving or standing by,
and reads the drafter's endpoint from `endpoint_file` once it serves (the drafter binds a
free port of `host` and writes `tcp://host:port` there).
"""

from __future__ import annotations

import sys
from pathlib import Path

from lumend.config import WorkerConfig
from lumend.engine.sim_models import SIM_DRAFTS


def draft_command(worker: WorkerConfig, host: str, endpoint_file: Path, *,
                  time_scale: float = 1.0, seed: int = 0) -> list[str] | None:
    """The draft server's command line, or None when this worker has no drafter."""
    if worker.draft_model is None:
        return None
    if worker.engine == "sim":
        draft = SIM_DRAFTS[worker.draft_model]  # checked with the config
        return [sys.executable, "-m", "lumend.assist.sim_drafter", "--listen", f"{host}:0",
                "--endpoint-file", str(endpoint_file), "--model", worker.model,
                "--seed", str(seed), "--agreement", str(draft.agreement),
                "--seconds-per-token", str(draft.seconds_per_token),
                "--load-s", str(draft.load_s), "--time-scale", str(time_scale)]
    # vLLM workers: the draft model through transformers (lumend.assist.hf_draft).
    return [sys.executable, "-m", "lumend.assist.hf_draft", "--model", worker.draft_model,
            "--listen", f"{host}:0", "--endpoint-file", str(endpoint_file)]

"""Draft-assist on a survivor's vLLM engine (LUMEN's Algorithm 3): drafts come from a
recovering worker's draft server, vLLM verifies them.

`LumenRemoteProposer` is a speculative-decoding proposer (`speculative_config` method
`custom_class`), loaded by vLLM in each worker process of a worker with `assist = true`
(opt-in: with it vLLM runs every step as speculative decoding, without async scheduling
and on its older model runner, even while nothing is attached; bench/spec_cost.py).
On every step it sends the draft server, per running request, only the newly committed
tokens, and returns the drafts that arrive within a deadline well below the step time.
Detached (the default), late, or above the batch-size threshold, it proposes nothing: vLLM
then decodes as without speculation.
vLLM's rejection sampler keeps the output exactly what the target model produces (greedy:
the longest matching prefix plus one token). Only tensor-parallel rank 0 talks to the
drafter; vLLM takes the drafts from that rank.

Attaching is a small JSON file (`LUMEN_ASSIST_FILE`, written by the gate's `/lumen/assist`
in the API server): the proposer stats it on every step and follows it. A file, not
vLLM's `collective_rpc`, because a utility call to an idle engine was measured here taking
up to 20 s, far beyond what lumend's node link waits. The proposer writes its counters next
to it (`<file>.stats`), at most five times a second.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger("vllm.lumen_assist")  # under vllm.: vLLM's log configuration applies

ASSIST_FILE_ENV = "LUMEN_ASSIST_FILE"
DEFAULT_K = 3
DEFAULT_DEADLINE_S = 0.02
DEFAULT_MAX_BATCH = 8  # above this, verifying k extra tokens per request costs more than it saves
STATS_EVERY_S = 0.2


@dataclass(frozen=True)
class Attachment:
    endpoint: str
    k: int = DEFAULT_K
    deadline_s: float = DEFAULT_DEADLINE_S
    max_batch: int = DEFAULT_MAX_BATCH
    model: str = ""
    assignment: str = ""

    @classmethod
    def parse(cls, doc: Any) -> Attachment | None:
        """None for a detach ({"endpoint": null}); ValueError names a bad field."""
        if not isinstance(doc, dict):
            raise ValueError("the assist document must be an object")
        endpoint = doc.get("endpoint")
        if endpoint is None:
            return None
        if not isinstance(endpoint, str) or not endpoint.startswith("tcp://"):
            raise ValueError("endpoint must be tcp://host:port")
        k, deadline_ms = int(doc.get("k", DEFAULT_K)), float(doc.get("deadline_ms", 20.0))
        max_batch = int(doc.get("max_batch", DEFAULT_MAX_BATCH))
        if not 1 <= k <= 16:
            raise ValueError(f"k must be within 1..16, got {k}")
        if not 0 < deadline_ms <= 10_000:
            raise ValueError(f"deadline_ms must be within (0, 10000], got {deadline_ms}")
        if max_batch < 1:
            raise ValueError(f"max_batch must be at least 1, got {max_batch}")
        return cls(endpoint, k, deadline_ms / 1000, max_batch, str(doc.get("model", "")),
                   str(doc.get("assignment", endpoint)))

    def document(self) -> dict[str, Any]:
        return {"endpoint": self.endpoint, "k": self.k, "deadline_ms": self.deadline_s * 1000,
                "max_batch": self.max_batch, "model": self.model,
                "assignment": self.assignment}


def write_assist_file(path: Path, attachment: Attachment | None) -> None:
    """Atomically: a proposer never reads half a document."""
    doc = {"endpoint": None} if attachment is None else attachment.document()
    partial = path.with_name(path.name + ".partial")
    partial.write_text(json.dumps(doc))
    os.replace(partial, path)


def read_stats(path: Path) -> dict[str, Any]:
    try:
        return dict(json.loads(path.with_name(path.name + ".stats").read_text()))
    except (OSError, ValueError):
        return {}


class LumenRemoteProposer:
    """vLLM `custom_class` proposer: drafts from a remote draft server, or none."""

    def __init__(self, vllm_config: Any) -> None:
        self.model = str(vllm_config.model_config.served_model_name
                         or vllm_config.model_config.model)
        spec = vllm_config.speculative_config
        self.k_max = int(spec.num_speculative_tokens) if spec is not None else DEFAULT_K
        self.runner = _constructing_runner()
        self.rank = _tp_rank()
        path = os.environ.get(ASSIST_FILE_ENV)
        self.path = Path(path) if path else None
        self._seen_mtime: int | None = None
        self.attachment: Attachment | None = None
        self.client: Any = None
        self.counters = {"steps": 0, "rounds": 0, "skipped_batch": 0, "bad_files": 0}
        self._stats_at = 0.0
        if self.runner is None:
            log.warning("LUMEN proposer: no model runner found; draft-assist disabled")

    def load_model(self, *args: Any, **kwargs: Any) -> None:
        return  # nothing to load here: the draft model runs in the assisting worker

    def propose(self, sampled_token_ids: list[list[int]], num_tokens_no_spec: Any,
                token_ids_cpu: Any, *args: Any, **kwargs: Any) -> list[list[int]]:
        rows = len(sampled_token_ids)
        none: list[list[int]] = [[] for _ in range(rows)]
        self.counters["steps"] += 1
        self._follow_file()
        if self.client is None or self.attachment is None or self.runner is None or not rows:
            return none
        attachment = self.attachment
        req_ids = list(self.runner.input_batch.req_ids[:rows])
        if rows > attachment.max_batch:
            self.counters["skipped_batch"] += 1
            self.client.release_absent([r for r in req_ids if r is not None])
            return none
        contexts = {req_ids[i]: token_ids_cpu[i, :int(num_tokens_no_spec[i])].tolist()
                    for i in range(rows) if req_ids[i] is not None}
        self.client.release_absent(contexts)
        k = min(attachment.k, self.k_max)
        drafts = self.client.propose(contexts, k)
        self.counters["rounds"] += 1
        self._write_stats()
        return [list(drafts.get(req_ids[i], ()))[:k] if req_ids[i] is not None else []
                for i in range(rows)]

    # -- attachment ------------------------------------------------------------------------

    def _follow_file(self) -> None:
        if self.path is None or self.rank != 0:
            return
        try:
            mtime = self.path.stat().st_mtime_ns
        except OSError:
            mtime = None
        if mtime == self._seen_mtime:
            return
        self._seen_mtime = mtime
        try:
            attachment = (Attachment.parse(json.loads(self.path.read_text()))
                          if mtime is not None else None)
        except (OSError, ValueError) as exc:
            self.counters["bad_files"] += 1
            log.warning("LUMEN proposer: %s: %s; draft-assist detached", self.path, exc)
            attachment = None
        if attachment != self.attachment:
            self._attach(attachment)

    def _attach(self, attachment: Attachment | None) -> None:
        if self.client is not None:
            self.client.close()
            self.client = None
            log.info("draft-assist detached from %s", self.attachment and
                     self.attachment.endpoint)
        self.attachment = attachment
        if attachment is not None:
            from lumend.assist.client import DraftClient
            from lumend.checkpoint.security import client_keys_from_env

            self.client = DraftClient(attachment.endpoint, deadline_s=attachment.deadline_s,
                                      curve=client_keys_from_env(), model=attachment.model,
                                      survivor=os.environ.get("LUMEN_ENGINE_ID", ""))
            log.info("draft-assist attached: %s, k=%d, deadline %.0f ms, batches up to %d",
                     attachment.endpoint, attachment.k, attachment.deadline_s * 1000,
                     attachment.max_batch)
        self._write_stats(force=True)

    def _write_stats(self, force: bool = False) -> None:
        now = time.monotonic()
        if self.path is None or (not force and now - self._stats_at < STATS_EVERY_S):
            return
        self._stats_at = now
        stats: dict[str, Any] = {"attached": self.attachment is not None, **self.counters}
        if self.client is not None:
            c = self.client.counters
            stats.update(on_time=c.on_time, late=c.late, stale=c.stale, unsent=c.unsent,
                         refused=c.refused)
        target = self.path.with_name(self.path.name + ".stats")
        with contextlib.suppress(OSError):
            partial = target.with_name(target.name + ".partial")
            partial.write_text(json.dumps(stats))
            os.replace(partial, target)


def _constructing_runner() -> Any:
    """The model runner that is building this proposer (vLLM passes only its config):
    the `self` of the nearest calling frame that has an `input_batch`-owning runner."""
    frame: Any = sys._getframe(1)
    while frame is not None:
        candidate = frame.f_locals.get("self")
        if candidate is not None and type(candidate).__name__.endswith("ModelRunner"):
            return candidate
        frame = frame.f_back
    return None


def _tp_rank() -> int:
    try:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        return int(get_tensor_model_parallel_rank())
    except Exception:  # not initialised (a single process): rank 0
        return 0


PROPOSER = f"{__name__}.LumenRemoteProposer"

"""Draft-assist on a survivor's vLLM engine (LUMEN's Algorithm 3): drafts come from a
recovering worker's draft server, vLLM verifies them.

Two pieces, both loaded by vLLM in its worker processes:

- `LumenRemoteProposer`, a speculative-decoding proposer (`speculative_config` method
  `custom_class`): on every step it sends the draft server, per running request, only the
  newly committed tokens, and returns the drafts that arrive within a deadline well below
  the step time. Detached (the default), or late, or above the batch-size threshold, it
  proposes nothing: vLLM then decodes as without speculation. vLLM's rejection sampler keeps
  the output exactly what the target model would produce (greedy: the longest matching
  prefix plus one token).
- `LumenAssistExtension`, a worker extension (`--worker-extension-cls`): `collective_rpc`
  methods that attach and detach the draft server's endpoint at run time (lumend calls them
  through the gate's `/lumen/assist`). Only tensor-parallel rank 0 talks to the drafter;
  vLLM takes the drafts from that rank.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any

log = logging.getLogger("vllm.lumen_assist")  # under vllm.: vLLM's log configuration applies

DEFAULT_K = 3
DEFAULT_DEADLINE_S = 0.02
DEFAULT_MAX_BATCH = 8  # above this, verifying k extra tokens per request costs more than it saves


@dataclass
class _Attachment:
    endpoint: str
    k: int
    deadline_s: float
    max_batch: int
    client: Any  # lumend.assist.client.DraftClient


class _AssistState:
    """Per worker process: the proposer and the extension meet here."""

    def __init__(self) -> None:
        self.attachment: _Attachment | None = None
        self.runner: Any = None  # the worker's model runner (request ids of batch rows)
        self.rank = 0
        self.steps = 0
        self.rounds = 0
        self.skipped_batch = 0

    def attach(self, endpoint: str, k: int, deadline_s: float, max_batch: int,
               model: str) -> None:
        from lumend.assist.client import DraftClient
        from lumend.checkpoint.security import client_keys_from_env

        self.detach()
        client = DraftClient(endpoint, deadline_s=deadline_s, curve=client_keys_from_env(),
                             model=model, survivor=os.environ.get("LUMEN_ENGINE_ID", ""))
        self.attachment = _Attachment(endpoint, k, deadline_s, max_batch, client)
        log.info("draft-assist attached: %s, k=%d, deadline %.0f ms, batches up to %d",
                 endpoint, k, deadline_s * 1000, max_batch)

    def detach(self) -> None:
        if self.attachment is not None:
            self.attachment.client.close()
            log.info("draft-assist detached from %s", self.attachment.endpoint)
            self.attachment = None

    def stats(self) -> dict[str, Any]:
        out: dict[str, Any] = {"attached": self.attachment is not None, "steps": self.steps,
                               "rounds": self.rounds, "skipped_batch": self.skipped_batch}
        if self.attachment is not None:
            c = self.attachment.client.counters
            out.update(endpoint=self.attachment.endpoint, k=self.attachment.k,
                       on_time=c.on_time, late=c.late, stale=c.stale, unsent=c.unsent,
                       refused=c.refused)
        return out


_STATE = _AssistState()


class LumenRemoteProposer:
    """vLLM `custom_class` proposer: drafts from a remote draft server, or none."""

    def __init__(self, vllm_config: Any) -> None:
        self.vllm_config = vllm_config
        self.model = str(vllm_config.model_config.served_model_name
                         or vllm_config.model_config.model)
        spec = vllm_config.speculative_config
        self.k_max = int(spec.num_speculative_tokens) if spec is not None else DEFAULT_K

    def load_model(self, *args: Any, **kwargs: Any) -> None:
        return  # nothing to load here: the draft model runs in the assisting worker

    def propose(self, sampled_token_ids: list[list[int]], num_tokens_no_spec: Any,
                token_ids_cpu: Any, *args: Any, **kwargs: Any) -> list[list[int]]:
        rows = len(sampled_token_ids)
        none: list[list[int]] = [[] for _ in range(rows)]
        _STATE.steps += 1
        attachment = _STATE.attachment
        if attachment is None or _STATE.runner is None or _STATE.rank != 0 or rows == 0:
            return none
        req_ids = list(_STATE.runner.input_batch.req_ids[:rows])
        if rows > attachment.max_batch:
            _STATE.skipped_batch += 1
            attachment.client.release_absent(req_ids)
            return none
        contexts = {req_ids[i]: token_ids_cpu[i, :int(num_tokens_no_spec[i])].tolist()
                    for i in range(rows) if req_ids[i] is not None}
        attachment.client.release_absent(contexts)
        k = min(attachment.k, self.k_max)
        drafts = attachment.client.propose(contexts, k)
        _STATE.rounds += 1
        return [list(drafts.get(req_ids[i], ()))[:k] if req_ids[i] is not None else []
                for i in range(rows)]


class LumenAssistExtension:
    """Mixed into vLLM's Worker (`--worker-extension-cls`): methods for `collective_rpc`."""

    model_runner: Any

    def _lumen_bind(self) -> None:
        _STATE.runner = self.model_runner
        try:
            from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

            _STATE.rank = get_tensor_model_parallel_rank()
        except Exception:  # not initialised (single process): rank 0
            _STATE.rank = 0

    def lumen_assist_attach(self, endpoint: str, k: int = DEFAULT_K,
                            deadline_s: float = DEFAULT_DEADLINE_S,
                            max_batch: int = DEFAULT_MAX_BATCH, model: str = "") -> bool:
        self._lumen_bind()
        if _STATE.rank != 0:
            return False  # only rank 0 talks to the drafter
        _STATE.attach(endpoint, k, deadline_s, max_batch, model)
        return True

    def lumen_assist_detach(self) -> bool:
        _STATE.detach()
        return True

    def lumen_assist_stats(self) -> dict[str, Any]:
        return _STATE.stats()


# What lumend adds to a vLLM engine's command line so the engine can be assisted.
PROPOSER = f"{__name__}.LumenRemoteProposer"
EXTENSION = f"{__name__}.LumenAssistExtension"

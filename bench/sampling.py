"""The hf engine's sampler, per decode step: the batched `worker.engines.logits.sample` against
the per-row loop it replaced (kept here as `per_row`), at batch 1, 8 and 32 over opt-125m's
vocabulary (50,272), for temperature alone, top-p, and top-k + top-p; logits from a normal
distribution scaled by --scale (1: a flat distribution, as from this project's random-weight
checkpoints, whose top-p nucleus holds ~30,000 tokens; 6: a peaked one, ~60 tokens, closer to
a trained model). One torch thread.

    python -m bench.sampling --scale 1
    python -m bench.sampling --scale 6
"""

from __future__ import annotations

import argparse
import platform
import time

import torch

from tasks.schemas import SamplingParams
from worker.engines.logits import sample

VOCAB = 50_272


def per_row(params, gens, logits):
    """The sampler before: one row at a time, a full sort of the vocabulary for top-p."""
    tokens = logits.argmax(-1)
    for row, p in enumerate(params):
        if p.greedy:
            continue
        scores = logits[row].float() / p.temperature
        if p.top_k:
            kth = torch.topk(scores, min(p.top_k, scores.numel())).values[-1]
            scores = scores.masked_fill(scores < kth, float("-inf"))
        if p.top_p < 1.0:
            ordered, order = scores.sort(descending=True)
            probs = ordered.softmax(-1)
            drop = probs.cumsum(-1) - probs > p.top_p
            scores = scores.scatter(0, order, ordered.masked_fill(drop, float("-inf")))
        tokens[row] = torch.multinomial(scores.softmax(-1), 1, generator=gens[row])[0]
    return tokens


def timed(fn, reps: int) -> float:
    fn()
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - start) / reps * 1000


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--scale", type=float, default=1.0)
    ap.add_argument("--reps", type=int, default=10)
    args = ap.parse_args()
    torch.set_num_threads(1)
    cases = {
        "temperature 0.8": SamplingParams(temperature=0.8),
        "+ top_p 0.9": SamplingParams(temperature=0.8, top_p=0.9),
        "+ top_k 50, top_p 0.9": SamplingParams(temperature=0.8, top_k=50, top_p=0.9),
    }
    print(f"{platform.processor() or platform.machine()}, logits N(0, {args.scale:g}^2), ms per step")
    print("| batch | parameters | per row (before) | batched | speedup |")
    print("|---|---|---|---|---|")
    for batch in (1, 8, 32):
        logits = torch.randn(batch, VOCAB, generator=torch.Generator().manual_seed(batch)) * args.scale
        for name, p in cases.items():
            params, gens = [p] * batch, [torch.Generator().manual_seed(i) for i in range(batch)]
            before = timed(lambda: per_row(params, gens, logits), args.reps)
            after = timed(lambda: sample(logits, params, gens), args.reps)
            print(f"| {batch} | {name} | {before:.1f} | {after:.1f} | {before / after:.2f}x |")


if __name__ == "__main__":
    main()

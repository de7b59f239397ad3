"""The hf engine's draw of each row's next token (`sample`: greedy, temperature, min_p, top-k,
top-p, each row from its own generator) and the log-probabilities it reports (`logprobs`), over
logits that worker/engines/logits.py has processed where a row asked for it."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from tasks.schemas import SamplingParams

# JSON has no -inf; vLLM reports this instead.
LOGPROB_FLOOR = -9999.0


def logprobs(
    logits: torch.Tensor, tokens: torch.Tensor, rows: list[int], top: list[int]
) -> list[tuple[float, list[tuple[int, float]]]]:
    """For each row in `rows`: the log-probability of its chosen token, and its `top[i]` likeliest
    tokens with theirs (log-softmax of the raw `logits`; one op over those rows together)."""
    idx = torch.tensor(rows)
    lp = logits.index_select(0, idx).float().log_softmax(-1)
    chosen = lp.gather(1, tokens.index_select(0, idx).view(-1, 1)).view(-1).clamp(min=LOGPROB_FLOOR).tolist()
    k = max(top)
    if k:
        values, ids = lp.topk(k, dim=-1)
        values, ids = values.clamp(min=LOGPROB_FLOOR).tolist(), ids.tolist()
    else:
        values = ids = [[] for _ in rows]
    return [(c, list(zip(i[:n], v[:n]))) for c, i, v, n in zip(chosen, ids, values, top)]


def sample(
    logits: torch.Tensor, params: Sequence[SamplingParams], generators: Sequence[torch.Generator | None]
) -> torch.Tensor:
    """Each row's next token: argmax for greedy rows; for the others, temperature, min_p, top-k
    and top-p (as transformers' warpers: the smallest set of likeliest tokens whose probability
    reaches top_p, the likeliest always kept) applied to all of them together in a few tensor
    ops, then one draw per row by inverse CDF from a uniform number of the row's own generator
    (a seeded row draws the same numbers whatever else is in the batch)."""
    # max's indices: argmax's (the first of equal maxima), 4-5x faster over bfloat16 on the CPU.
    tokens = logits.max(-1).indices
    rows = [i for i, p in enumerate(params) if not p.greedy]
    if not rows:
        return tokens
    idx = torch.tensor(rows)
    ps = [params[i] for i in rows]
    scores = logits.index_select(0, idx).float() / torch.tensor([[p.temperature] for p in ps])
    n, vocab = scores.shape
    if any(p.min_p for p in ps):
        probs = scores.softmax(-1)
        floor = torch.tensor([[p.min_p] for p in ps]) * probs.max(-1, keepdim=True).values
        scores = scores.masked_fill(probs < floor, float("-inf"))
    if any(p.top_k for p in ps):
        ks = torch.tensor([min(p.top_k, vocab) if p.top_k else vocab for p in ps])
        top = scores.topk(int(ks.max()), dim=-1).values
        kth = top.gather(1, (ks - 1).view(-1, 1))
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if any(p.top_p < 1.0 for p in ps):
        scores = nucleus(scores, torch.tensor([p.top_p for p in ps]))
    cdf = scores.softmax(-1).cumsum(-1)
    u = torch.stack([torch.rand((), generator=generators[i]) for i in rows]).view(-1, 1)
    # Scaled to the row's total (not quite 1 in float32), and the first index whose cumulative
    # probability exceeds it: never a token of probability 0.
    picked = torch.searchsorted(cdf, u * cdf[:, -1:], right=True).clamp(max=vocab - 1)
    tokens[idx] = picked.view(-1).to(tokens.dtype)
    return tokens


# The likeliest tokens looked at first for top-p: a trained model's nucleus is mostly within
# them, and a top-k of them costs a fraction of sorting the whole vocabulary (docs/benchmarks.md,
# "hf engine sampler").
NUCLEUS_FIRST_LOOK = 256


def nucleus(scores: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """`scores` [n, vocab] with -inf outside each row's nucleus: the smallest set of likeliest
    tokens whose probability reaches the row's `top_p` [n] (the likeliest always kept; rows at
    1.0 keep everything). Looks at the NUCLEUS_FIRST_LOOK likeliest tokens first and at the
    whole vocabulary only if some row's nucleus is larger."""
    probs = scores.softmax(-1)
    vocab = probs.shape[-1]
    want = top_p.view(-1, 1)
    cut = want < 1.0
    k = min(vocab, NUCLEUS_FIRST_LOOK)
    while True:
        top, _ = probs.topk(k, dim=-1)  # descending
        mass = top.cumsum(-1)
        if k == vocab or bool((mass[:, -1:] >= want)[cut].all()):
            break
        k = vocab
    kept = (mass - top < want).sum(-1, keepdim=True).clamp(min=1)
    threshold = top.gather(1, kept - 1)
    return scores.masked_fill(cut & (probs < threshold), float("-inf"))

"""The hf engine's batched sampler (worker.engines.sampling.sample), statistically: the tokens it
draws follow softmax(logits / temperature), restricted by top-k and top-p as transformers'
warpers restrict them; greedy rows beside sampled ones stay argmax; a seeded row draws the
same tokens whatever else is in the batch. Pure tensor logic: no model needed."""

from __future__ import annotations

import torch

from tasks.schemas import SamplingParams
from worker.engines.sampling import sample

LOGITS = torch.tensor([2.0, 1.5, 1.0, 0.0, -1.0, -3.0])
DRAWS = 20_000


def frequencies(params: SamplingParams, rows: int = 2000, rounds: int = DRAWS // 2000) -> torch.Tensor:
    logits = LOGITS.repeat(rows, 1)
    gens = [torch.Generator().manual_seed(10_000 + i) for i in range(rows)]
    counts = torch.zeros(len(LOGITS))
    for _ in range(rounds):
        tokens = sample(logits, [params] * rows, gens)
        counts += torch.bincount(tokens, minlength=len(LOGITS))
    return counts / counts.sum()


def expected(temperature: float = 1.0, keep: list[int] | None = None) -> torch.Tensor:
    probs = (LOGITS / temperature).softmax(-1)
    if keep is not None:
        mask = torch.zeros_like(probs, dtype=torch.bool)
        mask[keep] = True
        probs = torch.where(mask, probs, 0.0)
        probs = probs / probs.sum()
    return probs


def close(got: torch.Tensor, want: torch.Tensor) -> bool:
    # 20,000 draws: a frequency's standard deviation is at most 0.0036; allow four of them.
    return bool((got - want).abs().max() < 0.015)


def test_draws_follow_the_temperature():
    cold = frequencies(SamplingParams(temperature=0.5))
    hot = frequencies(SamplingParams(temperature=2.0))
    assert close(cold, expected(0.5)), (cold, expected(0.5))
    assert close(hot, expected(2.0)), (hot, expected(2.0))
    assert not close(cold, hot)  # the temperature changes the distribution


def test_top_k_keeps_the_k_likeliest():
    got = frequencies(SamplingParams(temperature=1.0, top_k=2))
    assert got[2:].sum() == 0
    assert close(got, expected(keep=[0, 1])), got


def test_top_p_keeps_the_smallest_set_reaching_p():
    probs = expected()  # 0.45, 0.27, 0.17, ...: the first two reach 0.6, the first three 0.85
    assert probs[0] < 0.6 < probs[:2].sum() < 0.8 < probs[:3].sum()
    got = frequencies(SamplingParams(temperature=1.0, top_p=0.6))
    assert got[2:].sum() == 0 and close(got, expected(keep=[0, 1])), got
    got = frequencies(SamplingParams(temperature=1.0, top_p=0.8))
    assert got[3:].sum() == 0 and close(got, expected(keep=[0, 1, 2])), got
    both = frequencies(SamplingParams(temperature=1.0, top_k=2, top_p=0.8))
    assert both[2:].sum() == 0 and close(both, expected(keep=[0, 1])), both


def test_greedy_rows_beside_sampled_ones_and_top_k_1():
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(1))
    params = [
        SamplingParams(),
        SamplingParams(temperature=1.5),
        SamplingParams(),
        SamplingParams(temperature=1.0, top_k=1),
        SamplingParams(temperature=0.8, top_p=1e-6),
        SamplingParams(temperature=1.0),
    ]
    gens = [None if p.greedy else torch.Generator().manual_seed(i) for i, p in enumerate(params)]
    for _ in range(20):
        tokens = sample(logits, params, gens)
        argmax = logits.argmax(-1)
        assert tokens[[0, 2, 3, 4]].tolist() == argmax[[0, 2, 3, 4]].tolist()
    seen = {int(sample(logits, params, gens)[5]) for _ in range(50)}
    assert len(seen) > 3  # a sampled row does sample


def test_a_seeded_row_draws_the_same_whatever_the_batch():
    vocab = 40
    row = torch.randn(vocab, generator=torch.Generator().manual_seed(2))
    p = SamplingParams(temperature=1.0, top_p=0.9, top_k=20, seed=7)

    def run(batch: int) -> list[int]:
        others = torch.randn(batch, vocab, generator=torch.Generator().manual_seed(batch))
        logits = torch.cat([others, row.view(1, -1)])
        params = [SamplingParams(temperature=1.3)] * batch + [p]
        gens = [torch.Generator().manual_seed(100 + i) for i in range(batch)] + [torch.Generator().manual_seed(7)]
        return [int(sample(logits, params, gens)[-1]) for _ in range(30)]

    alone = run(0)
    assert run(5) == alone and run(17) == alone
    assert len(set(alone)) > 1


def test_the_nucleus_is_the_one_a_full_sort_gives():
    """Small nuclei (found among the first look's tokens) and large ones (a flat distribution:
    the whole vocabulary is sorted) equal the sort-based computation of transformers' warper."""
    from worker.engines.sampling import NUCLEUS_FIRST_LOOK, nucleus

    gen = torch.Generator().manual_seed(3)
    vocab = 4 * NUCLEUS_FIRST_LOOK
    peaky = torch.randn(4, vocab, generator=gen) * 8
    flat = torch.randn(4, vocab, generator=gen) * 0.1
    scores = torch.cat([peaky, flat])
    top_p = torch.tensor([0.5, 0.9, 0.99, 1.0, 0.5, 0.9, 0.3, 1.0])
    ordered, order = scores.sort(descending=True, dim=-1)
    probs = ordered.softmax(-1)
    drop = (probs.cumsum(-1) - probs > top_p.view(-1, 1)) & (top_p.view(-1, 1) < 1.0)
    want = scores.scatter(1, order, ordered.masked_fill(drop, float("-inf")))
    got = nucleus(scores, top_p)
    assert torch.equal(got.isinf(), want.isinf())
    kept = (~got.isinf()).sum(-1)
    assert kept[4] > NUCLEUS_FIRST_LOOK and kept[0] < NUCLEUS_FIRST_LOOK  # both paths were taken
    assert kept[3] == kept[7] == vocab

"""The hf engine's in-place KV cache (worker/engines/kvcache.py) against plain concatenation:
whatever joins (narrower or wider than the window) and leaves, each row's unmasked keys and
values, in order, and its mask are those of a cache built by concatenating them."""

from __future__ import annotations

import random

import torch
from transformers import DynamicCache

from worker.engines.kvcache import SlotKV

LAYERS, HEADS, DIM = 2, 3, 4


def prefill(widths: list[int]) -> tuple[DynamicCache, torch.Tensor, list[torch.Tensor]]:
    """A left-padded prefill of rows with these lengths: its cache, its mask, and each row's
    real keys (layer 0) for the reference."""
    width = max(widths)
    mask = torch.zeros(len(widths), width, dtype=torch.long)
    for r, w in enumerate(widths):
        mask[r, width - w :] = 1
    layers = [
        (torch.randn(len(widths), HEADS, width, DIM), torch.randn(len(widths), HEADS, width, DIM))
        for _ in range(LAYERS)
    ]
    real = [layers[0][0][r, :, width - w :] for r, w in enumerate(widths)]
    return DynamicCache(layers), mask, real


def check(kv: SlotKV, rows: list[list[torch.Tensor]]) -> None:
    assert kv.rows == len(rows)
    if not rows:
        return
    mask = kv.window_mask()
    keys = kv.k[0][: kv.rows, :, kv.start : kv.end]
    for r, pieces in enumerate(rows):
        want = torch.cat(pieces, dim=1)
        got = keys[r][:, mask[r].bool()]
        assert torch.equal(got, want), r
        # Right-aligned: a row's tokens are the window's last ones, nothing masked in between.
        assert mask[r, mask.shape[1] - want.shape[1] :].all()
    assert mask[:, 0].any()  # the window starts at the first column some row uses


def test_joins_steps_and_leaves_match_concatenation():
    rng = random.Random(0)
    torch.manual_seed(0)
    kv = SlotKV(LAYERS, HEADS, DIM, torch.float32, max_rows=16)
    rows: list[list[torch.Tensor]] = []
    for _ in range(60):
        action = rng.random()
        if action < 0.3 and len(rows) < 12:
            # Narrow and wide prompts alike: some wider than the window, so it grows left.
            widths = [rng.randint(1, 30) for _ in range(rng.randint(1, 4))]
            cache, mask, real = prefill(widths)
            kv.append(cache, mask)
            rows.extend([k] for k in real)
        elif action < 0.45 and rows:
            keep = sorted(rng.sample(range(len(rows)), rng.randint(0, len(rows) - 1)))
            order = kv.select(keep)
            assert sorted(order) == keep
            rows = [rows[i] for i in order]
        elif rows:
            new_k = torch.randn(kv.rows, HEADS, 1, DIM)
            mask = kv.step_mask()
            assert mask.shape == (kv.rows, kv.length + 1) and mask[:, -1].all()
            for i, layer in enumerate(kv.cache.layers):
                k, v = layer.update(new_k if i == 0 else torch.zeros_like(new_k), torch.zeros_like(new_k))
                assert k.shape == (kv.rows, HEADS, kv.length + 1, DIM)
            assert kv.cache.get_seq_length() == kv.length
            kv.advance()
            for r in range(kv.rows):
                rows[r].append(new_k[r])
        check(kv, rows)
    assert kv.mask.shape[0] <= 16

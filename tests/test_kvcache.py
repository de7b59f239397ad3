"""The hf engine's in-place KV cache (worker/engines/kvcache.py) against plain concatenation:
whatever joins (narrower or wider than the window, in the steps of running rows) and leaves,
each row's unmasked keys, in order, are those of a cache built by concatenating them. The
attention that reads it runs in every engine test (a real model's forward)."""

from __future__ import annotations

import random

import torch

from worker.engines.kvcache import SlotKV

LAYERS, HEADS, DIM = 2, 3, 4


def check(kv: SlotKV, rows: list[list[torch.Tensor]], sat_out: set[int]) -> None:
    assert kv.rows == len(rows)
    if not rows:
        return
    mask = kv.window_mask()
    keys = kv.k[0][: kv.rows, :, kv.start : kv.end]
    for r, pieces in enumerate(rows):
        want = torch.cat(pieces, dim=1)
        got = keys[r][:, mask[r].bool()]
        assert torch.equal(got, want), r
        if r not in sat_out:  # right-aligned: a row's tokens are the window's last ones
            assert mask[r, mask.shape[1] - want.shape[1] :].all()
    assert mask[:, 0].any()  # the window starts at the first column some row uses


def test_steps_joins_and_leaves_match_concatenation():
    """Steps that feed all the rows or only the first ones, rows joining (narrower and wider
    than the window) in the same steps, rows leaving: each row's keys where its mask is set,
    in order, are those it was fed, and each token got its row's own position."""
    rng = random.Random(0)
    torch.manual_seed(0)
    kv = SlotKV(LAYERS, HEADS, DIM, torch.float32, max_rows=16)
    rows: list[list[torch.Tensor]] = []
    sat_out: set[int] = set()  # rows that sat a step out: a masked column inside their window
    for _ in range(80):
        if rng.random() < 0.15 and rows:
            keep = sorted(rng.sample(range(len(rows)), rng.randint(0, len(rows) - 1)))
            order = kv.select(keep)
            assert sorted(order) == keep
            rows = [rows[i] for i in order]
            sat_out = {new for new, old in enumerate(order) if old in sat_out}
            check(kv, rows, sat_out)
            continue
        active = len(rows) if rng.random() < 0.7 else rng.randint(0, len(rows))
        joining = [rng.randint(1, 30) for _ in range(rng.randint(1, 4))] if rng.random() < 0.3 else []
        if len(rows) + len(joining) > 16 or not (active or joining):
            continue
        positions = kv.begin(active, joining)
        fed = [sum(p.shape[1] for p in pieces) for pieces in rows[:active]]
        assert positions.tolist() == [fed + [i for n in joining for i in range(n)]]
        tokens = active + sum(joining)
        new_k = torch.randn(1, HEADS, tokens, DIM)
        for i, layer in enumerate(kv.cache.layers):
            k, _ = layer.update(new_k if i == 0 else torch.zeros_like(new_k), torch.zeros_like(new_k))
            assert k is kv.k[i]  # the whole buffer: the attention reads the step's layout
        kv.finish()
        sat_out |= set(range(active, len(rows)))
        _record(rows, new_k, active, joining)
        check(kv, rows, sat_out)
    assert kv.mask.shape[0] <= 16


def test_a_batch_that_never_empties_slides_its_window_in_place():
    """Rows leave and join for 200 steps, never all at once: the window reaches the buffers'
    right edge again and again and moves back in place, without new buffers, each row's keys
    intact."""
    torch.manual_seed(0)
    kv = SlotKV(LAYERS, HEADS, DIM, torch.float32, max_rows=4)
    reallocs, realloc = [], kv._realloc
    kv._realloc = lambda *a, **kw: reallocs.append(a) or realloc(*a, **kw)
    slides, slide = [], kv._slide
    kv._slide = lambda: slides.append(slide()) or slides[-1]
    rows: list[list[torch.Tensor]] = []
    for step in range(200):
        joining = [5] if step % 20 == 0 else []  # a job of 40 tokens every 20 steps
        if len(rows) == 2 and step % 20 == 0:
            kv.select([1])  # the oldest leaves as the next joins
            rows = rows[1:]
        _step(kv, rows, len(rows), joining)
        check(kv, rows, set())
    assert slides.count(True) >= 3 and len(reallocs) <= 3, (slides, reallocs)


def _record(rows: list[list[torch.Tensor]], new_k: torch.Tensor, active: int, joining: list[int]) -> None:
    """What each row should hold after a step whose new keys are `new_k`: one more for each of
    the `active` rows, and the `joining` rows (their lengths) after them."""
    for r in range(active):
        rows[r].append(new_k[0, :, r : r + 1])
    at = active
    for n in joining:
        rows.append([new_k[0, :, at : at + n]])
        at += n


def _step(kv: SlotKV, rows: list[list[torch.Tensor]], active: int, joining: list[int]) -> None:
    """One step as a model's forward makes it: the `active` rows and the `joining` ones (their
    lengths) each get their new keys in every layer; `rows` keeps what each row should hold."""
    kv.begin(active, joining)
    new_k = torch.randn(1, HEADS, active + sum(joining), DIM)
    for layer in kv.cache.layers:
        layer.update(new_k, new_k)
    kv.finish()
    _record(rows, new_k, active, joining)


def test_a_wide_row_joining_at_the_right_edge_gets_its_columns():
    """A batch at its buffers' right edge (a slide is due) and a joining row wider than the
    window by more than the slide leaves on the left: new buffers, the row's keys all there.
    (Sliding first and growing left after put the start below 0: the row got no columns, and
    the prefix cache's store failed the step; found by a CI run of bench.prefix's load c.)"""
    torch.manual_seed(0)
    kv = SlotKV(LAYERS, HEADS, DIM, torch.float32, max_rows=4)
    rows: list[list[torch.Tensor]] = []
    step = lambda active, joining: _step(kv, rows, active, joining)  # noqa: E731

    step(0, [3, 3])  # buffers for two rows
    for _ in range(20):
        step(2, [])
    kv.select([0])
    rows.pop()
    step(1, [3])  # a row that starts 20 columns further right
    kv.select([1])  # the first leaves: the window now starts far from the buffers' left edge
    rows.pop(0)
    while kv.end < kv.mask.shape[1]:  # running up to the right edge: a slide is due
        step(1, [])
    grow = 16  # what the joining row needs on the left: within the start, beyond a slide's 8
    assert 8 < grow <= kv.start and kv.mask.shape[0] >= 2
    step(1, [kv.length + 1 + grow])
    assert kv.start >= 0
    check(kv, rows, set())
    step(2, [])
    check(kv, rows, set())

"""A preallocated KV cache for the hf engine's running batch, written in place, and the
attention that reads it: one forward feeds the running rows' next tokens and the joining rows'
prompts together.

`SlotKV` keeps, per layer, one buffer `[rows, heads, columns, head_dim]` for keys and one for
values, plus the attention mask `[rows, columns]`, and a window `[start, end)` of columns in
use. A step (`begin`, the model's forward, `finish`) flattens its tokens into one sequence
`[1, tokens]`: first one token for each of the first `active` rows, then each joining row's
tokens. Each token's key/value goes straight into its row's column: a running row's into column
`end`, a joining row's prompt right-aligned to end there too, so nothing is copied
(transformers' DynamicCache copies the whole cache each step). `attention` (registered with
transformers as `genq`) then attends the running rows' tokens over the window and the joining
rows' tokens causally over their own prompts. So a job that arrives costs the running batch no
forward of its own: the weights are read once a step, as vLLM's scheduler mixes prefills into
decode steps. Dropping rows copies only those rows, and a step may feed only the first rows
(the others sit it out, masked). Row order changes are returned so that the engine keeps its
per-row state in step. How the window moves: docs/design.md, "The KV cache".
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import AttentionInterface, Cache
from transformers.cache_utils import DynamicLayer
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from worker.engines.rows import fill_holes

#: The attention implementation name the hf engine's model runs with (`attention` below).
ATTENTION = "genq"
_local = threading.local()  # the step being run on this thread (the engine's)
SLIDE_LEFT = 8  # where a window that reached the buffers' right edge moves back to (`_slide`)


@dataclass
class _Step:
    """Where one step's flattened tokens go and what each attends to."""

    active: int  # running rows fed (the first ones); their tokens come first
    lo: int  # the joining rows' first row
    width: int  # the longest joining row's length, cached tokens included (0: none joins)
    rows_idx: torch.Tensor | None  # [joining tokens] each joining token's row ...
    cols_idx: torch.Tensor | None  # ... and column in the buffers
    decode_mask: torch.Tensor | None  # [active, 1, 1, window + 1] bool
    gather: torch.Tensor | None  # [joining, queries] flat token index per padded fed slot
    valid: torch.Tensor | None  # [joining * queries] bool: the slots that hold a token
    prefill_mask: torch.Tensor | None  # [joining, 1, queries, width] bool: causal, padding masked
    # Cascade attention for the running rows (`begin`'s `shared`): (row, its first column, the
    # shared tokens, the first column any row's own part needs, the own parts' additive mask
    # [active, 1, 1, columns]); None: every row attends over the whole window.
    cascade: tuple[int, int, int, int, torch.Tensor] | None = None


class _SlotLayer(DynamicLayer):
    """One layer of `SlotKV` as transformers sees it: `update` writes the step's keys and values
    into their rows' columns and hands the whole buffers on to `attention`."""

    def __init__(self, kv: SlotKV, index: int):
        super().__init__()
        self.kv, self.index = kv, index
        self.is_initialized = True

    def lazy_initialization(self, key_states, value_states) -> None:  # the buffers are the state
        pass

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        kv, step = self.kv, self.kv.step
        if step is None:
            raise RuntimeError("SlotKV: a forward outside begin() / finish()")
        k, v = kv.k[self.index], kv.v[self.index]
        a = step.active
        for buf, new in ((k, key_states[0]), (v, value_states[0])):  # new: [heads, tokens, head_dim]
            if a:  # a slice's copy: cheaper than index_put for the running rows
                buf[:a, :, kv.end] = new[:, :a].transpose(0, 1)
            if step.rows_idx is not None:
                buf[step.rows_idx, :, step.cols_idx] = new[:, a:].transpose(0, 1)
        return k, v

    def get_seq_length(self) -> int:
        return self.kv.end - self.kv.start

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.kv.end - self.kv.start + query_length, 0


def attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers' attention interface, for `SlotKV` steps: `query` is the step's flattened
    tokens `[1, heads, tokens, head_dim]`, `key`/`value` a layer's whole buffers. The running
    rows' tokens attend over the window (their masks), the joining rows' causally over their own
    prompts; both through transformers' SDPA attention (its grouped-query handling). Anything
    this cannot honour (a soft cap, attention sinks, a sliding window) raises: the engine's load
    check (worker/engines/arch.py) then refuses the model."""
    for name in ("softcap", "s_aux", "sliding_window", "position_bias"):
        if kwargs.get(name) is not None:
            raise NotImplementedError(f"the hf engine's attention does not implement {name}")
    kv: SlotKV = _local.kv
    step = kv.step
    q = query[0].transpose(0, 1)  # [tokens, heads, head_dim]
    parts = []
    if step.active and step.cascade is not None:
        parts.append(_cascade(q, key, value, step, kv.end + 1, scaling))
    elif step.active:
        # Each running row's query heads as the "positions" of its key/value head's group: a
        # grouped-query model's keys/values are read as they are, not repeated per query head.
        r, window = step.active, slice(kv.start, kv.end + 1)
        k, v = key[:r, :, window], value[:r, :, window]
        grouped = q[:r].reshape(r, k.shape[1], -1, q.shape[-1])
        out = F.scaled_dot_product_attention(grouped, k, v, attn_mask=step.decode_mask, scale=scaling)
        parts.append(out.reshape(r, *q.shape[1:]))
    if step.width:
        n, w = step.gather.shape[0], step.width
        rows = slice(step.lo, step.lo + n)
        cols = slice(kv.end + 1 - w, kv.end + 1)
        k, v = key[rows, :, cols], value[rows, :, cols]
        fed = q[step.gather].permute(0, 2, 1, 3)  # [joining, heads, queries, head_dim]
        if step.prefill_mask is None:  # one row, causal over its own prompt
            out, _ = sdpa_attention_forward(module, fed, k, v, None, scaling=scaling)
        else:  # as the running rows: each key/value head's query heads, one after the other
            groups, queries = fed.shape[1] // k.shape[1], fed.shape[2]
            grouped = fed.reshape(n, k.shape[1], groups * queries, fed.shape[-1])
            mask = step.prefill_mask.repeat(1, 1, groups, 1)
            out = F.scaled_dot_product_attention(grouped, k, v, attn_mask=mask, scale=scaling)
            out = out.view(n, -1, queries, fed.shape[-1]).transpose(1, 2)
        parts.append(out.reshape(-1, *q.shape[1:])[step.valid])
    out = parts[0] if len(parts) == 1 else torch.cat(parts)
    return out.unsqueeze(0), None


def _cascade(q, key, value, step: _Step, end: int, scaling) -> torch.Tensor:
    """The running rows' attention where all of them begin with the same tokens (a shared
    system prompt): their queries over those tokens' keys/values once, read from one row (every
    row holds a copy; a decode step's attention on a CPU is the reading of keys/values), and
    each row's queries over its own part only (the columns after its copy); the two are merged
    by their log-sum-exps (cascade or bifurcated attention, as FlashInfer's and vLLM's)."""
    r = step.active
    row, c0, shared, lo, own_mask = step.cascade
    heads, dim = key.shape[1], q.shape[-1]
    grouped = q[:r].reshape(r, heads, -1, dim)  # [rows, kv heads, query heads per kv head, dim]
    groups = grouped.shape[2]
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    # The shared part: each key/value head's queries of every row together, as one sequence.
    ks, vs = key[row, :, c0 : c0 + shared][None], value[row, :, c0 : c0 + shared][None]
    qs = grouped.permute(1, 0, 2, 3).reshape(1, heads, r * groups, dim)
    o1, l1 = flash(qs, ks, vs, 0.0, False, scale=scaling)[:2]
    o1 = o1.view(heads, r, groups, dim).transpose(0, 1)
    l1 = l1.view(heads, r, groups).transpose(0, 1)
    # Each row's own part.
    o2, l2 = flash(grouped, key[:r, :, lo:end], value[:r, :, lo:end], 0.0, False, attn_mask=own_mask, scale=scaling)[:2]
    top = torch.maximum(l1, l2)
    w1, w2 = (l1 - top).exp_().unsqueeze(-1), (l2 - top).exp_().unsqueeze(-1)
    out = (o1.float() * w1 + o2.float() * w2) / (w1 + w2)
    return out.to(q.dtype).reshape(r, *q.shape[1:])


AttentionInterface.register(ATTENTION, attention)


class SlotKV:
    def __init__(
        self,
        layers: int,
        heads: int,
        head_dim: int,
        dtype: torch.dtype,
        max_rows: int,
        device: torch.device | str = "cpu",
        max_columns: int = 0,
    ):
        self.shape = (layers, heads, head_dim)
        self.max_columns = max_columns  # rows x columns allocated ahead of need at most (0: no bound)
        self.device = torch.device(device)
        self.dtype, self.max_rows = dtype, max(1, max_rows)
        self.rows = self.start = self.end = 0
        self.cascades = 0  # steps whose running rows read a shared prefix once (`begin`'s `shared`)
        self.step: _Step | None = None
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []
        self.mask = torch.zeros((0, 0), dtype=torch.long, device=self.device)
        self.cache = Cache(layers=[_SlotLayer(self, i) for i in range(layers)])

    @classmethod
    def for_model(
        cls, config, dtype: torch.dtype, max_rows: int, device: torch.device | str = "cpu", budget: int = 0
    ) -> SlotKV:
        """Buffers shaped for `config`'s layers, key/value heads and head size; `budget`: bytes
        the buffers may take (0: no bound), as `max_columns`."""
        heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        kv = cls(config.num_hidden_layers, heads, head_dim, dtype, max_rows, device)
        kv.max_columns = budget // kv.column_bytes
        return kv

    @property
    def column_bytes(self) -> int:
        """The bytes one row's column takes in every layer's keys and values."""
        layers, heads, head_dim = self.shape
        return 2 * layers * heads * head_dim * torch.empty((), dtype=self.dtype).element_size()

    @property
    def length(self) -> int:
        return self.end - self.start

    def window_mask(self) -> torch.Tensor:
        return self.mask[: self.rows, self.start : self.end]

    # -- a step ------------------------------------------------------------------------

    def begin(self, active: int, lengths: list[int], cached: list[int] | None = None, shared: int = 0) -> torch.Tensor:
        """Prepare a step that feeds one token to each of the first `active` rows (the other
        rows sit it out: their column is masked, as left padding is, so they resume later
        exactly where they were) and joins new rows of these lengths after all the rows, of
        whose tokens the first `cached[j]` are not fed: the caller copies their keys/values into
        the row's first columns (`placement`) before the forward. Returns the step's
        `position_ids` `[1, tokens]` (a running row's: the tokens it has fed so far; a joining
        row's: from its first token fed). The model's forward must follow on this thread, then
        `finish`. `shared`: the first tokens of every running row that are the same tokens in
        all of them (their keys/values too): the running rows then attend over them once, in
        one row, and over their own columns after them (cascade attention, on a CPU)."""
        if not 0 <= active <= self.rows or not (active or lengths):
            raise ValueError(f"SlotKV.begin: {active} of {self.rows} rows active, {len(lengths)} joining")
        cached = cached or [0] * len(lengths)
        n, width = len(lengths), max(lengths, default=0)
        news = [length - c for length, c in zip(lengths, cached)]
        if self.rows == 0:  # an empty batch: the window restarts where it has room on the left
            self.start = self.end = width + 7 if self.mask.shape[1] >= width + 40 else 0
        grow_left = max(0, width - (self.length + 1))
        renew = self.rows + n > self.mask.shape[0] or grow_left > self.start
        if not renew and self.end >= self.mask.shape[1]:  # at the right edge: back to the left
            # A slide puts the window's start at SLIDE_LEFT: a joining row wider than that
            # leaves room for needs new buffers (sliding first and growing left after would
            # take the start below 0, and the row's columns out of the buffers).
            renew = grow_left > SLIDE_LEFT or not self._slide()
        if renew:
            self._realloc(self.rows + n, left=grow_left + 8, right=max(32, self.length))
        if grow_left:  # wider than the window: the running rows gain masked columns on the left
            self.start -= grow_left
            self.mask[: self.rows, self.start : self.start + grow_left] = 0
        dev, end, lo = self.device, self.end, self.rows
        positions = [self.mask[:active, self.start : end].sum(-1)]
        self.mask[:active, end] = 1
        self.mask[active:lo, end] = 0
        rows, cols = [], []
        for j, (length, new) in enumerate(zip(lengths, news)):
            self.mask[lo + j, self.start : end + 1 - length] = 0
            self.mask[lo + j, end + 1 - length : end + 1] = 1
            positions.append(torch.arange(length - new, length, device=dev))
            rows.append(torch.full((new,), lo + j, device=dev))
            cols.append(torch.arange(end + 1 - new, end + 1, device=dev))
        step = _Step(active, lo, width, None, None, None, None, None, None)
        if active:
            step.decode_mask = self.mask[:active, self.start : end + 1].bool()[:, None, None, :]
            if shared and active > 1 and dev.type == "cpu":
                step.cascade = self._cascade_of(active, shared)
                self.cascades += step.cascade is not None
        if n:
            step.rows_idx, step.cols_idx = torch.cat(rows), torch.cat(cols)
            # Each joining row's fed tokens, left-padded to `queries`, as indices into the flat
            # step; its keys: its columns, left-padded to `width`.
            queries = max(news)
            pad = torch.tensor([queries - new for new in news], device=dev)
            offsets = torch.tensor([0, *news], device=dev).cumsum(0)[:-1] + active
            slot = torch.arange(queries, device=dev)
            step.valid = (slot[None, :] >= pad[:, None]).reshape(-1)
            step.gather = (offsets[:, None] + slot[None, :] - pad[:, None]).clamp(min=0)
            if n > 1 or queries < width:
                key = torch.arange(width, device=dev)
                at = slot[:, None] + (width - queries)  # each query slot's own key slot
                causal = key[None, :] <= at
                keys = (
                    key[None, None, :]
                    >= torch.tensor([width - length for length in lengths], device=dev)[:, None, None]
                )
                # A padding slot's query attends to its own slot only (its output is dropped).
                step.prefill_mask = ((causal & keys) | (key[None, :] == at))[:, None]
        self.step = step
        _local.kv = self
        return torch.cat(positions).view(1, -1)

    def _cascade_of(self, active: int, shared: int):
        """`_Step.cascade` for `shared` tokens at the start of each of the first `active` rows,
        or None where a row does not hold them in its first columns in a row (never expected:
        a row's prompt is fed into consecutive columns; it only ever sits steps out after)."""
        s, end = self.start, self.end + 1
        window = self.mask[:active, s:end]
        first = window.int().argmax(-1)  # each row's first column holding a token
        own = first + shared  # ... and the first of its own part
        cols = torch.arange(end - s, device=self.device)[None, :]
        copy = (cols >= first[:, None]) & (cols < own[:, None])
        if not bool(((window > 0) & copy).sum(-1).eq(shared).all()):
            return None
        lo = int(own.min())
        keep = (window[:, lo:] > 0) & (cols[:, lo:] >= own[:, None])
        mask = torch.zeros(keep.shape, dtype=self.dtype, device=self.device).masked_fill_(~keep, float("-inf"))
        return 0, s + int(first[0]), shared, s + lo, mask[:, None, None, :]

    def placement(self, j: int, length: int) -> tuple[int, int]:
        """During a step: the row and first column of the step's `j`-th joining row (`length`
        tokens in all)."""
        return self.step.lo + j, self.end + 1 - length

    def finish(self) -> None:
        """After the step's forward: the new column is in the window, the joining rows are rows."""
        step, self.step = self.step, None
        self.end += 1
        self.rows += step.gather.shape[0] if step.gather is not None else 0

    # -- rows leaving and moving ---------------------------------------------------------

    def swap(self, a: list[int], b: list[int]) -> None:
        """Exchange rows a[i] and b[i] (disjoint): only those rows are copied."""
        if not a:
            return
        ia, ib = torch.tensor(a, device=self.device), torch.tensor(b, device=self.device)
        s, e = self.start, self.end
        for buf in (*self.k, *self.v, self.mask):
            view = buf[..., s:e] if buf is self.mask else buf[:, :, s:e]
            rows_a = view[ia].clone()
            view[ia] = view[ib]
            view[ib] = rows_a

    def select(self, keep: list[int]) -> list[int]:
        """Keep only the rows in `keep` (ascending): the last rows move into the holes the
        others leave. Returns the old index of each row, in the new order."""
        order = fill_holes(keep, self.rows)
        self.move(order)
        return order

    def move(self, order: list[int]) -> None:
        """Row i is now old row order[i]; the rows not in `order` are gone (worker/engines/rows.py
        decides the order; only the rows that move are copied)."""
        count = len(order)
        holes = [h for h, m in enumerate(order) if h != m]
        if holes:
            dst = torch.tensor(holes, device=self.device)
            src = torch.tensor([order[h] for h in holes], device=self.device)
            s, e = self.start, self.end
            for buf in (*self.k, *self.v):
                buf[dst, :, s:e] = buf[src, :, s:e]
            self.mask[dst, s:e] = self.mask[src, s:e]
        self.rows = count
        if count == 0:
            self.start = self.end = 0
            return
        # Columns every remaining row masks (on the left) are out of the window from now on.
        used = self.window_mask().any(0).nonzero()
        if used.numel():
            self.start += int(used[0])

    # -- buffers -------------------------------------------------------------------------

    def _slide(self, left: int = SLIDE_LEFT) -> bool:
        """Move the window back to `left`, in place (only its columns are copied), where the
        buffers hold it twice over: a batch that never empties slides right a column a step,
        and new buffers (zeroed, every layer) cost far more than the copy. False: no room."""
        s, e = self.start, self.end
        length = e - s
        if self.mask.shape[1] < left + 2 * length + 1:
            return False
        r = self.rows  # s >= left + length: the old and new columns do not overlap
        for buf in (*self.k, *self.v):
            buf[:r, :, left : left + length] = buf[:r, :, s:e]
        self.mask[:r, left : left + length] = self.mask[:r, s:e]
        self.start, self.end = left, left + length
        return True

    def _realloc(self, rows: int, left: int, right: int) -> None:
        """New buffers with room for `rows` rows, `left` free columns before the window and
        `right` after it; the window's contents move over."""
        layers, heads, head_dim = self.shape
        length = self.length
        cols = left + length + max(right, length)
        room = self.max_columns // cols if self.max_columns else self.max_rows
        cap_rows = max(rows, min(self.max_rows, 2 * self.mask.shape[0], room), 1)
        new = dict(dtype=self.dtype, device=self.device)
        k = [torch.zeros((cap_rows, heads, cols, head_dim), **new) for _ in range(layers)]
        v = [torch.zeros((cap_rows, heads, cols, head_dim), **new) for _ in range(layers)]
        mask = torch.zeros((cap_rows, cols), dtype=torch.long, device=self.device)
        r, s, e = self.rows, self.start, self.end
        if r and length:
            for new, old in zip(k + v, self.k + self.v):
                new[:r, :, left : left + length] = old[:r, :, s:e]
            mask[:r, left : left + length] = self.mask[:r, s:e]
        self.k, self.v, self.mask = k, v, mask
        self.start, self.end = left, left + length

"""A preallocated KV cache for the hf engine's running batch, written in place.

`SlotKV` keeps, per layer, one buffer `[rows, heads, columns, head_dim]` for keys and one for
values, plus the attention mask `[rows, columns]`, and a window `[start, end)` of columns in
use. A decode step writes each row's new key/value into column `end` and attends over a view of
the window, so nothing is copied (transformers' DynamicCache copies the whole cache each step);
admitting or dropping rows copies only those rows, and a step may feed only the first rows
(`step_mask`). Row order changes are returned so that the engine keeps its per-row state in
step. `cache` is the transformers `Cache` the model's forward takes. How the window moves:
docs/design.md, "The KV cache".
"""

from __future__ import annotations

import torch
from transformers import Cache, DynamicCache
from transformers.cache_utils import DynamicLayer


class _SlotLayer(DynamicLayer):
    """One layer of `SlotKV` as transformers sees it."""

    def __init__(self, kv: SlotKV, index: int):
        super().__init__()
        self.kv, self.index = kv, index
        self.is_initialized = True

    def lazy_initialization(self, key_states, value_states) -> None:  # the buffers are the state
        pass

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        kv, n = self.kv, key_states.shape[-2]
        k, v = kv.k[self.index], kv.v[self.index]
        end, rows = kv.end, kv.active
        k[:rows, :, end : end + n] = key_states
        v[:rows, :, end : end + n] = value_states
        self.keys, self.values = k[:rows, :, kv.start : end + n], v[:rows, :, kv.start : end + n]
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.kv.end - self.kv.start

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.kv.end - self.kv.start + query_length, 0


class SlotKV:
    def __init__(
        self,
        layers: int,
        heads: int,
        head_dim: int,
        dtype: torch.dtype,
        max_rows: int,
        device: torch.device | str = "cpu",
    ):
        self.shape = (layers, heads, head_dim)
        self.device = torch.device(device)
        self.dtype, self.max_rows = dtype, max(1, max_rows)
        self.rows = self.start = self.end = 0
        self.active = 0  # the rows the current step feeds: the first `active` ones
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []
        self.mask = torch.zeros((0, 0), dtype=torch.long, device=self.device)
        self.cache = Cache(layers=[_SlotLayer(self, i) for i in range(layers)])

    @classmethod
    def for_model(cls, config, dtype: torch.dtype, max_rows: int, device: torch.device | str = "cpu") -> SlotKV:
        """Buffers shaped for `config`'s layers, key/value heads and head size."""
        heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        return cls(config.num_hidden_layers, heads, head_dim, dtype, max_rows, device)

    @property
    def length(self) -> int:
        return self.end - self.start

    def window_mask(self) -> torch.Tensor:
        return self.mask[: self.rows, self.start : self.end]

    # -- a decode step -------------------------------------------------------------------

    def positions(self, active: int) -> torch.Tensor:
        """The position of the token each of the first `active` rows feeds next: the number
        of tokens the row has fed so far (its unmasked columns), `[active, 1]`. Call it
        before `step_mask`, which unmasks the new column."""
        return self.mask[:active, self.start : self.end].sum(-1, keepdim=True)

    def step_mask(self, active: int | None = None) -> torch.Tensor:
        """The attention mask for one more token in each of the first `active` rows (all by
        default; the model's forward then writes those tokens' keys/values at column `end`);
        call `advance` after the forward. The other rows sit this step out: column `end` is
        masked for them, as left padding is, so they resume later exactly where they were."""
        if self.end >= self.mask.shape[1]:
            self._realloc(self.rows, left=0, right=max(16, self.length))
        self.active = self.rows if active is None else active
        self.mask[: self.active, self.end] = 1
        self.mask[self.active : self.rows, self.end] = 0
        return self.mask[: self.active, self.start : self.end + 1]

    def advance(self) -> None:
        self.end += 1

    # -- rows joining and leaving --------------------------------------------------------

    def append(self, cache: DynamicCache, mask: torch.Tensor) -> None:
        """Add the rows of a prefill (its cache and its `[n, width]` attention mask) after the
        running ones, right-aligned with them."""
        n, width = mask.shape
        if self.rows == 0:  # an empty batch: the window restarts where it has room on the left
            self.start = self.end = width if self.mask.shape[1] >= width + 32 else 0
        grow_left = max(0, width - self.length)
        if self.rows + n > self.mask.shape[0] or grow_left > self.start:
            self._realloc(self.rows + n, left=grow_left + 8, right=32)
        if grow_left:
            # Wider than the window: the running rows gain masked columns on the left.
            self.start -= grow_left
            self.mask[: self.rows, self.start : self.start + grow_left] = 0
        lo, hi = self.rows, self.rows + n
        at = self.end - width
        self.mask[lo:hi, self.start : at] = 0
        self.mask[lo:hi, at : self.end] = mask
        for i, layer in enumerate(cache.layers):
            self.k[i][lo:hi, :, at : self.end] = layer.keys
            self.v[i][lo:hi, :, at : self.end] = layer.values
        self.rows = hi

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
        count = len(keep)
        order = list(range(count))
        kept = set(keep)
        holes = [i for i in range(count) if i not in kept]
        movers = [i for i in keep if i >= count]
        if holes:
            for h, m in zip(holes, movers):
                order[h] = m
            dst, src = torch.tensor(holes, device=self.device), torch.tensor(movers, device=self.device)
            s, e = self.start, self.end
            for buf in (*self.k, *self.v):
                buf[dst, :, s:e] = buf[src, :, s:e]
            self.mask[dst, s:e] = self.mask[src, s:e]
        self.rows = count
        if count == 0:
            self.start = self.end = 0
            return order
        # Columns every remaining row masks (on the left) are out of the window from now on.
        used = self.window_mask().any(0).nonzero()
        if used.numel():
            self.start += int(used[0])
        return order

    # -- buffers -------------------------------------------------------------------------

    def _realloc(self, rows: int, left: int, right: int) -> None:
        """New buffers with room for `rows` rows, `left` free columns before the window and
        `right` after it; the window's contents move over."""
        layers, heads, head_dim = self.shape
        cap_rows = max(rows, min(self.max_rows, 2 * self.mask.shape[0]), 1)
        length = self.length
        cols = left + length + max(right, length)
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

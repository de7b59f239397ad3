"""An embedding model's forward without padding: the inputs packed end to end.

A padded forward computes every layer on `rows x longest` tokens; with inputs of 8 to 50
tokens a fifth or more of them are padding, and the linear layers (most of an encoder's time)
pay for each. Packed, the model runs on one row of exactly the inputs' tokens, each input's
positions counting from 0, and attention alone is computed per input: an attention function
registered with transformers (`genq_varlen`, transformers' `sdpa` wherever no packing is
active) runs PyTorch's SDPA once per run of equal-length inputs (the inputs come sorted by
length, so a run is a contiguous slice). vLLM's CPU runner packs the same way.

`Packer.install` switches a sentence-transformers model to it only where the model's first
module is the transformers encoder and a packed forward gives the padded one's vectors on a
test batch (cosine >= MIN_COSINE); anything else keeps the padded forward.
"""

from __future__ import annotations

import logging
import threading

import torch

log = logging.getLogger(__name__)

NAME = "genq_varlen"
# How close the packed forward's vectors must be to the padded one's for the engine to use it:
# a model that packing breaks (attention across inputs, positions not restarting) is far off.
MIN_COSINE = 0.9995
_active = threading.local()  # .runs: [(start, count, length)] while a packed forward runs


def _attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None, **kwargs):
    """transformers' attention interface: (batch, heads, tokens, dim) in, (batch, tokens, heads,
    dim) out. Packed: per run of equal-length inputs, one SDPA over those inputs as a batch."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    runs = getattr(_active, "runs", None)
    if runs is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout, scaling, is_causal, **kwargs)
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", False)
    groups = getattr(module, "num_key_value_groups", 1)
    heads = query.shape[1]
    out = query.new_empty(query.shape[2], heads, value.shape[3])
    for start, count, length in runs:
        end = start + count * length

        def rows(t: torch.Tensor) -> torch.Tensor:
            return t[0, :, start:end].unflatten(1, (count, length)).transpose(0, 1)

        q, k, v = rows(query), rows(key), rows(value)
        if groups > 1:
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        o = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal and length > 1, scale=scaling)
        out[start:end] = o.transpose(1, 2).reshape(count * length, heads, -1)
    return out.unsqueeze(0), None


def _register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    AttentionInterface.register(NAME, _attention)
    AttentionMaskInterface.register(NAME, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])


def runs_of(lengths: list[int]) -> list[tuple[int, int, int]]:
    """(start token, inputs, length) for each run of equal lengths, in order."""
    out: list[tuple[int, int, int]] = []
    start = 0
    for n in lengths:
        if out and out[-1][2] == n and out[-1][0] + out[-1][1] * n == start:
            s, c, _ = out[-1]
            out[-1] = (s, c + 1, n)
        else:
            out.append((start, 1, n))
        start += n
    return out


def encoder(st):
    """The transformers model that a sentence-transformers model's first module runs, or None
    (another kind of first module)."""
    first = st[0]
    if getattr(first, "module_output_name", "token_embeddings") != "token_embeddings":
        return None
    model = getattr(first, "model", None) or getattr(first, "auto_model", None)
    return model if isinstance(model, torch.nn.Module) and hasattr(model, "config") else None


class Packer:
    """The packed forward of one sentence-transformers model (its modules after the first run
    on the re-padded token embeddings, as sentence-transformers runs them)."""

    def __init__(self, st, model, pad_id: int):
        self.st, self.model, self.pad_id = st, model, pad_id
        self.types = getattr(model.config, "type_vocab_size", 0) > 0  # BERT's token type ids: all 0

    @classmethod
    def install(cls, st, pad_id: int, padded, sample: list[list[int]], longest: int) -> tuple[Packer | None, str]:
        """A Packer if this model computes the same packed (`padded(rows)` is the padded forward,
        `sample` some inputs to compare on, `longest` the most tokens an input may have), else
        None; and what was decided, for the log."""
        model = encoder(st)
        if model is None:
            return None, "padded (the first module is not a transformers model)"
        packer = cls(st, model, pad_id)
        config = model.config
        if getattr(config, "_attn_implementation", None) != "sdpa":
            return None, f"padded (the model's attention is {config._attn_implementation!r}, not sdpa)"
        window = getattr(config, "sliding_window", None) if getattr(config, "use_sliding_window", True) else None
        if isinstance(window, int) and 0 < window < longest:  # per-input attention here has no window
            return None, f"padded (sliding-window attention: {window} tokens, inputs up to {longest})"
        _register()
        try:
            packer.model.set_attn_implementation(NAME)
            want, got = padded(sample), packer(sample)
            worst = torch.nn.functional.cosine_similarity(torch.stack(want), torch.stack(got)).min().item()
        except Exception as exc:  # noqa: BLE001 - any failure keeps the padded forward
            packer.model.set_attn_implementation("sdpa")
            return None, f"padded (a packed forward failed: {type(exc).__name__}: {exc})"
        if worst < MIN_COSINE:
            packer.model.set_attn_implementation("sdpa")
            return None, f"padded (packed vectors differed: lowest cosine {worst:.6f})"
        return packer, f"packed, no padding (lowest cosine to the padded forward {worst:.7f})"

    def __call__(self, rows: list[list[int]]) -> list[torch.Tensor]:
        """The vectors of `rows`, in any order (sorted by length, equal lengths are adjacent and
        each run of them is one attention call)."""
        lengths = [len(r) for r in rows]
        device = next(self.model.parameters()).device
        ids = torch.tensor([t for r in rows for t in r], device=device).unsqueeze(0)
        positions = torch.cat([torch.arange(n) for n in lengths]).to(device).unsqueeze(0)
        _active.runs = runs_of(lengths)
        try:
            kw = {"token_type_ids": torch.zeros_like(ids)} if self.types else {}
            hidden = self.model(input_ids=ids, position_ids=positions, **kw).last_hidden_state[0]
        finally:
            _active.runs = None
        longest = max(lengths)
        mask = torch.arange(longest, device=device).unsqueeze(0) < torch.tensor(lengths, device=device).unsqueeze(1)
        tokens = hidden.new_zeros(len(rows), longest, hidden.shape[-1])
        tokens[mask] = hidden
        padded_ids = torch.full((len(rows), longest), self.pad_id, device=device)
        padded_ids[mask] = ids[0]
        features = {"input_ids": padded_ids, "attention_mask": mask.long(), "token_embeddings": tokens}
        for module in list(self.st)[1:]:
            features = module(features)
        return list(features["sentence_embedding"].float().cpu())

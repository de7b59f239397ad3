"""What the hf engine needs of an architecture to batch it exactly, checked when it loads.

The engine admits rows into a batch that is already decoding, in the same forward as the
running rows' next tokens, so each row's tokens sit at other cache columns than its positions:
that is exact only where the model takes positions from `position_ids` and runs its attention
through transformers' attention interface (the engine's, worker/engines/kvcache.py). `prepare` caps the context of sliding-window and length-dependent rotary models where
they stay exact, and refuses what cannot be batched exactly (encoder-decoders, non-attention
layers, interleaved sliding windows); `probe` refuses a model whose logits for a row joined to
a batch differ from the row's alone. A refusal raises `UnsupportedModel`, naming the
architecture and the reason. Which and why: docs/design.md, "Which architectures batch exactly".
"""

from __future__ import annotations

import inspect
import logging

import torch

log = logging.getLogger(__name__)

# Architectures whose sliding window changes nothing but the attention mask.
_MASK_ONLY_SLIDING = {"mistral", "mixtral", "phi3", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "starcoder2"}
_LENGTH_DEPENDENT_ROPE = {"dynamic", "longrope"}
_ATTENTION_LAYERS = {"full_attention", "sliding_attention"}


class UnsupportedModel(ValueError):
    """The hf engine cannot batch this model exactly."""


def _name(config) -> str:
    archs = getattr(config, "architectures", None) or [config.model_type]
    return f"{archs[0]} ({config.model_type})"


def prepare(config) -> tuple[int | None, list[str]]:
    """Check `config` and adjust it, before the model is built from it, so that batching is
    exact: returns the context the engine may use (None: no limit known) and what was changed,
    for the log. Raises `UnsupportedModel`."""
    name = _name(config)
    if getattr(config, "is_encoder_decoder", False):
        raise UnsupportedModel(f"{name} is an encoder-decoder; the hf engine serves decoder-only models")
    limit = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)
    notes: list[str] = []
    layer_types = getattr(config, "layer_types", None) or []
    other = sorted(set(layer_types) - _ATTENTION_LAYERS)
    if other:
        raise UnsupportedModel(
            f"{name} has {', '.join(other)} layers; the hf engine batches attention layers only "
            "(serve it with the vLLM engine)"
        )
    window = getattr(config, "sliding_window", None)
    if window and (not layer_types or "sliding_attention" in layer_types):
        if config.model_type not in _MASK_ONLY_SLIDING:
            raise UnsupportedModel(
                f"{name} uses sliding-window attention the hf engine cannot batch exactly "
                "(serve it with the vLLM engine)"
            )
        if limit is None or window < limit:
            limit = window
            notes.append(f"context capped at the sliding window ({window} tokens), full attention inside it")
        config.sliding_window = None
        if layer_types:
            config.layer_types = ["full_attention"] * len(layer_types)
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    if isinstance(rope, dict) and rope.get("rope_type", rope.get("type")) in _LENGTH_DEPENDENT_ROPE:
        original = rope.get("original_max_position_embeddings") or getattr(
            config, "original_max_position_embeddings", None
        )
        original = original or getattr(config, "max_position_embeddings", None)
        if original and (limit is None or original < limit):
            limit = original
            notes.append(
                f"context capped at {original} tokens, below which its {rope.get('rope_type')} rotary "
                "frequencies do not change"
            )
    return limit, notes


def probe(lm) -> None:
    """A row joined to a running batch as the engine joins rows (worker/engines/kvcache.py: its
    prompt fed in the same forward as the running row's next token, its keys/values in columns
    other than its positions), then decoded two tokens beside it: the same logits as the model's
    own attention gives the row alone, without a cache, or the model is refused. Random
    token ids, in the model's dtype, on its device; `lm` runs the engine's attention."""
    from worker.engines.kvcache import SlotKV

    name = _name(lm.config)
    if "position_ids" not in inspect.signature(lm.forward).parameters:
        raise UnsupportedModel(f"{name} takes no position_ids; the hf engine cannot batch it exactly")
    gen = torch.Generator().manual_seed(0)
    vocab = lm.config.vocab_size
    long, short = (torch.randint(4, vocab, (n,), generator=gen).tolist() for n in (11, 5))
    follow = torch.randint(4, vocab, (2,), generator=gen).tolist()
    tol = 1e-3 if lm.dtype == torch.float32 else 5e-2
    device = lm.device

    def step(kv: SlotKV, tokens: list[int], active: int, joining: list[int]) -> torch.Tensor:
        positions = kv.begin(active, [len(joining)] if joining else [])
        ids = torch.tensor(tokens + joining, device=device).view(1, -1)
        out = lm(input_ids=ids, position_ids=positions, past_key_values=kv.cache, use_cache=True)
        kv.finish()
        return out.logits[0].float()

    with torch.inference_mode():
        try:
            kv = SlotKV.for_model(lm.config, lm.dtype, 2, device)
            step(kv, [], 0, long)  # the running row: prefilled alone
            step(kv, [follow[0]], 1, [])  # it decodes a step on its own
            got = [step(kv, [follow[1]], 1, short)[-1]]  # the short row joins beside its next step
            for token in follow:
                got.append(step(kv, [follow[0], token], 2, [])[-1])
        except Exception as exc:  # noqa: BLE001 - whatever it is, the engine cannot run this model
            raise UnsupportedModel(
                f"{name} fails in the hf engine's batched forward ({type(exc).__name__}: {exc}); "
                "the hf engine cannot batch it exactly"
            ) from exc
        want = _alone(lm, [short + follow[:i] for i in range(len(follow) + 1)])
    diff = float((torch.stack(got) - want).abs().max())
    scale = max(1.0, float(want.abs().max()))
    if not diff <= tol * scale:
        raise UnsupportedModel(
            f"{name} gives other logits for a row joined to a running batch than for the same "
            f"row alone (max difference {diff:.3g}): the hf engine would return wrong text for it "
            "once jobs overlap"
        )


def _alone(lm, prompts: list[list[int]]) -> torch.Tensor:
    """Each prompt's last logits from the model's own attention (SDPA, which `generate` uses,
    or eager where the model has no SDPA path), no cache. Not eager alone: in bfloat16 eager
    attention's float32 softmax differs from SDPA's by more than the tolerance."""
    attention = lm.config._attn_implementation
    try:
        lm.set_attn_implementation("sdpa")
    except (ValueError, ImportError):
        lm.set_attn_implementation("eager")
    try:
        rows = [lm(input_ids=torch.tensor([p], device=lm.device), use_cache=False).logits[0, -1] for p in prompts]
    finally:
        lm.set_attn_implementation(attention)
    return torch.stack(rows).float()

"""What a development checkpoint is: its sizes (`SHAPES`), architectures (`ARCHS`), special
tokens and chat template. scripts/devmodels.py builds them (and re-exports these names);
docs/design.md, "Offline development checkpoints", says why they are made so.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = [
    "ARCHS",
    "BOS_TOKEN_ID",
    "CHAT_TEMPLATE",
    "EOS_TOKEN_ID",
    "PAD_TOKEN_ID",
    "SHAPES",
    "SPECIAL_TOKENS",
    "TOKENIZER_VOCAB",
    "model_config",
]

#: OPT's special tokens, in id order: ``<s>``=0, ``<pad>``=1, ``</s>``=2, ``<unk>``=3.
SPECIAL_TOKENS = ("<s>", "<pad>", "</s>", "<unk>")
PAD_TOKEN_ID = 1
BOS_TOKEN_ID = 2
EOS_TOKEN_ID = 2

# Settings shared by every shape; these are facebook/opt-125m's values.
_OPT_COMMON: dict[str, Any] = {
    "activation_function": "relu",
    "do_layer_norm_before": True,
    "enable_bias": True,
    "layer_norm_elementwise_affine": True,
    "tie_word_embeddings": True,
    "dropout": 0.1,
    "attention_dropout": 0.0,
    "layerdrop": 0.0,
    "init_std": 0.02,
    "use_cache": True,
    "pad_token_id": PAD_TOKEN_ID,
    "bos_token_id": BOS_TOKEN_ID,
    "eos_token_id": EOS_TOKEN_ID,
}

#: ``OPTConfig`` keyword arguments for each shape.
SHAPES: dict[str, dict[str, Any]] = {
    # Fast CPU tests: ~1M parameters (4 MB); head size 32 (vLLM's CPU backend needs >= 32).
    "tiny": {
        **_OPT_COMMON,
        "vocab_size": 4096,
        "hidden_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "ffn_dim": 512,
        "max_position_embeddings": 512,
        "word_embed_proj_dim": 128,
    },
    # Exactly facebook/opt-125m's shape.
    "opt-125m": {
        **_OPT_COMMON,
        "vocab_size": 50272,
        "hidden_size": 768,
        "num_hidden_layers": 12,
        "num_attention_heads": 12,
        "ffn_dim": 3072,
        "max_position_embeddings": 2048,
        "word_embed_proj_dim": 768,
    },
}

#: Size the tokenizer is trained toward (special tokens included).  It can end smaller when the
#: corpus runs out of pairs to merge; the model's ``vocab_size`` is always at least this large
#: (as in OPT, whose tokenizer has 50265 entries and whose model has 50272 rows).
TOKENIZER_VOCAB: dict[str, int] = {"tiny": 4000, "opt-125m": 50265}

#: A simple chat template in the dev tokenizer (Jinja2, as transformers and vLLM render it):
#: each message as ``<|role|>`` and its text, ended by ``</s>``; content may be a string or a
#: list of text parts.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}{{ part['text'] }}{% endfor %}{% endif %}"
    "{% if not (loop.last and continue_final_message) %}{{ eos_token + '\\n' }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)

# Weight scale of the architectures other than OPT: peaked attention, so that a token fed at a
# wrong position changes the greedy text within a few tokens (docs/design.md).
_INIT = 0.1
_IDS = {"pad_token_id": PAD_TOKEN_ID, "bos_token_id": BOS_TOKEN_ID, "eos_token_id": EOS_TOKEN_ID}


def _rotary(config_class: str, model_class: str, kv_heads: Callable[[int], int] | None = None, **extra: Any):
    """Config kwargs of a decoder with rotary positions (Llama and its kin, GPT-NeoX)."""

    def make(size: dict[str, Any]) -> tuple[str, str, dict[str, Any]]:
        heads = size["num_attention_heads"]
        return (
            config_class,
            model_class,
            {
                "vocab_size": size["vocab_size"],
                "hidden_size": size["hidden_size"],
                "intermediate_size": size["ffn_dim"],
                "num_hidden_layers": size["num_hidden_layers"],
                "num_attention_heads": heads,
                **({"num_key_value_heads": kv_heads(heads)} if kv_heads else {}),
                "max_position_embeddings": size["max_position_embeddings"],
                "initializer_range": _INIT,
                "tie_word_embeddings": False,
                **_IDS,
                **{k: v(size) if callable(v) else v for k, v in extra.items()},
            },
        )

    return make


def _gpt2(size: dict[str, Any]) -> tuple[str, str, dict[str, Any]]:
    return (
        "GPT2Config",
        "GPT2LMHeadModel",
        {
            "vocab_size": size["vocab_size"],
            "n_embd": size["hidden_size"],
            "n_layer": size["num_hidden_layers"],
            "n_head": size["num_attention_heads"],
            "n_inner": size["ffn_dim"],
            "n_positions": size["max_position_embeddings"],
            "initializer_range": _INIT,
            **_IDS,
        },
    )


def _half(heads: int) -> int:
    return max(1, heads // 2)


#: Each architecture ``--arch`` builds: size -> (config class, model class, config kwargs).
#: The sizes are SHAPES' (hidden size, layers, heads, feed-forward width, vocabulary, context).
ARCHS: dict[str, Any] = {
    "opt": None,  # SHAPES itself
    "gpt2": _gpt2,
    "llama": _rotary("LlamaConfig", "LlamaForCausalLM", kv_heads=_half),
    "qwen2": _rotary("Qwen2Config", "Qwen2ForCausalLM", kv_heads=_half),
    # A sliding window shorter than the context, as Mistral 7B v0.1 has (4096 of 32768).
    "mistral": _rotary(
        "MistralConfig",
        "MistralForCausalLM",
        kv_heads=_half,
        sliding_window=lambda size: size["max_position_embeddings"] // 2,
    ),
    "phi3": _rotary("Phi3Config", "Phi3ForCausalLM"),
    "gpt_neox": _rotary(
        "GPTNeoXConfig",
        "GPTNeoXForCausalLM",
        rotary_pct=0.25,  # Pythia's partial rotary
        use_parallel_residual=True,
    ),
    "gemma": _rotary(
        "GemmaConfig",
        "GemmaForCausalLM",
        kv_heads=lambda heads: 1,
        head_dim=lambda size: size["hidden_size"] // size["num_attention_heads"],
    ),
}


def model_config(arch: str, shape: str) -> tuple[str, str, dict[str, Any]]:
    """(config class, model class, config kwargs) of ``arch`` at ``shape``'s size."""
    if arch not in ARCHS:
        raise ValueError(f"unknown arch {arch!r}; choose one of {sorted(ARCHS)}")
    if shape not in SHAPES:
        raise ValueError(f"unknown shape {shape!r}; choose one of {sorted(SHAPES)}")
    if ARCHS[arch] is None:
        return "OPTConfig", "OPTForCausalLM", dict(SHAPES[shape])
    return ARCHS[arch](SHAPES[shape])

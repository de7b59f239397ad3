"""Tests for scripts.devmodels: real builds of the `tiny` shape, loaded through from_pretrained."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from scripts import devmodels

pytestmark = pytest.mark.tooling  # the project's tooling, not the product: `make test-core` skips it

TEXTS = [
    "Hello, my name is",
    "The quick brown fox jumps over the lazy dog.\n\tIndented line,   runs of spaces.",
    "Ünïcödé: naïve café, 日本語のテキスト, Ελληνικά, עברית, emoji 🤖🎉 and ZWJ 👩‍👩‍👧.",
    " leading and trailing spaces ",
    "",
]


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return devmodels.build("tiny", tmp_path_factory.mktemp("ckpt") / "tiny", seed=0)


@pytest.fixture(scope="module")
def tok(tiny):
    return AutoTokenizer.from_pretrained(tiny)


@pytest.fixture(scope="module")
def model(tiny):
    return AutoModelForCausalLM.from_pretrained(tiny).eval()


def test_shapes_opt_125m_is_exactly_facebook_opt_125m():
    cfg = devmodels.SHAPES["opt-125m"]
    expected = {
        "hidden_size": 768,
        "num_hidden_layers": 12,
        "num_attention_heads": 12,
        "ffn_dim": 3072,
        "vocab_size": 50272,
        "max_position_embeddings": 2048,
        "word_embed_proj_dim": 768,
        "do_layer_norm_before": True,
        "activation_function": "relu",
        "tie_word_embeddings": True,
        "pad_token_id": 1,
        "bos_token_id": 2,
        "eos_token_id": 2,
    }
    assert {k: cfg[k] for k in expected} == expected
    assert devmodels.TOKENIZER_VOCAB["opt-125m"] == 50265


@pytest.mark.parametrize("shape", sorted(devmodels.SHAPES))
def test_every_shape_is_consistent(shape):
    cfg = devmodels.SHAPES[shape]
    assert cfg["hidden_size"] % cfg["num_attention_heads"] == 0
    assert cfg["hidden_size"] // cfg["num_attention_heads"] >= 32  # vLLM CPU backend
    assert devmodels.TOKENIZER_VOCAB[shape] <= cfg["vocab_size"]
    assert (cfg["pad_token_id"], cfg["bos_token_id"], cfg["eos_token_id"]) == (1, 2, 2)


def test_tiny_checkpoint_files_and_config(tiny, model):
    for name in (
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        devmodels.MARKER_NAME,
    ):
        assert (tiny / name).is_file(), name
    # Nothing left beside it: no temp or half-written directories.
    assert sorted(p.name for p in tiny.parent.iterdir() if p.is_dir()) == ["tiny"]

    config = AutoConfig.from_pretrained(tiny)
    assert config.model_type == "opt"
    assert config.architectures == ["OPTForCausalLM"]
    for key, value in devmodels.SHAPES["tiny"].items():
        assert getattr(config, key) == value, key
    assert config.hidden_size // config.num_attention_heads >= 32
    assert config.hidden_size <= 256 and config.num_hidden_layers <= 4

    assert type(model).__name__ == "OPTForCausalLM"
    assert model.dtype == torch.float32
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight  # tied
    gen = model.generation_config
    assert (gen.bos_token_id, gen.eos_token_id, gen.pad_token_id) == (2, 2, 1)

    marker = json.loads((tiny / devmodels.MARKER_NAME).read_text())
    assert marker["shape"] == "tiny" and marker["seed"] == 0
    assert marker["format_version"] == devmodels.FORMAT_VERSION


def test_tokenizer_special_tokens(tok, model):
    assert tok.convert_ids_to_tokens([0, 1, 2, 3]) == ["<s>", "<pad>", "</s>", "<unk>"]
    assert (tok.bos_token, tok.bos_token_id) == ("</s>", 2)
    assert (tok.eos_token, tok.eos_token_id) == ("</s>", 2)
    assert (tok.pad_token, tok.pad_token_id) == ("<pad>", 1)
    assert 1000 < len(tok) <= model.config.vocab_size
    assert tok.model_max_length == model.config.max_position_embeddings


@pytest.mark.parametrize("text", TEXTS)
def test_tokenizer_round_trip_and_bos(tok, text):
    ids = tok(text).input_ids
    assert ids[0] == 2
    assert 2 not in ids[1:]
    assert tok.decode(ids, skip_special_tokens=True) == text


def test_tokenizer_is_byte_level_bpe(tok):
    # Common words become single tokens with GPT-2's space marker; no unknowns, ever.
    assert tok.tokenize(" the") == ["Ġthe"]
    ids = tok("\x00\x7f\u200b\U0010fffd").input_ids
    assert 3 not in ids and tok.decode(ids, skip_special_tokens=True) == "\x00\x7f\u200b\U0010fffd"


def test_padding_side_is_settable(tok):
    for side in ("left", "right"):
        tok.padding_side = side
        batch = tok(["Hello, my name is", "Hi"], padding=True, return_tensors="pt")
        short_ids, short_mask = batch.input_ids[1], batch.attention_mask[1]
        pad_positions = short_ids == 1
        assert pad_positions.any()
        assert torch.equal(short_mask, (~pad_positions).long())
        edge = 0 if side == "left" else -1
        assert short_ids[edge] == 1
    tok.padding_side = "right"


def test_greedy_generate_runs_and_is_deterministic(tok, model):
    inputs = tok(["Hello, my name is"], return_tensors="pt")
    first = model.generate(**inputs, max_new_tokens=8, do_sample=False)
    second = model.generate(**inputs, max_new_tokens=8, do_sample=False)
    assert torch.equal(first, second)
    prompt_len = inputs.input_ids.shape[1]
    assert first.shape[1] > prompt_len
    assert torch.equal(first[0, :prompt_len], inputs.input_ids[0])
    assert int(first.max()) < model.config.vocab_size
    assert isinstance(tok.decode(first[0], skip_special_tokens=True), str)


def test_seed_determinism_and_replacement(tiny, tmp_path):
    torch.manual_seed(1234)
    expected_next = torch.rand(3)
    torch.manual_seed(1234)
    other = devmodels.build("tiny", tmp_path / "other", seed=1)
    assert torch.equal(torch.rand(3), expected_next)  # the caller's RNG stream is untouched

    assert _sha(other / "model.safetensors") != _sha(tiny / "model.safetensors")
    # The tokenizer does not depend on the seed.
    assert _sha(other / "tokenizer.json") == _sha(tiny / "tokenizer.json")

    # Asking for seed 0 replaces the seed-1 checkpoint with one byte-identical to `tiny`.
    assert devmodels.ensure("tiny", other, seed=0) == other
    assert _sha(other / "model.safetensors") == _sha(tiny / "model.safetensors")
    assert json.loads((other / devmodels.MARKER_NAME).read_text())["seed"] == 0
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_dir()) == ["other"]


def test_ensure_does_not_rebuild(tiny, capsys):
    weights = tiny / "model.safetensors"
    before = (weights.stat().st_mtime_ns, weights.stat().st_ino)
    assert devmodels.ensure("tiny", tiny, seed=0) == tiny
    assert devmodels.build("tiny", tiny, seed=0) == tiny
    assert devmodels.main(["--shape", "tiny", "--out", str(tiny)]) == 0
    assert "up to date" in capsys.readouterr().out
    assert (weights.stat().st_mtime_ns, weights.stat().st_ino) == before
    assert devmodels.is_built(tiny, "tiny", 0)
    assert not devmodels.is_built(tiny, "tiny", 1)
    assert not devmodels.is_built(tiny, "opt-125m", 0)


def test_refuses_to_replace_foreign_directory(tmp_path):
    foreign = tmp_path / "precious"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("keep me")
    with pytest.raises(FileExistsError):
        devmodels.build("tiny", foreign, force=True)
    assert devmodels.main(["--shape", "tiny", "--out", str(foreign)]) == 2
    assert [p.name for p in foreign.iterdir()] == ["notes.txt"]


def test_failed_build_leaves_old_checkpoint_and_no_debris(tiny, tmp_path, monkeypatch):
    def broken(dest, shape):
        (dest / "tokenizer.json").write_text("{half")
        raise RuntimeError("interrupted")

    monkeypatch.setattr(devmodels, "_write_tokenizer", broken)
    with pytest.raises(RuntimeError, match="interrupted"):
        devmodels.build("tiny", tmp_path / "fresh")
    assert [p.name for p in tmp_path.iterdir() if p.is_dir()] == []

    before = _sha(tiny / "tokenizer.json")
    with pytest.raises(RuntimeError, match="interrupted"):
        devmodels.build("tiny", tiny, force=True)
    assert _sha(tiny / "tokenizer.json") == before
    assert devmodels.is_built(tiny, "tiny", 0)


def test_rejects_bad_arguments(tmp_path):
    with pytest.raises(ValueError):
        devmodels.build("opt-7b", tmp_path / "x")
    with pytest.raises(ValueError):
        devmodels.build("tiny", tmp_path / "x", seed=-1)
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize("arch", sorted(devmodels.ARCHS))
def test_every_arch_has_a_config_of_each_shape(arch):
    for shape in devmodels.SHAPES:
        config_class, model_class, kwargs = devmodels.model_config(arch, shape)
        config = AutoConfig.for_model(_model_type(config_class), **kwargs)
        assert config.num_hidden_layers == devmodels.SHAPES[shape]["num_hidden_layers"]
        assert config.hidden_size // config.num_attention_heads >= 32  # vLLM CPU backend
        assert config.vocab_size >= devmodels.TOKENIZER_VOCAB[shape]


def _model_type(config_class: str) -> str:
    import transformers

    return getattr(transformers, config_class).model_type


def test_arch_checkpoint_loads_as_that_architecture_with_a_chat_template(tmp_path):
    out = devmodels.build("tiny", tmp_path / "llama", arch="llama")
    model = AutoModelForCausalLM.from_pretrained(out)
    assert type(model).__name__ == "LlamaForCausalLM"
    assert model.config.num_key_value_heads < model.config.num_attention_heads  # grouped-query
    assert devmodels.is_built(out, "tiny", arch="llama") and not devmodels.is_built(out, "tiny")
    assert json.loads((out / devmodels.MARKER_NAME).read_text())["arch"] == "llama"
    tok = AutoTokenizer.from_pretrained(out)
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Hi"}]},
    ]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == "</s><|system|>\nBe brief.</s>\n<|user|>\nHi</s>\n<|assistant|>\n"
    assert devmodels.main(["--shape", "tiny", "--arch", "llama", "--out", str(out)]) == 0  # up to date
    assert json.loads((out / "tokenizer_config.json").read_text())["chat_template"] == devmodels.CHAT_TEMPLATE


def test_architectures_of_one_shape_do_not_share_weights(tmp_path):
    llama = AutoModelForCausalLM.from_pretrained(devmodels.build("tiny", tmp_path / "l", arch="llama"))
    mistral = AutoModelForCausalLM.from_pretrained(devmodels.build("tiny", tmp_path / "m", arch="mistral"))
    assert not torch.equal(llama.model.embed_tokens.weight, mistral.model.embed_tokens.weight)

"""GENQ_PACKED_LINEARS: the hf engine's linear layers through oneDNN with packed weights."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from worker.engines import packed


def load(path, dtype=torch.float32):
    return AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype).eval()


def linears(model) -> list[str]:
    return [name for name, m in model.named_modules() if type(m) is torch.nn.Linear]


def test_packed_layers_compute_what_pytorchs_did(tiny_model):
    plain, fast = load(tiny_model), load(tiny_model)
    assert linears(plain), "the checkpoint has linear layers to pack"
    # OPT: each layer's query/key/value as one product
    layers = plain.config.num_hidden_layers
    assert packed.pack(fast) == f"{len(linears(plain))} packed for oneDNN, {3 * layers} of them with their siblings"
    assert linears(fast) == []
    assert isinstance(fast.lm_head, packed.PackedLinear)
    torch.manual_seed(0)
    ids = torch.randint(3, plain.config.vocab_size, (3, 7))
    with torch.inference_mode():
        for rows in (1, 3):  # PACK_ROWS is only a hint: any number of rows works
            a, b = plain(input_ids=ids[:rows]).logits, fast(input_ids=ids[:rows]).logits
            assert a.shape == b.shape
            assert torch.allclose(a, b, rtol=1e-4, atol=1e-5), (a - b).abs().max()
            assert torch.equal(a.argmax(-1), b.argmax(-1))
        # A different result would show: packing must not be an identity on some other weight.
        fast.lm_head.packed = torch.ops.mkldnn._reorder_linear_weight(
            torch.zeros(fast.lm_head.out_features, fast.lm_head.in_features), packed.PACK_ROWS
        )
        assert not torch.allclose(plain(input_ids=ids).logits, fast(input_ids=ids).logits)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_sibling_projections_run_as_one_product(arch, tiny_model):
    """Query/key/value and gate/up are packed together: the model computes what it did, and a
    member called alone, on another input, computes its own product."""
    from scripts import devmodels

    path = devmodels.ensure("tiny", tiny_model.parent / f"tiny-{arch}", arch=arch)
    plain, fast = load(path), load(path)
    layers = plain.config.num_hidden_layers
    assert packed.pack(fast) == f"{len(linears(plain))} packed for oneDNN, {5 * layers} of them with their siblings"
    attn, mlp = fast.model.layers[0].self_attn, fast.model.layers[0].mlp
    assert all(isinstance(m, packed.FusedMember) for m in (attn.q_proj, attn.k_proj, attn.v_proj, mlp.gate_proj))
    assert attn.q_proj.group is attn.v_proj.group and mlp.gate_proj.group is mlp.up_proj.group
    assert isinstance(fast.lm_head, packed.PackedLinear) and isinstance(mlp.down_proj, packed.PackedLinear)
    torch.manual_seed(0)
    ids = torch.randint(3, plain.config.vocab_size, (2, 9))
    with torch.inference_mode():
        a, b = plain(input_ids=ids).logits, fast(input_ids=ids).logits
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-5), (a - b).abs().max()
        assert torch.equal(a.argmax(-1), b.argmax(-1))
        x, y = torch.randn(4, attn.k_proj.in_features), torch.randn(4, attn.k_proj.in_features)
        ref = plain.model.layers[0].self_attn
        assert torch.allclose(attn.k_proj(x), ref.k_proj(x), rtol=1e-4, atol=1e-5)  # alone
        assert torch.allclose(attn.q_proj(y), ref.q_proj(y), rtol=1e-4, atol=1e-5)  # then another input
        assert torch.allclose(attn.v_proj(x), ref.v_proj(x), rtol=1e-4, atol=1e-5)  # not y's


def test_a_dtype_onednn_cannot_pack_here_keeps_pytorchs_layers(tiny_model):
    model = load(tiny_model, torch.bfloat16)
    before = linears(model)
    said = packed.pack(model)
    if said.startswith("PyTorch's"):  # bf16 needs AVX-512 (or AVX-NE-CONVERT) in oneDNN
        assert "cannot pack" in said and linears(model) == before
    else:
        assert said.startswith(f"{len(before)} packed for oneDNN") and linears(model) == []


def test_a_packed_product_that_differs_keeps_pytorchs_layers(tiny_model, monkeypatch):
    model = load(tiny_model)
    before = linears(model)
    monkeypatch.setattr(packed.PackedLinear, "forward", lambda self, x: torch.zeros(*x.shape[:-1], self.out_features))
    assert packed.pack(model) == "PyTorch's (oneDNN's packed product differed from PyTorch's here)"
    assert linears(model) == before


@pytest.mark.parametrize("setting", [True, False])
def test_the_engine_packs_as_set(tiny_model, caplog, setting):
    from tasks.config import Settings
    from worker.engines.hf import HFEngine

    with caplog.at_level("INFO", logger="worker.engines.hf"):
        eng = HFEngine(Settings(model=str(tiny_model), dtype="float32", max_batch_size=2, packed_linears=setting))
    try:
        assert isinstance(eng.lm.lm_head, packed.PackedLinear) is setting
        assert ("linear layers: " in caplog.text) is setting
    finally:
        eng.close()


def test_the_engine_packs_on_the_thread_that_runs_the_model(tiny_model, monkeypatch):
    """A second thread that runs parallel ops slows every step (GNU OpenMP throttles two
    teams on two cores: docs/benchmarks.md); the engine packs on its scheduler thread, the
    one that runs the model, and a packing that fails fails the constructor instead of
    leaving an engine that never starts."""
    import threading

    from tasks.config import Settings
    from worker.engines.hf import HFEngine

    where: list[str] = []
    real_init = packed.PackedLinear.__init__

    def init(self, *args, **kwargs):
        where.append(threading.current_thread().name)
        real_init(self, *args, **kwargs)

    monkeypatch.setattr(packed.PackedLinear, "__init__", init)
    settings = Settings(model=str(tiny_model), dtype="float32", max_batch_size=2, packed_linears=True)
    eng = HFEngine(settings)
    try:
        assert where and set(where) == {eng._thread.name} and eng._thread.name != threading.current_thread().name
    finally:
        eng.close()

    def broken(model):
        raise RuntimeError("no oneDNN today")

    monkeypatch.setattr(packed, "pack", broken)
    with pytest.raises(RuntimeError, match="no oneDNN today"):
        HFEngine(settings)

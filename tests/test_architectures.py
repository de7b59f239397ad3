"""Exact continuous batching for every decoder architecture people serve, not OPT alone.

OPT derives positions from the attention mask; Llama, Qwen2, Mistral, Phi-3, GPT-NeoX, Gemma
and GPT-2 take `position_ids`, and gave wrong text once jobs overlapped while the engine passed
none. Each architecture's random tiny checkpoint (scripts/devmodels.py, weights scaled up so that
a wrong position changes the text within a few tokens) is served with jobs of different lengths
arriving while others decode, and every greedy text must equal `model.generate` of that prompt
alone, in process (packed linears on and off, with preemption) and through the whole queue.
"""

from __future__ import annotations

import shutil
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from scripts import devmodels
from scripts import stack as stackmod
from tasks.config import Settings
from tasks.schemas import JobSpec, SamplingParams
from tests.helpers import ENGINE_PROMPTS
from worker.engines import arch
from worker.engines.hf import HFEngine
from worker.engines.kvcache import ATTENTION

ARCHS = [a for a in sorted(devmodels.ARCHS) if a != "opt"]  # OPT: every other engine test
PROMPTS = ENGINE_PROMPTS + ["y", "def f(x):\n    return x * 2\n" * 3]


@pytest.fixture(scope="module")
def checkpoints(tiny_model):
    root = tiny_model.parent
    return {a: devmodels.ensure("tiny", root / f"tiny-{a}", arch=a) for a in ARCHS}


class Reference:
    """Greedy `model.generate` of one prompt alone, float32."""

    def __init__(self, path):
        self.tok = AutoTokenizer.from_pretrained(path)
        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()

    def __call__(self, prompt: str, n: int) -> str:
        enc = self.tok(prompt, return_tensors="pt")
        with torch.inference_mode():
            out = self.model.generate(**enc, max_new_tokens=n, do_sample=False)
        return self.tok.decode(out[0, enc.input_ids.shape[1] :], skip_special_tokens=True)


def spec(i: int, prompt: str, n: int, priority: int = 0) -> JobSpec:
    return JobSpec(id=f"a{i}", model="t", prompt=prompt, priority=priority, params=SamplingParams(max_new_tokens=n))


# The same parity on a GPU where torch sees one (docs/deploying.md: "On a GPU"); packed linears are a CPU path.
CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
VARIANTS = [
    pytest.param("cpu", True, id="cpu-packed"),
    pytest.param("cpu", False, id="cpu-pytorch-linears"),
    pytest.param("cuda", False, id="cuda", marks=[pytest.mark.cuda, CUDA]),
]


@pytest.mark.parametrize("device,packed", VARIANTS)
@pytest.mark.parametrize("name", ARCHS)
def test_staggered_jobs_and_preemption_match_generate_alone(name, device, packed, checkpoints):
    """Jobs join a batch that is decoding (different prompt lengths, so left padding and rows
    admitted at different columns), background rows give their place to foreground ones and
    resume later (preemption by recompute): every text is generate's of that prompt alone."""
    path = checkpoints[name]
    ref = Reference(path)
    engine = HFEngine(
        Settings(
            model=str(path),
            model_name="t",
            max_batch_size=4,
            reserved_slots=0,
            packed_linears=packed,
            dtype="float32",
            device=device,
        )
    )
    assert engine.device.startswith(device)
    try:
        jobs = []
        # Background jobs fill the batch; foreground ones arrive while they decode and preempt.
        for i, prompt in enumerate(PROMPTS[:4]):
            jobs.append((prompt, 30, engine.submit(spec(i, prompt, 30, priority=1))))
        deadline = time.monotonic() + 60
        while len(engine.scheduler.rows) < 4 and time.monotonic() < deadline:  # all four decoding
            time.sleep(0.002)
        for i, prompt in enumerate(PROMPTS[4:], start=4):
            jobs.append((prompt, 6 + 3 * i, engine.submit(spec(i, prompt, 6 + 3 * i))))
            if i % 2:
                time.sleep(0.03)
        for prompt, n, future in jobs:
            assert future.result(timeout=120).text == ref(prompt, n), (name, prompt)
        assert engine.preemptions > 0  # the resumption path ran
    finally:
        engine.close()


def test_sliding_window_caps_the_context(checkpoints):
    """Mistral's window (half the tiny context here) masks by cache column, not position: the
    engine serves up to the window, with full attention, which inside it is the same."""
    path = checkpoints["mistral"]
    window = AutoConfig.from_pretrained(path).sliding_window
    engine = HFEngine(Settings(model=str(path), model_name="t", max_batch_size=2, dtype="float32"))
    try:
        assert engine.max_model_len == window
        long = "word " * 40
        ref = Reference(path)
        futures = [engine.submit(spec(0, long, 60)), engine.submit(spec(1, "a", 60))]
        assert [f.result(timeout=120).text for f in futures] == [ref(long, 60), ref("a", 60)]
    finally:
        engine.close()


def _config(model_type: str, **kw):
    return AutoConfig.for_model(model_type, **kw)


def test_prepare_caps_or_refuses_what_would_be_inexact():
    limit, notes = arch.prepare(_config("mistral", sliding_window=4096, max_position_embeddings=32768))
    assert limit == 4096 and notes
    cfg = _config(
        "qwen2",
        use_sliding_window=True,
        sliding_window=1024,
        max_window_layers=0,
        num_hidden_layers=2,
        max_position_embeddings=8192,
    )
    assert arch.prepare(cfg)[0] == 1024 and cfg.layer_types == ["full_attention"] * 2
    assert arch.prepare(_config("qwen2", max_position_embeddings=8192))[0] == 8192  # no window
    phi = _config(
        "phi3",
        max_position_embeddings=131072,
        original_max_position_embeddings=4096,
        rope_scaling={
            "rope_type": "longrope",
            "short_factor": [1.0] * 48,
            "long_factor": [2.0] * 48,
            "original_max_position_embeddings": 4096,
        },
    )
    assert arch.prepare(phi)[0] == 4096
    with pytest.raises(arch.UnsupportedModel, match="Gemma2.*sliding"):
        arch.prepare(_config("gemma2", architectures=["Gemma2ForCausalLM"], num_hidden_layers=2))
    with pytest.raises(arch.UnsupportedModel, match="linear_attention"):
        arch.prepare(_config("qwen3_next", num_hidden_layers=4))
    with pytest.raises(arch.UnsupportedModel, match="encoder-decoder"):
        arch.prepare(_config("t5"))


def test_probe_refuses_a_model_the_engine_cannot_run_exactly(checkpoints):
    lm = AutoModelForCausalLM.from_pretrained(
        checkpoints["llama"], dtype=torch.float32, attn_implementation=ATTENTION
    ).eval()
    arch.probe(lm)  # the real model passes
    forward = lm.forward

    def no_positions(*args, position_ids=None, **kw):
        return forward(*args, **kw)

    lm.forward = no_positions
    with pytest.raises(arch.UnsupportedModel, match="LlamaForCausalLM.*joined to a running batch"):
        arch.probe(lm)
    lm.forward = forward
    # Attention that is not the engine's (which reads the step's layout of the cache) fails.
    lm.set_attn_implementation("sdpa")
    with pytest.raises(arch.UnsupportedModel, match="LlamaForCausalLM.*fails in the hf engine's batched forward"):
        arch.probe(lm)


def test_every_architecture_through_the_queue(make_stack, checkpoints):
    """One API, a worker per architecture (half with packed linears, half without): prompts of
    different lengths sent 0.1 s apart to /v1/completions, so that they join running batches;
    each text equal to generate's alone."""
    s = make_stack()
    s.start_api()
    for i, name in enumerate(ARCHS):
        s.start_worker(
            GENQ_MODEL=str(checkpoints[name]),
            GENQ_MODEL_NAME=f"{s.name}-{name}",
            GENQ_PACKED_LINEARS=str(i % 2 == 0).lower(),
            GENQ_MAX_BATCH_SIZE="8",
            GENQ_TORCH_THREADS="1",
        )  # seven workers on a few cores
    models = {f"{s.name}-{name}" for name in ARCHS}
    stackmod.wait_until(
        lambda: models <= {m["id"] for m in s.get("/v1/models").json().get("data", [])},
        180,
        "a worker of every architecture",
        s.procs,
    )
    cards = [m for m in s.get("/v1/models").json()["data"] if m["id"] in models]
    assert all(m["devices"] == ["cpu"] for m in cards)  # GENQ_DEVICE=auto without a GPU

    def complete(name: str, prompt: str, n: int) -> str:
        body = {"model": f"{s.name}-{name}", "prompt": prompt, "max_tokens": n, "temperature": 0}
        resp = s.post("/v1/completions", json=body)
        assert resp.status_code == 200, resp.text
        return resp.json()["choices"][0]["text"]

    with ThreadPoolExecutor(max_workers=24) as pool:
        futures = []
        for k, prompt in enumerate(PROMPTS[:6]):
            for name in ARCHS:
                futures.append((name, prompt, 12 + 2 * k, pool.submit(complete, name, prompt, 12 + 2 * k)))
            time.sleep(0.1)
        got = [(name, prompt, n, f.result(timeout=300)) for name, prompt, n, f in futures]
    refs = {name: Reference(checkpoints[name]) for name in ARCHS}
    wrong = [(name, prompt) for name, prompt, n, text in got if text != refs[name](prompt, n)]
    assert not wrong


def test_a_refused_architecture_stops_its_worker_with_the_reason(make_stack, tiny_model, tmp_path):
    """Gemma 2 interleaves sliding-window layers with other per-layer differences: the worker
    refuses it at load, names the architecture and the reason, and exits non-zero."""
    path = tmp_path / "tiny-gemma2"
    cfg = _config(
        "gemma2",
        architectures=["Gemma2ForCausalLM"],
        vocab_size=4096,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        max_position_embeddings=256,
        sliding_window=64,
        pad_token_id=1,
        bos_token_id=2,
        eos_token_id=2,
    )
    AutoModelForCausalLM.from_config(cfg).save_pretrained(path)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_model / f, path / f)
    s = make_stack()
    proc = s.start_worker(GENQ_MODEL=str(path))
    stackmod.wait_until(lambda: proc.popen.poll() is not None, 120, "the worker to exit", [])
    assert proc.popen.returncode != 0
    log = proc.log.read_text()
    assert "Gemma2ForCausalLM" in log and "sliding" in log


def test_device_setting():
    from worker.engines.base import GenerationError
    from worker.engines.hf import resolve_device

    assert resolve_device("cpu") == torch.device("cpu")
    if torch.cuda.is_available():
        assert resolve_device("auto").type == "cuda" and resolve_device("cuda").index is not None
    else:
        assert resolve_device("auto") == torch.device("cpu")
        with pytest.raises(GenerationError, match="no CUDA device"):
            resolve_device("cuda:0")
    for bad in ("gpu", "cuda:x", "tpu"):
        with pytest.raises(ValueError):
            Settings(device=bad)

"""GENQ_TORCH_THREADS: the hf engine sets torch's thread count when given one, and greedy output
is still model.generate's."""

from __future__ import annotations

import torch

from tasks.config import Settings
from tasks.schemas import JobSpec, SamplingParams
from worker.engines.hf import HFEngine


def test_torch_threads_setting(tiny_model, reference, monkeypatch):
    before = torch.get_num_threads()
    monkeypatch.setenv("GENQ_TORCH_THREADS", "1")
    settings = Settings(model=str(tiny_model), model_name="tiny")
    assert settings.torch_threads == 1
    try:
        engine = HFEngine(settings)
        try:
            assert torch.get_num_threads() == 1
            spec = JobSpec(id="t1", model="tiny", prompt="Hello, my name is", params=SamplingParams(max_new_tokens=12))
            assert engine.submit(spec).result(timeout=120).text == reference("Hello, my name is", 12)
        finally:
            engine.close()
    finally:
        torch.set_num_threads(before)

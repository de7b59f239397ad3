"""The hf engine in process, on the real tiny checkpoint: continuous batching must give exactly
what `model.generate` gives, whatever joins or leaves the batch around a job."""

from __future__ import annotations

import time

import pytest

from tasks.config import Settings
from tasks.schemas import JobSpec, SamplingParams
from worker.engines.base import GenerationError, JobCancelled
from worker.engines.hf import HFEngine


@pytest.fixture(scope="module")
def engine(tiny_model):
    eng = HFEngine(Settings(model=str(tiny_model), model_name="tiny", max_batch_size=6))
    yield eng
    eng.close()


def job(prompt: str, **params) -> JobSpec:
    job.n += 1
    return JobSpec(id=f"job-{job.n}", model="tiny", prompt=prompt, params=SamplingParams(**params))


job.n = 0

PROMPTS = [
    "Hello, my name is",
    "a",
    "The quick brown fox jumps over the lazy dog, and then it jumps back over it again",
    "import os\nimport sys\n",
    "x" * 40,
    "Deep learning",
    "¿Dónde está la biblioteca? 图书馆在哪里",
    "1 2 3 4 5",
]


def test_mixed_lengths_and_staggered_arrivals_match_generate(engine, reference):
    futures = []
    for i, prompt in enumerate(PROMPTS):
        futures.append((prompt, 8 + 5 * i, engine.submit(job(prompt, max_new_tokens=8 + 5 * i))))
        if i % 3 == 2:
            time.sleep(0.02)  # let some jobs start (and some finish) before others arrive
    for prompt, n, fut in futures:
        result = fut.result(timeout=60)
        assert result.text == reference(prompt, n), prompt
        assert result.finish_reason in ("length", "eos")
    # More jobs than the engine's capacity (6) were in flight: the rest waited, none was lost.
    assert max(f.result().batch_size for _, _, f in futures) <= 6


def test_ignore_eos_gives_exactly_max_new_tokens(engine):
    result = engine.submit(job("Hello", max_new_tokens=33, ignore_eos=True)).result(timeout=60)
    assert result.completion_tokens == 33 and result.finish_reason == "length"


def test_stop_strings(engine, reference):
    full = reference(PROMPTS[0], 30)
    stop = full[4:7]
    result = engine.submit(job(PROMPTS[0], max_new_tokens=30, stop=["never-seen", stop])).result(timeout=60)
    assert result.finish_reason == "stop"
    assert result.text == full[: full.index(stop)]


def test_seeded_sampling_is_reproducible(engine):
    params = dict(max_new_tokens=24, temperature=1.0, top_k=50, top_p=0.95, seed=1234)
    a = engine.submit(job("Hello", **params)).result(timeout=60)
    b = engine.submit(job("Hello", **params)).result(timeout=60)
    assert a.text == b.text
    others = {engine.submit(job("Hello", **{**params, "seed": s})).result(timeout=60).text for s in range(4)}
    assert len(others) > 1


def test_prompt_too_long_is_refused_at_submit(engine):
    with pytest.raises(GenerationError) as info:
        engine.submit(job("word " * 600))
    assert info.value.code == "prompt_too_long"
    with pytest.raises(GenerationError):
        engine.submit(job("Hello", max_new_tokens=510))


def test_cancel_a_running_job(engine, reference):
    spec = job("Hello", max_new_tokens=480, ignore_eos=True)
    long = engine.submit(spec)
    other = engine.submit(job(PROMPTS[5], max_new_tokens=20))
    time.sleep(0.05)
    engine.cancel(spec.id)
    with pytest.raises(JobCancelled) as info:
        long.result(timeout=60)
    assert str(info.value) == spec.id
    # The job batched beside it is untouched.
    assert other.result(timeout=60).text == reference(PROMPTS[5], 20)


class RecordingSink:
    def __init__(self):
        self.events = {}

    def emit(self, events, resolved):
        for job_id, ev in events:
            self.events.setdefault(job_id, []).append(ev)
        for future, result in resolved:
            future.set_result(result)


def test_token_events_add_up_to_the_result(tiny_model, reference):
    sink = RecordingSink()
    eng = HFEngine(Settings(model=str(tiny_model), max_batch_size=4), sink)
    try:
        full = reference(PROMPTS[0], 30)
        specs = [
            job(PROMPTS[0], max_new_tokens=30),
            job(PROMPTS[0], max_new_tokens=30, stop=[full[10:14]]),
            job(PROMPTS[6], max_new_tokens=25),
            job("Hello", max_new_tokens=1),
        ]
        futures = [eng.submit(s) for s in specs]
        for spec, fut in zip(specs, futures):
            result = fut.result(timeout=60)
            events = sink.events[spec.id]
            assert [e.index for e in events] == list(range(len(events)))
            assert [e.finish for e in events[:-1]] == [None] * (len(events) - 1)
            assert events[-1].finish == result.finish_reason
            assert events[-1].usage == {
                "prompt_tokens": result.prompt_tokens,
                "completion_tokens": result.completion_tokens,
            }
            assert "".join(e.text for e in events) == result.text
        assert sink.events[specs[1].id][-1].finish == "stop"
        assert futures[1].result().text == full[: full.index(full[10:14])]
    finally:
        eng.close()

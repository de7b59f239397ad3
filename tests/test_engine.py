"""The hf engine in process, on the real tiny checkpoint: continuous batching must give exactly
what `model.generate` gives, whatever joins or leaves the batch around a job."""

from __future__ import annotations

import time

import pytest

from tasks.config import Settings
from tasks.schemas import JobSpec, SamplingParams
from tests.helpers import ENGINE_PROMPTS as PROMPTS
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
                "cached_tokens": result.cached_tokens,
            }
            assert "".join(e.text for e in events) == result.text
        assert sink.events[specs[1].id][-1].finish == "stop"
        assert futures[1].result().text == full[: full.index(full[10:14])]
    finally:
        eng.close()


# -- vLLM's sampling parameters: penalties, min_tokens, stop_token_ids, logprobs ------------


@pytest.fixture(scope="module")
def hf(tiny_model):
    """The tokenizer and model, for references computed directly (model.generate, forward)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model)
    model = AutoModelForCausalLM.from_pretrained(tiny_model).eval()

    def generate(prompt: str, max_new_tokens: int, **kw) -> list[int]:
        enc = tok(prompt, return_tensors="pt")
        with torch.inference_mode():
            out = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False, **kw)
        return out[0, enc.input_ids.shape[1] :].tolist()

    def logits(ids: list[int]):
        """The model's next-token logits after each prefix of `ids` (one forward, no cache)."""
        with torch.inference_mode():
            return model(input_ids=torch.tensor([ids])).logits[0].float()

    return tok, generate, logits


def test_repetition_penalty_matches_generate(engine, hf):
    tok, generate, _ = hf
    # Penalized and neutral jobs share the batch: each must give what model.generate gives.
    cases = [(p, r) for p in PROMPTS[:4] for r in (1.3, 1.0, 0.7)]
    futures = [engine.submit(job(p, max_new_tokens=24, repetition_penalty=r)) for p, r in cases]
    texts = {}
    for (prompt, r), fut in zip(cases, futures):
        expected = generate(prompt, 24, **({"repetition_penalty": r} if r != 1.0 else {}))
        result = fut.result(timeout=60)
        assert result.text == tok.decode(expected, skip_special_tokens=True), (prompt, r)
        texts[prompt, r] = result.text
    # The penalty did something (else this test would not test it).
    assert any(texts[p, 1.3] != texts[p, 1.0] for p in PROMPTS[:4])


def penalized_greedy(logits, prompt_ids: list[int], n: int, presence: float, frequency: float) -> list[int]:
    """Greedy decoding with OpenAI's presence/frequency penalties, computed step by step."""
    out: list[int] = []
    for _ in range(n):
        scores = logits(prompt_ids + out)[-1].clone()
        for t in set(out):
            scores[t] -= frequency * out.count(t) + presence
        out.append(int(scores.argmax()))
    return out


def test_presence_and_frequency_penalties_match_a_direct_computation(engine, hf):
    tok, generate, logits = hf
    cases = [(PROMPTS[0], 1.5, 0.0), (PROMPTS[3], 0.0, 1.2), (PROMPTS[5], 0.8, 0.8), (PROMPTS[7], -1.0, 0.5)]
    futures = [
        engine.submit(job(p, max_new_tokens=20, presence_penalty=pp, frequency_penalty=fp)) for p, pp, fp in cases
    ]
    plain = [engine.submit(job(p, max_new_tokens=20)) for p, _, _ in cases]
    changed = 0
    for (prompt, pp, fp), fut, ref in zip(cases, futures, plain):
        expected = penalized_greedy(logits, tok(prompt).input_ids, 20, pp, fp)
        result = fut.result(timeout=60)
        assert result.text == tok.decode(expected, skip_special_tokens=True), (prompt, pp, fp)
        changed += result.text != ref.result(timeout=60).text
    assert changed


def test_stop_token_ids_end_the_completion_before_the_token(engine, hf):
    tok, generate, _ = hf
    ids = generate(PROMPTS[0], 30)
    k = 5
    stop = ids[k]
    first = ids.index(stop)  # it may occur earlier too
    result = engine.submit(job(PROMPTS[0], max_new_tokens=30, stop_token_ids=[10**9, stop])).result(timeout=60)
    assert result.finish_reason == "stop"
    assert result.completion_tokens == first
    assert result.text == tok.decode(ids[:first], skip_special_tokens=True)


def test_min_tokens_holds_back_stop_token_ids(engine, hf):
    tok, generate, _ = hf
    ids = generate(PROMPTS[2], 40)
    stop = ids[3]
    m = ids.index(stop) + 4
    result = engine.submit(job(PROMPTS[2], max_new_tokens=40, stop_token_ids=[stop], min_tokens=m)).result(timeout=60)
    # transformers' MinNewTokensLengthLogitsProcessor bans its eos_token_id the same way.
    expected = generate(PROMPTS[2], 40, eos_token_id=stop, min_new_tokens=m)
    end = expected.index(stop) if stop in expected else len(expected)
    assert end >= m
    assert result.completion_tokens == end and stop not in expected[:m]
    assert result.text == tok.decode(expected[:end], skip_special_tokens=True)
    assert result.finish_reason == ("stop" if end < 40 else "length")


def test_min_tokens_holds_back_eos(tiny_model, hf):
    """EOS is not ignored: it ends the job as soon as min_tokens allows. The tiny checkpoint's
    random weights almost never choose its real EOS, so this engine is told that a token the
    model does choose early is its EOS (the model, its forward and the step are the real ones)."""
    tok, generate, _ = hf
    ids = generate(PROMPTS[0], 40)
    eos = ids[2]
    eng = HFEngine(Settings(model=str(tiny_model), model_name="tiny", max_batch_size=4))
    eng.eos = eos
    try:
        early = eng.submit(job(PROMPTS[0], max_new_tokens=40))
        held = eng.submit(job(PROMPTS[0], max_new_tokens=40, min_tokens=10))
        ignored = eng.submit(job(PROMPTS[0], max_new_tokens=12, min_tokens=10, ignore_eos=True))
        first = early.result(timeout=60)
        assert first.finish_reason == "eos" and first.completion_tokens == ids.index(eos)
        expected = generate(PROMPTS[0], 40, eos_token_id=eos, min_new_tokens=10)
        end = expected.index(eos) if eos in expected else len(expected)
        result = held.result(timeout=60)
        assert end >= 10 and result.completion_tokens == end
        assert result.text == tok.decode(expected[:end], skip_special_tokens=True)
        assert result.finish_reason == ("eos" if end < 40 else "length")
        # With ignore_eos, min_tokens does not hold EOS back: the plain greedy tokens.
        assert ignored.result(timeout=60).text == tok.decode(ids[:12], skip_special_tokens=True)
    finally:
        eng.close()


def test_logprobs_match_a_forward_pass(engine, hf):
    import torch

    tok, generate, logits = hf
    prompt = PROMPTS[5]
    # Beside a penalized job: log-probabilities are the raw distribution's, whatever the batch.
    other = engine.submit(job(PROMPTS[0], max_new_tokens=16, repetition_penalty=1.5, logprobs=5))
    result = engine.submit(job(prompt, max_new_tokens=16, logprobs=3)).result(timeout=60)
    ids = generate(prompt, 16)
    assert result.text == tok.decode(ids, skip_special_tokens=True)
    lp = result.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 16
    prompt_ids = tok(prompt).input_ids
    expected = torch.log_softmax(logits(prompt_ids + ids), -1)[len(prompt_ids) - 1 :]
    offset = 0
    for i, token in enumerate(ids):
        assert lp.tokens[i] == tok.decode([token])
        assert lp.token_logprobs[i] == pytest.approx(expected[i, token].item(), abs=1e-4)
        values, top = expected[i].topk(3)
        want = {tok.decode([t]): v for t, v in zip(top.tolist(), values.tolist())}
        want.setdefault(lp.tokens[i], lp.token_logprobs[i])
        assert lp.top_logprobs[i].keys() == want.keys()
        assert list(lp.top_logprobs[i].values()) == pytest.approx(list(want.values()), abs=1e-4)
        assert lp.text_offset[i] == offset
        offset += len(lp.tokens[i])
    penalized = other.result(timeout=60)
    assert len(penalized.logprobs.tokens) == penalized.completion_tokens
    assert all(len(top) in (5, 6) for top in penalized.logprobs.top_logprobs)
    # Without the parameter, none.
    assert engine.submit(job(prompt, max_new_tokens=4)).result(timeout=60).logprobs is None


def test_streamed_logprobs_add_up_to_the_result(tiny_model):
    sink = RecordingSink()
    eng = HFEngine(Settings(model=str(tiny_model), max_batch_size=4), sink)
    try:
        specs = [
            job(PROMPTS[0], max_new_tokens=20, logprobs=2, stop=["zz"]),
            job(PROMPTS[6], max_new_tokens=12, logprobs=0),
        ]
        futures = [eng.submit(s) for s in specs]
        for spec, fut in zip(specs, futures):
            result = fut.result(timeout=60)
            streamed = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
            for ev in sink.events[spec.id]:
                for name, values in (ev.logprobs or {}).items():
                    streamed[name] += values
            assert streamed == result.logprobs.model_dump()
            assert len(streamed["tokens"]) == result.completion_tokens
        # logprobs=0: the chosen token's alone.
        assert all(len(top) == 1 for top in futures[1].result().logprobs.top_logprobs)
    finally:
        eng.close()


# -- background jobs (priority > 0: batch lines) beside foreground ones ------------------------


class OrderedSink:
    """Every token event in the order the engine emitted them."""

    def __init__(self):
        self.log: list[tuple[str, object]] = []

    def emit(self, events, resolved):
        self.log.extend(events)
        for future, result in resolved:
            future.set_result(result)

    def count(self, job_id: str) -> int:
        return sum(1 for j, _ in list(self.log) if j == job_id)


def test_background_jobs_sit_steps_out_while_foreground_jobs_run(tiny_model, hf):
    """While a foreground job runs, background jobs take one decode step in
    GENQ_BACKGROUND_STEP_EVERY (here 4), not every step: a foreground request beside a large
    batch is not slowed to the batch's pace. Paused or not, every job's text is exactly what
    model.generate gives (a background row's masked columns change nothing), also with a
    repetition penalty whose counts must follow only the rows that stepped."""
    tok, generate, _ = hf
    sink = OrderedSink()
    eng = HFEngine(Settings(model=str(tiny_model), max_batch_size=6, background_step_every=4), sink)
    try:

        def spec(prompt, priority, n, **params):
            return job(prompt, max_new_tokens=n, **params).model_copy(update={"priority": priority})

        background = [spec(PROMPTS[0], 4, 60), spec(PROMPTS[3], 1, 60, repetition_penalty=1.3), spec(PROMPTS[5], 4, 60)]
        back = [eng.submit(s) for s in background]
        deadline = time.monotonic() + 60
        while min(sink.count(s.id) for s in background) < 3:  # all three are running
            assert time.monotonic() < deadline, "the background jobs did not start"
            time.sleep(0.005)
        foreground = [spec(PROMPTS[2], 0, 24), spec(PROMPTS[7], -2, 20)]
        fore = [eng.submit(s) for s in foreground]
        results = [f.result(timeout=120) for f in fore + back]

        for s, result in zip(foreground + background, results):
            kw = {"repetition_penalty": 1.3} if s.params.repetition_penalty != 1.0 else {}
            expected = tok.decode(generate(s.prompt, s.params.max_new_tokens, **kw), skip_special_tokens=True)
            assert result.text == expected, s.prompt
        # The test means something only if the background jobs outlived the foreground ones.
        assert all(r.completion_tokens == 60 for r in results[2:]), [r.completion_tokens for r in results]

        order = [j for j, _ in sink.log]
        first = min(order.index(s.id) for s in foreground)
        last = max(len(order) - 1 - order[::-1].index(s.id) for s in foreground)
        during = order[first : last + 1]
        fg_steps = max(during.count(s.id) for s in foreground)
        assert fg_steps >= 20
        for s in background:
            # One step in four (the foreground's prefill step feeds no background row).
            assert 1 <= during.count(s.id) <= fg_steps // 4 + 2, (during.count(s.id), fg_steps)
    finally:
        eng.close()


def test_a_foreground_job_preempts_a_background_row_which_goes_on_exactly(tiny_model, hf):
    """Background jobs (batch lines) fill all four rows; a foreground job that arrives takes
    the row of the one cheapest to take up again (the shortest prompt and output) at once,
    instead of waiting for one to finish. The preempted job keeps its tokens and, prefilled
    with them when a row frees, goes on: its text is what it gives without preemption (also
    with its penalties, which must count the tokens it had), its stream has every token once."""
    tok, generate, _ = hf
    sink = OrderedSink()
    eng = HFEngine(Settings(model=str(tiny_model), max_batch_size=4, reserved_slots=1), sink)
    pen = dict(presence_penalty=1.5, frequency_penalty=1.5)
    try:
        assert (eng.capacity, eng.reserved) == (4, 1)
        background = [
            job(p, max_new_tokens=40, **(pen if p == "a" else {})).model_copy(update={"priority": 4})
            for p in PROMPTS[:4]
        ]
        back = [eng.submit(s) for s in background]
        deadline = time.monotonic() + 60
        while min(sink.count(s.id) for s in background) < 3:  # all four run
            assert time.monotonic() < deadline, "the background jobs did not start"
            time.sleep(0.005)
        fore = job(PROMPTS[6], max_new_tokens=8)
        result = eng.submit(fore).result(timeout=60)
        results = [f.result(timeout=120) for f in back]
        alone = eng.submit(job("a", max_new_tokens=40, **pen)).result(timeout=60)
    finally:
        eng.close()
    assert eng.preemptions == 1
    assert result.text == tok.decode(generate(fore.prompt, 8), skip_special_tokens=True)
    finals = [j for j, ev in sink.log if ev.finish is not None]
    assert finals[0] == fore.id, "the foreground job waited for a background job to finish"
    preempted = background[1]  # "a": one token of prompt
    for s, r in zip(background, results):
        assert r.completion_tokens == 40 and r.batch_size <= 4
        if s is not preempted:
            assert r.text == tok.decode(generate(s.prompt, 40), skip_special_tokens=True), s.prompt
    assert results[1].text == alone.text
    events = [ev for j, ev in sink.log if j == preempted.id]
    assert [ev.index for ev in events] == list(range(len(events)))
    assert "".join(ev.text for ev in events) == results[1].text
    # It sat out the foreground job's run: none of its events came between the foreground
    # job's first and last.
    order = [j for j, _ in sink.log]
    first, last = order.index(fore.id), len(order) - 1 - order[::-1].index(fore.id)
    assert preempted.id not in order[first : last + 1]

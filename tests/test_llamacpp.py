"""The llamacpp engine (worker/engines/llamacpp.py): a quantized GGUF file served by llama.cpp's
kernels, on real models of two architectures (SmolLM2-135M-Instruct Q4_1, a Llama; and
Qwen2.5-Coder-0.5B-Instruct Q4_K_M, a Qwen2): the answers, greedy decoding under continuous
batching equal to each job run alone, the KV cache's budget, and the whole queue."""

from __future__ import annotations

import json
import re
import time

import pytest
import requests

from scripts import ggufmodels, realmodel
from tasks.config import Settings
from tasks.schemas import JobSpec, SamplingParams
from worker.engines.base import GenerationError
from worker.engines.llamacpp import LlamaCppEngine, _common

QUESTION = "What is the capital of France?"
# Prompts whose greedy answers have wide margins on both models (copying): llama.cpp's logits
# for a sequence move by up to ~0.6 with what else is in its batch (docs/design.md), so a near
# tie may flip under batching, as it does in llama-server; a batch that mixed up rows,
# positions or caches would garble these.
PROMPTS = tuple(
    f"Repeat exactly: {words}"
    for words in ("apple banana cherry grape", "red green blue yellow", "north south east west")
)


@pytest.fixture(scope="module", params=["smollm2", "qwen05"])
def gguf(request):
    path = realmodel.find_gguf() if request.param == "smollm2" else ggufmodels.ensure("qwen05")
    return request.param, path


@pytest.fixture(scope="module")
def engine(gguf):
    name, path = gguf
    eng = LlamaCppEngine(Settings(model=str(path), model_name=name, max_batch_size=4))
    yield eng
    eng.close()


def chat(engine, text: str) -> list[int]:
    """The conversation's tokens, as the worker renders a chat job (its template)."""
    ids = engine.tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
    return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)


def job(engine, text: str, **params) -> JobSpec:
    job.n += 1
    params.setdefault("max_new_tokens", 24)
    return JobSpec(
        id=f"job-{job.n}",
        model=engine.model,
        prompt="",
        prompt_token_ids=chat(engine, text),
        params=SamplingParams(**params),
    )


job.n = 0


def words(text: str) -> list[str]:
    return re.sub(r"[^a-z ]+", " ", text.lower().replace("repeat exactly:", "")).split()


# SmolLM2 through llama.cpp answers QUESTION with French verse (transformers, on the same
# weights, with Paris; also from a Q8_0 file llama.cpp's own converter made of the float
# checkpoint): the other tests hold for it, as they compare llama.cpp with itself.
@pytest.mark.parametrize("gguf", ["qwen05"], indirect=True)
def test_a_real_model_answers(engine):
    result = engine.submit(job(engine, QUESTION, max_new_tokens=32)).result(timeout=120)
    assert "Paris" in result.text
    assert result.finish_reason == "eos"  # the model's own end (the chat template's end token)


def test_greedy_under_continuous_batching_equals_each_job_alone(engine):
    alone = [words(engine.submit(job(engine, p, max_new_tokens=16)).result(timeout=120).text) for p in PROMPTS]
    assert sum(a[:4] == p.split(": ")[1].split() for p, a in zip(PROMPTS, alone)) >= 2  # the models copy
    # Jobs arrive while others run: two at once, the others a few steps later, and again with
    # more jobs than the engine's 4 rows (the rest wait and join as rows leave).
    for prompts in (PROMPTS, PROMPTS + PROMPTS[::-1]):
        futures = []
        for i, p in enumerate(prompts):
            futures.append(engine.submit(job(engine, p, max_new_tokens=16)))
            if i % 2:
                time.sleep(0.15)
        together = [f.result(timeout=120) for f in futures]
        assert max(r.batch_size for r in together) > 1  # they did overlap
        # Each job's own words, in its own order, as alone (the first three: where punctuation
        # or a near tie later flips, the words still say whose answer it is).
        assert [words(r.text)[:3] for r in together] == [alone[PROMPTS.index(p)][:3] for p in prompts]


def test_seeded_sampling_is_reproducible_and_differs_by_seed(engine):
    params = dict(max_new_tokens=24, temperature=1.0, top_p=0.95, ignore_eos=True)
    story = "Tell me a story about a cat."
    a = engine.submit(job(engine, story, seed=7, **params)).result(timeout=120).text
    b = engine.submit(job(engine, story, seed=7, **params)).result(timeout=120).text
    c = engine.submit(job(engine, story, seed=8, **params)).result(timeout=120).text
    assert a == b and a != c


def test_stop_strings_and_logprobs(engine):
    full = engine.submit(job(engine, PROMPTS[1], ignore_eos=True, logprobs=2)).result(timeout=120)
    assert len(full.logprobs.tokens) == full.completion_tokens == 24
    assert all(lp <= 0 for lp in full.logprobs.token_logprobs)
    stop = full.text[6:10]
    cut = engine.submit(job(engine, PROMPTS[1], ignore_eos=True, stop=[stop])).result(timeout=120)
    assert cut.finish_reason == "stop" and cut.text == full.text[: full.text.index(stop)]


def test_the_kv_budget_bounds_a_job_and_makes_jobs_wait_their_turn():
    """A KV cache of 256 tokens: a job that cannot fit is refused at once; two jobs that each
    fit but not together run one after the other, both whole; the first one's kept cells go
    to make room for the second (llama_decode would find no room for it otherwise), and the
    second's stay for a short job with its prompt."""
    path = realmodel.find_gguf()
    eng = LlamaCppEngine(Settings(model=str(path), model_name="s", max_batch_size=4, kv_cache_gib=1e-4))
    try:
        assert eng.max_model_len == eng.llm.cells == 256
        with pytest.raises(GenerationError) as err:
            eng.submit(job(eng, QUESTION, max_new_tokens=250))
        assert err.value.code == "prompt_too_long"
        jobs = [job(eng, p, max_new_tokens=150, ignore_eos=True) for p in PROMPTS[:2]]
        results = [f.result(timeout=120) for f in [eng.submit(j) for j in jobs]]
        assert [r.completion_tokens for r in results] == [150, 150]
        assert [r.batch_size for r in results] == [1, 1]
        assert results[1].cached_tokens == 0  # the first job's cells went: both would not fit
        again = eng.submit(job(eng, PROMPTS[1], max_new_tokens=8)).result(timeout=120)
        assert again.cached_tokens == again.prompt_tokens - 1
        assert words(again.text)[:3] == words(results[1].text)[:3]
    finally:
        eng.close()


WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}


def sse_deltas(resp) -> list[dict]:
    out = []
    for line in resp.iter_lines(decode_unicode=True):
        if line.startswith("data: ") and line != "data: [DONE]":
            out += [c for c in json.loads(line[6:]).get("choices", [])]
    return out


def test_a_gguf_through_the_queue(make_stack):
    """The whole path: the API, a llamacpp worker (a real Celery worker process), a chat
    completion, blocking and streamed; and a tool call of
    Qwen2.5-Coder-0.5B's, which writes it as bare JSON, not the Hermes markup of its template
    (GENQ_TOOL_CALL_PARSER=hermes takes both)."""
    s = make_stack(
        GENQ_ENGINE="llamacpp",
        GENQ_MODEL=str(ggufmodels.ensure("qwen05")),
        GENQ_MAX_BATCH_SIZE="8",
        GENQ_TOOL_CALL_PARSER="hermes",
    )
    s.start_api()
    s.start_worker()
    s.wait_ready(timeout=120)
    # Greedy: chat's default temperature is 1.0, at which the answer is a draw ("India" once, in CI).
    body = {
        "model": s.name,
        "messages": [{"role": "user", "content": QUESTION}],
        "max_tokens": 32,
        "temperature": 0,
    }
    r = s.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    answer = r.json()["choices"][0]["message"]["content"]
    assert "Paris" in answer
    with requests.post(
        s.base + "/v1/chat/completions", json={**body, "stream": True}, stream=True, timeout=120
    ) as resp:
        assert resp.status_code == 200
        streamed = [c.get("delta", {}).get("content") or "" for c in sse_deltas(resp)]
    # An answer of its own, not the blocking one's text: a greedy job run again may take other
    # tokens at a near tie, even the first (llama.cpp's logits move with where its keys/values
    # lie and how its prompt was fed: docs/design.md; seen here: "Certainly! The capital of
    # France is Paris." after "The capital of France is Paris.", and "... is Marseille.").
    assert len(streamed) > 3 and "France" in "".join(streamed), streamed
    bad = s.post("/v1/chat/completions", json={**body, "max_tokens": 10**6})
    assert bad.status_code == 400, bad.text
    # A tool call (greedy: `{"name": "get_weather", "arguments": {"city": "Paris"}}`, bare).
    ask = {"role": "user", "content": "What is the weather in Paris?"}
    tools = {**body, "messages": [ask], "tools": [WEATHER_TOOL], "max_tokens": 64, "temperature": 0}
    r = s.post("/v1/chat/completions", json=tools)
    assert r.status_code == 200, r.text
    (choice,) = r.json()["choices"]
    assert choice["finish_reason"] == "tool_calls" and not choice["message"]["content"], choice
    (call,) = choice["message"]["tool_calls"]
    assert call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris"}
    with requests.post(
        s.base + "/v1/chat/completions", json={**tools, "stream": True}, stream=True, timeout=120
    ) as resp:
        deltas = sse_deltas(resp)
    calls = [tc for c in deltas for tc in c.get("delta", {}).get("tool_calls") or []]
    assert [tc["function"].get("name") for tc in calls if tc.get("id")] == ["get_weather"]
    assert json.loads("".join(tc["function"].get("arguments") or "" for tc in calls)) == {"city": "Paris"}
    assert not "".join(c.get("delta", {}).get("content") or "" for c in deltas)
    assert deltas[-1]["finish_reason"] == "tool_calls"


def test_split_kv_streams_bound_each_job_and_keep_prompts_for_the_next():
    """GENQ_LLAMACPP_KV=split: a KV stream of 256 tokens per row. A job that cannot fit its
    stream is refused at once; jobs that each fit run together whatever their sum (the
    shared cache would make them wait); a job whose prompt a free stream still holds feeds
    only the rest (usage's cached_tokens), with each job's own answer as before."""
    path = ggufmodels.ensure("qwen05")
    settings = Settings(model=str(path), model_name="q", max_batch_size=4, kv_cache_gib=0.012, llamacpp_kv="split")
    eng = LlamaCppEngine(settings)
    try:
        assert eng.llm.row_cells == eng.max_model_len == 256 and eng.llm.cells == 4 * 256
        with pytest.raises(GenerationError) as err:
            eng.submit(job(eng, QUESTION, max_new_tokens=250))
        assert err.value.code == "prompt_too_long"
        alone = [eng.submit(job(eng, p, max_new_tokens=16)).result(timeout=120) for p in PROMPTS]
        # The first job found nothing kept; the next ones the chat template's system prompt
        # and "Repeat exactly:" of the job before.
        assert alone[0].cached_tokens == 0 and all(10 < a.cached_tokens < a.prompt_tokens - 4 for a in alone[1:])
        # More tokens in all than one stream holds, at once, twice (the second time in the
        # other order: sequences 0, 1, 2 hold the third, second and first prompts).
        for order in (PROMPTS[::-1], PROMPTS):
            jobs = [job(eng, p, max_new_tokens=200, ignore_eos=True) for p in order]
            together = [f.result(timeout=300) for f in [eng.submit(j) for j in jobs]]
            assert [r.completion_tokens for r in together] == [200] * 3 and max(r.batch_size for r in together) > 1
            assert [words(r.text)[:3] for r in together] == [words(alone[PROMPTS.index(p)].text)[:3] for p in order]
        # The first two found their whole prompt kept (the first in another stream, copied);
        # the third's stream was the first's target (the lowest free one is taken).
        assert [r.cached_tokens == r.prompt_tokens - 1 for r in together] == [True, True, False]
        assert together[2].cached_tokens > 10
    finally:
        eng.close()


@pytest.mark.parametrize("gguf", ["smollm2", "qwen05"], indirect=True)
def test_the_shared_cache_shares_a_running_jobs_prompt_prefix(engine):
    """GENQ_LLAMACPP_KV=shared: a job takes the prefix of its prompt that a job before it left
    in the cache, or that a running one holds (the chat template's system prompt, "Repeat
    exactly:"), from that sequence's cells instead of computing it again (usage's
    cached_tokens), and still answers as alone."""
    alone = [engine.submit(job(engine, p, max_new_tokens=16)).result(timeout=120) for p in PROMPTS]
    repeat = _common(chat(engine, PROMPTS[0]), chat(engine, PROMPTS[1]))
    assert all(a.cached_tokens >= repeat for a in alone[1:]), [a.cached_tokens for a in alone]
    again = engine.submit(job(engine, PROMPTS[2], max_new_tokens=16)).result(timeout=120)
    assert again.cached_tokens == again.prompt_tokens - 1 and words(again.text) == words(alone[2].text)
    runner = engine.submit(job(engine, "Count from one to a hundred.", max_new_tokens=120, ignore_eos=True))
    deadline = time.monotonic() + 60
    while not engine.runner.sids and time.monotonic() < deadline:  # its prompt is in the cache
        time.sleep(0.01)
    hits = engine.runner.hits
    beside = [engine.submit(job(engine, p, max_new_tokens=16)) for p in PROMPTS]
    beside = [f.result(timeout=120) for f in beside]
    assert not runner.done() or runner.result().batch_size > 1, "the long job ran alone: nothing overlapped"
    runner.result(timeout=300)
    chat_prefix = _common(chat(engine, PROMPTS[0]), chat(engine, "Count from one to a hundred."))
    assert chat_prefix > 3
    assert all(b.cached_tokens >= chat_prefix for b in beside), [b.cached_tokens for b in beside]
    assert engine.runner.hits - hits == sum(b.cached_tokens for b in beside)
    assert [words(b.text)[:3] for b in beside] == [words(a.text)[:3] for a in alone]

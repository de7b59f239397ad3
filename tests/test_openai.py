"""The official `openai` client against a live genqueue: completions, streamed completions, the
models list, errors."""

from __future__ import annotations

import json
import uuid

import openai
import pytest
import requests
from helpers import stream, submit

from webapp.protocol.common import N_MAX


@pytest.fixture(scope="module")
def client(hf_stack):
    with openai.OpenAI(base_url=hf_stack.base + "/v1", api_key="unused", max_retries=0) as c:
        yield c


def test_completion(client, hf_stack, reference):
    out = client.completions.create(model=hf_stack.name, prompt="Hello, my name is", max_tokens=12, temperature=0)
    assert out.object == "text_completion" and out.model == hf_stack.name
    (choice,) = out.choices
    assert choice.text == reference("Hello, my name is", 12)
    assert choice.finish_reason == "length" and choice.index == 0
    assert out.usage.completion_tokens == 12 and out.usage.total_tokens == out.usage.prompt_tokens + 12


def test_several_prompts_keep_their_order(client, hf_stack, reference):
    prompts = ["Hello, my name is", "The capital of France is", "def f(x):"]
    out = client.completions.create(model=hf_stack.name, prompt=prompts, max_tokens=6, temperature=0, echo=True)
    assert [c.index for c in out.choices] == [0, 1, 2]
    assert [c.text for c in out.choices] == [p + reference(p, 6) for p in prompts]


def test_streamed_completion_equals_the_plain_one(client, hf_stack):
    kw = dict(model=hf_stack.name, prompt="Once upon a time", max_tokens=20, temperature=0)
    plain = client.completions.create(**kw).choices[0]
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == plain.text
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == "length" and set(finishes[:-1]) == {None}
    assert chunks[-1].usage.completion_tokens == 20


def test_stop_and_seeded_sampling(client, hf_stack):
    kw = dict(model=hf_stack.name, prompt="Hello", max_tokens=16, temperature=0.8, seed=5)
    a = client.completions.create(**kw).choices[0].text
    assert client.completions.create(**kw).choices[0].text == a
    if len(a) > 4:
        stopped = client.completions.create(stop=[a[2:4]], **kw).choices[0]
        assert stopped.finish_reason == "stop" and stopped.text == a[: a.index(a[2:4])]


def test_models_lists_what_live_workers_serve(client, hf_stack):
    models = client.models.list()
    ids = [m.id for m in models.data]
    assert hf_stack.name in ids
    one = client.models.retrieve(hf_stack.name)  # GET /v1/models/{id}
    assert one.id == hf_stack.name and one.object == "model"
    with pytest.raises(openai.NotFoundError) as info:
        client.models.retrieve("no-such/model")
    assert info.value.code == "model_not_found"
    assert requests.get(hf_stack.base + "/health", timeout=10).status_code == 200  # vLLM's probe path


def test_errors_in_openai_format(client, hf_stack):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=hf_stack.name, prompt="Hi", n=N_MAX + 1)
    assert info.value.body["param"] == "n" and info.value.body["type"] == "invalid_request_error"
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=hf_stack.name, prompt="Hi", extra_body={"frobnicate": 10})
    assert info.value.body["param"] == "frobnicate" and info.value.code == "invalid_request"
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="no-such-model", prompt="Hi")
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=hf_stack.name, prompt="Hi", max_tokens=0)
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=hf_stack.name, prompt="word " * 600, max_tokens=4)
    assert info.value.code == "prompt_too_long"


# -- vLLM's sampling parameters ---------------------------------------------------------------

# What clients written for vLLM (LangChain's VLLMOpenAI, LiteLLM's hosted_vllm, scripts) send
# along, at values that change nothing.
NEUTRAL = dict(n=1, best_of=1, logprobs=None, presence_penalty=0, frequency_penalty=0, logit_bias=None, seed=None)
VLLM_NEUTRAL = {
    "repetition_penalty": 1.0,
    "min_tokens": 0,
    "stop_token_ids": [],
    "top_k": -1,
    "min_p": 0.0,
    "use_beam_search": False,
    "length_penalty": 1.0,
    "include_stop_str_in_output": False,
    "skip_special_tokens": True,
    "spaces_between_special_tokens": True,
    "add_special_tokens": True,
    "truncate_prompt_tokens": None,
    "allowed_token_ids": None,
    "prompt_logprobs": None,
    "response_format": None,
    "guided_json": None,
    "return_tokens_as_token_ids": False,
    "request_id": "req-1",
    "cache_salt": "salt",
    "priority": 0,
}


def test_neutral_vllm_parameters_change_nothing(client, hf_stack, reference):
    out = client.completions.create(
        model=hf_stack.name,
        prompt="Hello, my name is",
        max_tokens=12,
        temperature=0,
        **NEUTRAL,
        extra_body=VLLM_NEUTRAL,
    )
    (choice,) = out.choices
    assert choice.text == reference("Hello, my name is", 12) and choice.logprobs is None
    # The same explicitly as JSON null, as some clients send them.
    nulls = {
        k: None
        for k in (
            "n",
            "presence_penalty",
            "frequency_penalty",
            "repetition_penalty",
            "top_k",
            "temperature",
            "top_p",
            "min_tokens",
            "stop_token_ids",
            "echo",
            "stream",
        )
    }
    body = {"model": hf_stack.name, "prompt": "Hello, my name is", "max_tokens": 12, **nulls}
    resp = hf_stack.post("/v1/completions", json={**body, "temperature": 0})
    assert resp.status_code == 200, resp.text
    assert resp.json()["choices"][0]["text"] == choice.text


def test_logprobs_in_completions_and_stream_chunks(client, hf_stack, reference):
    kw = dict(model=hf_stack.name, prompt="Once upon a time", max_tokens=10, temperature=0, logprobs=3)
    choice = client.completions.create(**kw).choices[0]
    assert choice.text == reference("Once upon a time", 10)
    lp = choice.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 10
    assert all(v <= 0 for v in lp.token_logprobs)
    for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert top[token] == value and len(top) in (3, 4)
        assert value == max(top.values())  # greedy: the likeliest token (raw logits)
    assert lp.text_offset == [sum(map(len, lp.tokens[:i])) for i in range(10)]
    # Streamed: each chunk carries the log-probabilities of its own tokens; together the same.
    chunks = [c for c in client.completions.create(stream=True, **kw) if c.choices]
    streamed = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for c in chunks:
        for name in streamed:
            streamed[name] += getattr(c.choices[0].logprobs, name) if c.choices[0].logprobs else []
    assert streamed == lp.model_dump()
    assert "".join(c.choices[0].text for c in chunks) == choice.text


def test_n_choices_each_with_its_own_seed(client, hf_stack):
    kw = dict(model=hf_stack.name, max_tokens=12, temperature=1.0, seed=42)
    prompts = ["Hello", "The capital of France is"]
    out = client.completions.create(prompt=prompts, n=3, **kw)
    assert [c.index for c in out.choices] == list(range(6))
    # Prompt i's choice j is choice i * 3 + j, sampled with seed 42 + j: the same text a
    # request for that prompt alone with that seed gets.
    for i, prompt in enumerate(prompts):
        for j in range(3):
            alone = client.completions.create(prompt=prompt, **{**kw, "seed": 42 + j}).choices[0].text
            assert out.choices[i * 3 + j].text == alone
    assert len({c.text for c in out.choices[:3]}) > 1
    assert out.usage.completion_tokens == sum(
        client.completions.create(prompt=p, **{**kw, "seed": 42 + j}).usage.completion_tokens
        for p in prompts
        for j in range(3)
    )
    # Streamed: every choice's chunks carry its index and add up to the same texts.
    texts = {}
    for chunk in client.completions.create(prompt=prompts, n=3, stream=True, **kw):
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
    assert texts == {c.index: c.text for c in out.choices}


def test_penalties_and_stop_token_ids_through_the_api(client, hf_stack):
    """The parameters reach the worker (their effect is checked token for token in
    tests/test_engine.py): a penalized completion equals the same job through /v1/jobs."""
    extra = {"repetition_penalty": 1.4, "min_tokens": 3, "stop_token_ids": [7]}
    kw = dict(model=hf_stack.name, prompt="import os\nimport sys\n", max_tokens=16, temperature=0)
    plain = client.completions.create(**kw).choices[0].text
    choice = client.completions.create(presence_penalty=0.5, frequency_penalty=0.3, extra_body=extra, **kw).choices[0]
    assert choice.text != plain
    job = {"prompt": kw["prompt"], "max_new_tokens": 16, "presence_penalty": 0.5, "frequency_penalty": 0.3, **extra}
    resp = hf_stack.post("/v1/jobs", json=job)
    assert resp.status_code == 202, resp.text
    result = hf_stack.get(resp.headers["Location"] + "?wait=60").json()["result"]
    assert result["text"] == choice.text


def long_prompt() -> str:
    """About 100 tokens (six whole blocks of the prefix cache's 16) that no request sent before:
    its first word is new."""
    return f"[{uuid.uuid4().hex}] " + " ".join(["The quick brown fox jumps over the lazy dog."] * 4)


def test_a_repeated_prompt_reports_its_prefix_cache_hits(client, hf_stack):
    """The same long prompt twice: the first computed all of it (cached_tokens 0), the second
    took its whole blocks from the prefix cache (0 < cached_tokens < prompt_tokens). A streamed
    completion's usage chunk, the job API's result and its stream's done event say the same."""
    kw = dict(model=hf_stack.name, prompt=long_prompt(), max_tokens=4, temperature=0)
    first = client.completions.create(**kw).usage
    assert first.prompt_tokens > 64 and first.prompt_tokens_details.cached_tokens == 0
    second = client.completions.create(**kw).usage
    cached = second.prompt_tokens_details.cached_tokens
    assert second.prompt_tokens == first.prompt_tokens and 0 < cached < second.prompt_tokens

    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    assert chunks[-1].choices == [] and chunks[-1].usage.prompt_tokens_details.cached_tokens == cached

    job_id = submit(hf_stack, prompt=kw["prompt"], max_new_tokens=4, temperature=0, ignore_eos=True)
    done = json.loads(stream(hf_stack, job_id)[-1]["data"])
    assert done["usage"] == {"prompt_tokens": first.prompt_tokens, "completion_tokens": 4, "cached_tokens": cached}
    assert hf_stack.get(f"/v1/jobs/{job_id}?wait=60").json()["result"]["cached_tokens"] == cached


def test_job_api_logprobs_in_result_and_stream(hf_stack):
    job_id = submit(hf_stack, prompt="Deep learning", max_new_tokens=8, logprobs=1)
    events = stream(hf_stack, job_id)
    result = hf_stack.get(f"/v1/jobs/{job_id}?wait=60").json()["result"]
    tokens = []
    for e in events:
        tokens += json.loads(e["data"]).get("logprobs", {}).get("tokens", [])
    assert tokens == result["logprobs"]["tokens"] and len(tokens) == result["completion_tokens"]


def test_echo_engine_takes_the_parameters(echo_stack):
    """The echo engine (no model) ignores what shapes a model's choices and reports its words
    as certain."""
    body = {
        "model": echo_stack.name,
        "prompt": "one two three",
        "max_tokens": 2,
        "logprobs": 2,
        "n": 2,
        "repetition_penalty": 1.5,
        "presence_penalty": 1,
        "frequency_penalty": 1,
        "min_tokens": 1,
        "stop_token_ids": [3],
    }
    resp = echo_stack.post("/v1/completions", json=body)
    assert resp.status_code == 200, resp.text
    for c in resp.json()["choices"]:
        assert c["text"] == " two three"
        assert c["logprobs"] == {
            "tokens": [" two", " three"],
            "token_logprobs": [0.0, 0.0],
            "top_logprobs": [{" two": 0.0}, {" three": 0.0}],
            "text_offset": [0, 4],
        }


def test_max_tokens_null_is_16_and_errors_name_max_tokens(echo_stack):
    """`max_tokens: null` is vLLM's default (16); one above the limit is refused naming the
    request's field, not the job's `max_new_tokens`."""
    words = " ".join(f"w{i}" for i in range(40))
    resp = echo_stack.post("/v1/completions", json={"model": echo_stack.name, "prompt": words, "max_tokens": None})
    assert resp.status_code == 200, resp.text
    assert resp.json()["usage"]["completion_tokens"] == 16
    resp = echo_stack.post("/v1/completions", json={"model": echo_stack.name, "prompt": "Hi", "max_tokens": 100_000})
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    assert err["param"] == "max_tokens" and err["message"].startswith("max_tokens: must be at most ")
    assert "max_new_tokens" not in err["message"]

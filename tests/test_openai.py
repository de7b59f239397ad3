"""The official `openai` client against a live genqueue: completions, streamed completions, the
models list, errors."""

from __future__ import annotations

import openai
import pytest


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


def test_errors_in_openai_format(client, hf_stack):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=hf_stack.name, prompt="Hi", n=2)
    assert info.value.body["param"] == "n" and info.value.body["type"] == "invalid_request_error"
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="no-such-model", prompt="Hi")
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=hf_stack.name, prompt="Hi", max_tokens=0)
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=hf_stack.name, prompt="word " * 600, max_tokens=4)
    assert info.value.code == "prompt_too_long"

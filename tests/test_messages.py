"""Anthropic's Messages API (`/v1/messages`) through a real stack (API, Redis, an hf worker on
the real SmolLM2-135M-Instruct) with the official `anthropic` client: plain, streamed, stop
sequences, tools (tool_use and tool_result), errors; a conversation's greedy reply equals its
chat completion's."""

from __future__ import annotations

import json

import anthropic
import jsonschema
import openai
import pytest
import requests

KEY = "sk-messages-0123456789"
SYSTEM = "Answer in one sentence."
QUESTION = "What is the capital of France?"
CITY = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 40}, "days": {"type": "integer"}},
    "required": ["city", "days"],
}
TOOL = {"name": "get_forecast", "description": "the weather forecast", "input_schema": CITY}
# Anthropic's client (2.10) has no `temperature` argument; the server takes the field (greedy at 0).
GREEDY = {"temperature": 0}
ASK = "What will the weather be in Paris for the next 3 days?"


@pytest.fixture(scope="module")
def stack(stack_logs):
    from conftest import private_stack

    from scripts import realmodel

    with private_stack(
        realmodel.ensure(), stack_logs, GENQ_API_KEYS=KEY, GENQ_TOOL_CALL_PARSER="hermes", GENQ_MAX_BATCH_SIZE="4"
    ) as s:
        yield s


@pytest.fixture(scope="module")
def client(stack):
    with anthropic.Anthropic(base_url=stack.base, api_key=KEY, max_retries=0, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def chat(stack):
    with openai.OpenAI(base_url=stack.base + "/v1", api_key=KEY, max_retries=0) as c:
        yield c


def chat_text(chat, stack, messages, max_tokens, **kw) -> str:
    out = chat.chat.completions.create(model=stack.name, messages=messages, max_tokens=max_tokens, temperature=0, **kw)
    return out.choices[0].message


def test_a_message_is_the_chat_answer(client, chat, stack):
    m = client.messages.create(
        model=stack.name,
        system=SYSTEM,
        messages=[{"role": "user", "content": QUESTION}],
        max_tokens=24,
        extra_body=GREEDY,
    )
    assert m.type == "message" and m.role == "assistant" and m.id.startswith("msg_") and m.model == stack.name
    (block,) = m.content
    assert block.type == "text" and "Paris" in block.text
    assert m.stop_reason in ("end_turn", "max_tokens") and m.stop_sequence is None
    reply = chat_text(chat, stack, [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}], 24)
    assert block.text == reply.content
    assert m.usage.output_tokens > 0 and m.usage.input_tokens + (m.usage.cache_read_input_tokens or 0) > 10
    # A conversation in blocks, system as blocks: the same reply as its chat completion.
    conversation = [
        {"role": "user", "content": [{"type": "text", "text": "Hello"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "Hi! How can I help?"}]},
        {"role": "user", "content": QUESTION},
    ]
    m2 = client.messages.create(
        model=stack.name,
        system=[{"type": "text", "text": SYSTEM}],
        messages=conversation,
        max_tokens=20,
        extra_body=GREEDY,
    )
    as_chat = [{"role": "system", "content": SYSTEM}] + [
        {"role": c["role"], "content": c["content"] if isinstance(c["content"], str) else c["content"][0]["text"]}
        for c in conversation
    ]
    assert m2.content[0].text == chat_text(chat, stack, as_chat, 20).content


def test_max_tokens_and_stop_sequences(client, stack):
    short = client.messages.create(
        model=stack.name,
        messages=[{"role": "user", "content": QUESTION}],
        max_tokens=3,
        extra_body={"ignore_eos": True, "temperature": 0},
    )
    kw = dict(model=stack.name, messages=[{"role": "user", "content": QUESTION}], extra_body=GREEDY)
    assert short.stop_reason == "max_tokens" and short.usage.output_tokens == 3
    full = client.messages.create(max_tokens=24, **kw).content[0].text
    assert "Paris" in full
    stopped = client.messages.create(max_tokens=24, stop_sequences=["Paris"], **kw)
    assert stopped.stop_reason == "stop_sequence" and stopped.stop_sequence == "Paris"
    assert stopped.content[0].text == full[: full.index("Paris")]


def test_a_streamed_message_equals_the_plain_one(client, stack):
    kw = dict(model=stack.name, system=SYSTEM, messages=[{"role": "user", "content": QUESTION}], max_tokens=24)
    plain = client.messages.create(extra_body=GREEDY, **kw)
    with client.messages.stream(extra_body=GREEDY, **kw) as stream:
        events = list(stream)
        final = stream.get_final_message()
    types = [e.type for e in events if e.type not in ("text",)]
    assert types[0] == "message_start" and types[1] == "content_block_start"
    assert types[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    text = "".join(e.delta.text for e in events if e.type == "content_block_delta")
    assert text == plain.content[0].text == final.content[0].text
    assert final.stop_reason == plain.stop_reason and final.usage.output_tokens == plain.usage.output_tokens


def test_tools_tool_use_and_tool_result(client, chat, stack):
    m = client.messages.create(
        model=stack.name,
        messages=[{"role": "user", "content": ASK}],
        tools=[TOOL],
        tool_choice={"type": "any"},
        max_tokens=96,
        extra_body=GREEDY,
    )
    uses = [b for b in m.content if b.type == "tool_use"]
    assert m.stop_reason == "tool_use" and uses, m
    for use in uses:
        assert use.name == "get_forecast" and use.id
        jsonschema.validate(use.input, CITY)
    # Streamed: the same call, its input as input_json_delta.
    with client.messages.stream(
        model=stack.name,
        messages=[{"role": "user", "content": ASK}],
        tools=[TOOL],
        tool_choice={"type": "any"},
        max_tokens=96,
        extra_body=GREEDY,
    ) as stream:
        final = stream.get_final_message()
    assert [(b.name, b.input) for b in final.content if b.type == "tool_use"] == [(u.name, u.input) for u in uses]
    assert final.stop_reason == "tool_use"
    # The result goes back as a tool_result block: the reply is its chat completion's.
    follow = [
        {"role": "user", "content": ASK},
        {"role": "assistant", "content": [u.model_dump() for u in uses]},
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": uses[0].id, "content": "Sunny, 25 C."}],
        },
    ]
    answer = client.messages.create(
        model=stack.name, messages=follow, tools=[TOOL], tool_choice={"type": "none"}, max_tokens=32, extra_body=GREEDY
    )
    assert answer.content[0].type == "text" and answer.stop_reason in ("end_turn", "max_tokens")
    calls = [
        {"id": u.id, "type": "function", "function": {"name": u.name, "arguments": json.dumps(u.input)}} for u in uses
    ]
    as_chat = [
        {"role": "user", "content": ASK},
        {"role": "assistant", "content": None, "tool_calls": calls},
        {"role": "tool", "tool_call_id": uses[0].id, "content": "Sunny, 25 C."},
    ]
    openai_tools = [{"type": "function", "function": {"name": TOOL["name"], "parameters": CITY}}]
    reply = chat_text(chat, stack, as_chat, 32, tools=openai_tools, tool_choice="none")
    assert answer.content[0].text == reply.content


def test_bad_requests_are_4xx_in_anthropics_shape(client, stack):
    headers = {"x-api-key": KEY, "anthropic-version": "2023-06-01"}
    cases = [
        ({"messages": [{"role": "user", "content": "Hi"}]}, "max_tokens"),
        (
            {
                "max_tokens": 4,
                "messages": [{"role": "user", "content": [{"type": "image", "source": {"type": "url", "url": "x"}}]}],
            },
            "messages.0.content.0.type",
        ),
        ({"max_tokens": 4, "messages": [{"role": "tool", "content": "Hi"}]}, "messages.0.role"),
        (
            {"max_tokens": 4, "messages": [{"role": "user", "content": "Hi"}], "tools": [{"type": "bash_20250124"}]},
            "tools.0.type",
        ),
        (
            {"max_tokens": 4, "messages": [{"role": "user", "content": "Hi"}], "thinking": {"type": "enabled"}},
            "thinking",
        ),
    ]
    for body, field in cases:
        resp = requests.post(
            stack.base + "/v1/messages", json={"model": stack.name, **body}, headers=headers, timeout=60
        )
        assert resp.status_code == 400, (body, resp.text)
        err = resp.json()
        assert err["type"] == "error" and err["error"]["type"] == "invalid_request_error"
        assert field in err["error"]["message"] and err["error"]["param"] == field, err
    with pytest.raises(anthropic.BadRequestError):
        client.messages.create(model=stack.name, messages=[{"role": "user", "content": "Hi"}], max_tokens=100_000)
    with pytest.raises(anthropic.NotFoundError):
        client.messages.create(model="no-such-model", messages=[{"role": "user", "content": "Hi"}], max_tokens=4)
    with anthropic.Anthropic(base_url=stack.base, api_key="sk-wrong-0123456789", max_retries=0) as wrong:
        with pytest.raises(anthropic.AuthenticationError):
            wrong.messages.create(model=stack.name, messages=[{"role": "user", "content": "Hi"}], max_tokens=4)
    # And it keeps serving.
    m = client.messages.create(model=stack.name, messages=[{"role": "user", "content": QUESTION}], max_tokens=8)
    assert m.content[0].text

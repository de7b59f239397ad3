"""OpenAI's Responses API (`/v1/responses`) through a real stack (API, Redis, an hf worker on
the real SmolLM2-135M-Instruct) with the official `openai` client: blocking, background and
polled, cancelled, streamed and resumed, continued with `previous_response_id`, function
calls, input items, delete, another key's 404, bad input, and a background response across
an API restart."""

from __future__ import annotations

import json
import signal
import time

import jsonschema
import openai
import pytest
import requests

KEY_A = "sk-responses-a-0123456789"
KEY_B = "sk-responses-b-0123456789"
QUESTION = "What is the capital of France?"
CITY = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 40}, "days": {"type": "integer"}},
    "required": ["city", "days"],
}
FORECAST = {"type": "function", "name": "get_forecast", "description": "the weather forecast", "parameters": CITY}


@pytest.fixture(scope="module")
def stack(stack_logs):
    """SmolLM2 on a Redis of its own (the API is restarted by a test), with two keys."""
    from conftest import private_stack

    from scripts import realmodel

    with private_stack(
        realmodel.ensure(),
        stack_logs,
        GENQ_API_KEYS=f"{KEY_A},{KEY_B}",
        GENQ_TOOL_CALL_PARSER="hermes",
        GENQ_MAX_BATCH_SIZE="4",
    ) as s:
        yield s


def make_client(stack, key: str = KEY_A) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.base + "/v1", api_key=key, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def client(stack):
    with make_client(stack) as c:
        yield c


@pytest.fixture(scope="module")
def other(stack):
    with make_client(stack, KEY_B) as c:
        yield c


def wait_for(client, resp_id: str, timeout: float = 120):
    end = time.monotonic() + timeout
    while True:
        r = client.responses.retrieve(resp_id)
        if r.status not in ("queued", "in_progress") or time.monotonic() > end:
            return r
        time.sleep(0.2)


def test_a_blocking_response_is_the_chat_answer(client, stack):
    kw = dict(max_output_tokens=24, temperature=0)
    r = client.responses.create(
        model=stack.name, input=QUESTION, instructions="Answer in one sentence.", metadata={"run": "1"}, **kw
    )
    assert r.object == "response" and r.id.startswith("resp_") and r.model == stack.name
    assert r.status in ("completed", "incomplete") and r.error is None
    assert "Paris" in r.output_text
    (item,) = r.output
    assert item.type == "message" and item.role == "assistant" and item.content[0].type == "output_text"
    chat = client.chat.completions.create(
        model=stack.name,
        messages=[{"role": "system", "content": "Answer in one sentence."}, {"role": "user", "content": QUESTION}],
        max_tokens=24,
        temperature=0,
    )
    assert r.output_text == chat.choices[0].message.content
    assert r.usage.input_tokens == chat.usage.prompt_tokens
    assert r.usage.output_tokens == chat.usage.completion_tokens
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    assert r.usage.input_tokens_details.cached_tokens >= 0
    assert r.metadata == {"run": "1"} and r.instructions == "Answer in one sentence." and r.store is True
    # Kept: any API process answers it from Redis.
    again = client.responses.retrieve(r.id)
    assert again.output_text == r.output_text and again.status == r.status and again.usage == r.usage
    # A list of messages, text parts, top_p: the same conversation, the same answer.
    listed = client.responses.create(
        model=stack.name,
        input=[
            {"role": "developer", "content": "Answer in one sentence."},
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": QUESTION}]},
        ],
        top_p=1.0,
        **kw,
    )
    assert listed.output_text == r.output_text


def test_max_output_tokens_makes_it_incomplete_and_store_false_keeps_nothing(client, stack):
    r = client.responses.create(
        model=stack.name,
        input=QUESTION,
        max_output_tokens=3,
        temperature=0,
        store=False,
        extra_body={"ignore_eos": True},
    )
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 3 and r.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)


def test_a_function_call_and_its_output(client, stack):
    r = client.responses.create(
        model=stack.name,
        input="What will the weather be in Paris for the next 3 days?",
        tools=[FORECAST],
        tool_choice="required",
        max_output_tokens=96,
        temperature=0,
    )
    calls = [o for o in r.output if o.type == "function_call"]
    assert calls and r.status == "completed", r
    for call in calls:
        assert call.name == "get_forecast" and call.call_id and call.id.startswith("fc_")
        jsonschema.validate(json.loads(call.arguments), CITY)
    # Its output goes back as an input item; the model answers with text.
    follow = client.responses.create(
        model=stack.name,
        previous_response_id=r.id,
        input=[{"type": "function_call_output", "call_id": calls[0].call_id, "output": "Sunny, 25 C."}],
        tools=[FORECAST],
        tool_choice="none",
        max_output_tokens=32,
        temperature=0,
    )
    assert follow.output[0].type == "message" and follow.output_text
    assert follow.previous_response_id == r.id
    # The same conversation written out in full gives the same answer.
    full = client.responses.create(
        model=stack.name,
        input=[
            {"role": "user", "content": "What will the weather be in Paris for the next 3 days?"},
            *[{"type": "function_call", "call_id": c.call_id, "name": c.name, "arguments": c.arguments} for c in calls],
            {"type": "function_call_output", "call_id": calls[0].call_id, "output": "Sunny, 25 C."},
        ],
        tools=[FORECAST],
        tool_choice="none",
        max_output_tokens=32,
        temperature=0,
    )
    assert full.output_text == follow.output_text


def test_previous_response_id_continues_the_conversation_from_the_prefix_cache(client, other, stack):
    first = client.responses.create(
        model=stack.name, input="My name is Ada. " + QUESTION, max_output_tokens=24, temperature=0
    )
    second = client.responses.create(
        model=stack.name, previous_response_id=first.id, input="What is my name?", max_output_tokens=16, temperature=0
    )
    assert second.status in ("completed", "incomplete") and second.output_text
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    assert second.usage.input_tokens_details.cached_tokens > 0
    # The same conversation written out: the same answer.
    written = client.responses.create(
        model=stack.name,
        input=[
            {"role": "user", "content": "My name is Ada. " + QUESTION},
            {"role": "assistant", "content": first.output_text},
            {"role": "user", "content": "What is my name?"},
        ],
        max_output_tokens=16,
        temperature=0,
    )
    assert written.output_text == second.output_text
    # Another key's response is not there for this one; nor is an unknown one.
    for c, prev in ((other, first.id), (client, "resp_" + "0" * 32)):
        with pytest.raises(openai.NotFoundError) as info:
            c.responses.create(model=stack.name, previous_response_id=prev, input="Hi", max_output_tokens=4)
        assert info.value.body["param"] == "previous_response_id"


def test_background_poll_input_items_and_delete(client, other, stack):
    r = client.responses.create(
        model=stack.name,
        input=[
            {"role": "user", "content": "Hello"},
            {"role": "assistant", "content": "Hi!"},
            {"role": "user", "content": QUESTION},
        ],
        background=True,
        max_output_tokens=24,
        temperature=0,
    )
    assert r.status == "queued" and r.background is True and r.output == []
    done = wait_for(client, r.id)
    assert done.status in ("completed", "incomplete") and "Paris" in done.output_text
    items = client.responses.input_items.list(r.id, order="asc")
    assert [(i.type, i.role, i.content[0].text) for i in items.data] == [
        ("message", "user", "Hello"),
        ("message", "assistant", "Hi!"),
        ("message", "user", QUESTION),
    ]
    for call in (
        lambda: other.responses.retrieve(r.id),
        lambda: other.responses.input_items.list(r.id),
        lambda: other.responses.cancel(r.id),
        lambda: other.responses.delete(r.id),
    ):
        with pytest.raises(openai.NotFoundError):
            call()
    client.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)


def test_a_background_response_is_cancelled(client, stack):
    r = client.responses.create(
        model=stack.name,
        input="Write a long story.",
        background=True,
        max_output_tokens=1000,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    cancelled = client.responses.cancel(r.id)
    assert cancelled.status == "cancelled"
    assert client.responses.retrieve(r.id).status == "cancelled"
    with pytest.raises(openai.ConflictError):  # ended already: nothing to cancel
        done = client.responses.create(model=stack.name, input="Hi", background=True, max_output_tokens=2)
        wait_for(client, done.id)
        client.responses.cancel(done.id)


def events_of(stream) -> list:
    return list(stream)


def test_a_background_stream_and_its_resume(client, stack):
    stream = client.responses.create(
        model=stack.name, input=QUESTION, background=True, stream=True, max_output_tokens=24, temperature=0
    )
    events = events_of(stream)
    types = [e.type for e in events]
    assert types[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert types[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        f"response.{events[-1].response.status}",
    ]
    assert events[-1].response.status in ("completed", "incomplete")
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    final = events[-1].response
    assert final.output_text == text and "Paris" in text
    resp_id = events[0].response.id
    assert client.responses.retrieve(resp_id).output_text == text
    # Resumed after any event: the rest, no gap, no duplicate.
    for n in (0, 3, len(events) - 2):
        rest = events_of(client.responses.retrieve(resp_id, stream=True, starting_after=n))
        assert [e.sequence_number for e in rest] == list(range(n + 1, len(events)))
        assert [e.model_dump() for e in rest] == [e.model_dump() for e in events[n + 1 :]]
    # Past the end: a 400 naming the field.
    with pytest.raises(openai.BadRequestError) as info:
        events_of(client.responses.retrieve(resp_id, stream=True, starting_after=len(events) - 1))
    assert info.value.body["param"] == "starting_after"


def test_a_stream_resumed_while_it_runs(client, stack):
    stream = client.responses.create(
        model=stack.name,
        input="Tell me about Paris.",
        background=True,
        stream=True,
        max_output_tokens=48,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    first = []
    for e in stream:
        first.append(e)
        if e.type == "response.output_text.delta" and len(first) > 8:
            break
    stream.close()  # the client went away: a background response goes on
    resp_id = first[0].response.id
    rest = events_of(client.responses.retrieve(resp_id, stream=True, starting_after=first[-1].sequence_number))
    assert rest[0].sequence_number == first[-1].sequence_number + 1 and rest[-1].type == "response.incomplete"
    assert [e.sequence_number for e in rest] == list(range(rest[0].sequence_number, rest[-1].sequence_number + 1))
    text = "".join(e.delta for e in first + rest if e.type == "response.output_text.delta")
    assert text == rest[-1].response.output_text and rest[-1].response.usage.output_tokens == 48


def test_a_plain_stream_equals_the_blocking_answer(client, stack):
    kw = dict(model=stack.name, input=QUESTION, max_output_tokens=16, temperature=0, store=False)
    plain = client.responses.create(**kw)
    events = events_of(client.responses.create(stream=True, **kw))
    assert events[-1].response.output_text == plain.output_text
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == plain.output_text


def test_bad_input_is_a_4xx_naming_the_field(client, stack):
    cases = [
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
            "input.0.content.0.type",
        ),
        ({"input": [{"type": "file_search_call", "id": "x"}]}, "input.0.type"),
        ({"input": [{"type": "item_reference", "id": "x"}]}, "input.0.type"),
        ({"input": "Hi", "tools": [{"type": "web_search"}]}, "tools.0.type"),
        ({"input": "Hi", "background": True, "store": False}, "background"),
        ({"input": "Hi", "text": {"format": {"type": "xml"}}}, "text.format.type"),
        ({"input": "Hi", "frobnicate": 1}, "frobnicate"),
        ({"input": []}, "input"),
    ]
    for body, param in cases:
        resp = requests.post(
            stack.base + "/v1/responses",
            json={"model": stack.name, "max_output_tokens": 4, **body},
            headers={"Authorization": f"Bearer {KEY_A}"},
            timeout=60,
        )
        assert resp.status_code == 400, (body, resp.text)
        assert resp.json()["error"]["param"] == param, resp.text
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve("resp_nope")
    with pytest.raises(openai.BadRequestError) as info:  # made without stream or background: no events
        r = client.responses.create(model=stack.name, input="Hi", max_output_tokens=2)
        events_of(client.responses.retrieve(r.id, stream=True, starting_after=0))
    assert info.value.body["param"] == "stream"
    # And it keeps serving.
    assert client.responses.create(model=stack.name, input=QUESTION, max_output_tokens=8, temperature=0).output_text


def test_a_json_schema_format(client, stack):
    schema = {"type": "object", "properties": {"capital": {"type": "string", "maxLength": 30}}, "required": ["capital"]}
    r = client.responses.create(
        model=stack.name,
        input=QUESTION,
        text={"format": {"type": "json_schema", "name": "answer", "schema": schema}},
        max_output_tokens=40,
        temperature=0,
    )
    jsonschema.validate(json.loads(r.output_text), schema)


@pytest.mark.timeout(600)
def test_a_background_response_survives_its_workers_death(client, stack):
    """Its worker is SIGKILLed while it streams; a new worker runs its job again, and the
    resumed stream goes on from the event named: the greedy re-run's tokens that the stream
    had already are not sent twice."""
    kw = dict(model=stack.name, input="Tell me about Paris.", max_output_tokens=40, temperature=0)
    stream = client.responses.create(background=True, stream=True, extra_body={"ignore_eos": True}, **kw)
    first = []
    for e in stream:
        first.append(e)
        if e.type == "response.output_text.delta" and len(first) > 8:
            break
    stream.close()
    (worker,) = [p for p in stack.procs if p.name.startswith("worker") and p.alive()]
    worker.signal(signal.SIGKILL)
    worker.popen.wait(10)
    stack.start_worker()
    resp_id = first[0].response.id
    rest = events_of(client.responses.retrieve(resp_id, stream=True, starting_after=first[-1].sequence_number))
    assert [e.sequence_number for e in rest] == list(range(first[-1].sequence_number + 1, rest[-1].sequence_number + 1))
    final = rest[-1].response
    assert rest[-1].type == "response.incomplete" and final.usage.output_tokens == 40
    text = "".join(e.delta for e in first + rest if e.type == "response.output_text.delta")
    assert text == final.output_text == client.responses.retrieve(resp_id).output_text
    again = client.responses.create(store=False, extra_body={"ignore_eos": True}, **kw)
    assert again.output_text == text


def test_a_background_response_survives_an_api_restart(client, stack):
    r = client.responses.create(
        model=stack.name,
        input=QUESTION,
        background=True,
        max_output_tokens=30,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    (api,) = [p for p in stack.procs if p.name == "api" and p.alive()]
    api.stop()
    stack.http.close()
    stack.start_api()
    with make_client(stack) as fresh:
        done = wait_for(fresh, r.id)
        assert done.status == "incomplete" and done.usage.output_tokens == 30 and "Paris" in done.output_text


@pytest.mark.timeout(480)
def test_a_background_response_survives_a_redis_restart(make_stack, tmp_path):
    """The tiny model (plumbing only) on a Redis with an append-only file, killed while the
    response runs: the response, kept for GENQ_RESPONSE_TTL, ends as its job does, and its
    stream still resumes."""
    from pathlib import Path

    import redis as redis_client
    from helpers import KillableRedis

    from tasks import keys

    db = KillableRedis(tmp_path, fsync="everysec")
    template = Path(__file__).with_name("chat_template.jinja")
    s = make_stack(REDIS_URL=db.url, GENQ_CHAT_TEMPLATE=str(template), GENQ_RESPONSE_TTL="3600")
    try:
        s.start_api()
        s.start_worker()
        s.wait_ready()
        with openai.OpenAI(base_url=s.base + "/v1", api_key="unused", max_retries=0, timeout=60) as c:
            r = c.responses.create(
                model=s.name,
                input="Hello",
                background=True,
                max_output_tokens=400,
                temperature=0,
                extra_body={"ignore_eos": True},
            )
            ttl = redis_client.Redis.from_url(db.url).ttl(keys.response(r.id))
            assert 3500 < ttl <= 3600
            end = time.monotonic() + 30
            while c.responses.retrieve(r.id).status == "queued" and time.monotonic() < end:
                time.sleep(0.1)
            before = c.responses.retrieve(r.id).status
            db.kill()
            time.sleep(3)
            db.start()
            done = wait_for(c, r.id, 300)
            assert before == "in_progress"  # the kill came while it ran
            assert done.status == "incomplete" and done.usage.output_tokens == 400
            events = events_of(c.responses.retrieve(r.id, stream=True, starting_after=5))
            assert events[0].sequence_number == 6 and events[-1].response.output_text == done.output_text
    finally:
        s.stop()
        db.stop()


# -- the pure parts ---------------------------------------------------------------------------


def test_input_items_become_chat_messages():
    from webapp.protocol.responses import ResponsesRequest, to_messages

    call = {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"}
    items = [
        {"role": "developer", "content": "Be brief."},
        {
            "type": "message",
            "role": "user",
            "content": [{"type": "input_text", "text": "a"}, {"type": "input_text", "text": "b"}],
        },
        {"type": "reasoning", "id": "rs_1", "summary": []},
        call,
        {**call, "call_id": "c2", "name": "g"},
        {"type": "function_call_output", "call_id": "c1", "output": "1"},
        {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "2"}]},
    ]
    assert to_messages(items) == [
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": "a\nb"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}},
                {"id": "c2", "type": "function", "function": {"name": "g", "arguments": "{}"}},
            ],
        },
        {"role": "tool", "content": "1", "tool_call_id": "c1"},
        {"role": "tool", "content": "2", "tool_call_id": "c2"},
    ]
    req = ResponsesRequest.model_validate(
        {
            "input": "hi",
            "instructions": "sys",
            "tools": [FORECAST],
            "tool_choice": {"type": "function", "name": "get_forecast"},
            "text": {"format": {"type": "json_schema", "name": "x", "schema": CITY}},
            "max_output_tokens": 9,
            "ignore_eos": True,
        }
    )
    body = req.chat_body([{"role": "user", "content": "before"}], to_messages(req.input_items()))
    assert body["messages"] == [
        {"role": "system", "content": "sys"},
        {"role": "user", "content": "before"},
        {"role": "user", "content": "hi"},
    ]
    assert body["tools"] == [{"type": "function", "function": {k: v for k, v in FORECAST.items() if k != "type"}}]
    assert body["tool_choice"] == {"type": "function", "function": {"name": "get_forecast"}}
    assert body["response_format"] == {"type": "json_schema", "json_schema": {"name": "x", "schema": CITY}}
    assert body["max_tokens"] == 9 and body["ignore_eos"] is True


def test_anthropic_messages_become_chat_messages():
    from webapp.protocol.messages import MessagesRequest

    req = MessagesRequest.model_validate(
        {
            "max_tokens": 5,
            "system": [{"type": "text", "text": "sys"}],
            "messages": [
                {"role": "user", "content": "weather?"},
                {
                    "role": "assistant",
                    "content": [
                        {"type": "text", "text": "Let me look."},
                        {"type": "tool_use", "id": "t1", "name": "get_forecast", "input": {"city": "Paris", "days": 1}},
                    ],
                },
                {
                    "role": "user",
                    "content": [
                        {"type": "tool_result", "tool_use_id": "t1", "content": [{"type": "text", "text": "sunny"}]},
                        {"type": "text", "text": "thanks"},
                    ],
                },
            ],
            "tools": [{"name": "get_forecast", "input_schema": CITY}],
            "tool_choice": {"type": "any"},
            "stop_sequences": ["\n\n"],
        }
    )
    body = req.chat_body()
    arguments = json.dumps({"city": "Paris", "days": 1})
    assert body["messages"] == [
        {"role": "system", "content": "sys"},
        {"role": "user", "content": "weather?"},
        {
            "role": "assistant",
            "content": "Let me look.",
            "tool_calls": [
                {"id": "t1", "type": "function", "function": {"name": "get_forecast", "arguments": arguments}}
            ],
        },
        {"role": "tool", "content": "sunny", "tool_call_id": "t1"},
        {"role": "user", "content": "thanks"},
    ]
    assert body["tool_choice"] == "required" and body["stop"] == ["\n\n"] and body["max_tokens"] == 5
    assert body["tools"] == [{"type": "function", "function": {"name": "get_forecast", "parameters": CITY}}]

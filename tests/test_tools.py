"""Tool calling on /v1/chat/completions through a real stack (API, Redis, an hf worker on the
tiny model) with the official `openai` client, and the pure parts (the forcing schemas, the
forced outputs' parsing).

The tiny model's weights are random, so its own text is noise: where a test needs the model to
write a call (`tool_choice: "auto"`), the request forces its text with `structured_outputs`
(one `choice`, the Hermes markup), which the API then parses with GENQ_TOOL_CALL_PARSER=hermes
as it would a model's own call; `required` and a named function need no such help (their
output is forced by the tools' schemas). The template (tests/chat_template_tools.jinja) renders
`tools`, assistant `tool_calls` and `tool` messages as Hermes-style templates do.
"""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import openai
import pytest

from tasks.config import ApiSettings
from webapp.errors import APIError
from webapp.parsers import TOOL_PARSERS
from webapp.protocol.chat import ChatCompletionRequest
from webapp.protocol.output import output_parser
from webapp.protocol.tools import NamedParser, RequiredParser, Tool, ToolUse, required_schema

TEMPLATE = Path(__file__).with_name("chat_template_tools.jinja")
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["Paris", "Rome"]},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TIME = {
    "type": "object",
    "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}},
    "required": ["zone"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "the weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "parameters": TIME}},
]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
JSON_CALL = '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}'
CALL = f"<tool_call>\n{JSON_CALL}\n</tool_call>"


@pytest.fixture(scope="module")
def tools_stack(tiny_model, stack_logs):
    """On a Redis of its own: on the tests' shared Redis every other stack's API drives this
    stack's batches too, with its own settings (no tool-call parser: its `auto` lines got 400)."""
    from conftest import private_stack

    with private_stack(
        tiny_model,
        stack_logs,
        GENQ_CHAT_TEMPLATE=str(TEMPLATE),
        GENQ_TOOL_CALL_PARSER="hermes",
        GENQ_MAX_BATCH_SIZE="8",
    ) as s:
        yield s


@pytest.fixture
def bare_api(make_stack):
    """An API without a tool-call parser, and no worker: what it refuses before queueing. For
    its test only: its batch driver, on the tests' shared Redis, would drive other stacks'
    batches with its own settings (a deployment's API processes all have the same)."""
    s = make_stack(GENQ_CHAT_TEMPLATE=str(TEMPLATE))
    s.start_api()
    return s


@pytest.fixture(scope="module")
def client(tools_stack):
    with openai.OpenAI(base_url=tools_stack.base + "/v1", api_key="unused", max_retries=0) as c:
        yield c


def create(client, stack, **kw):
    kw.setdefault("max_tokens", 200)
    kw.setdefault("temperature", 0)
    return client.chat.completions.create(model=stack.name, messages=kw.pop("messages", MESSAGES), **kw)


def assembled(stream) -> tuple[str | None, list[dict], str]:
    """A client's assembly of streamed deltas: content, calls (by index), finish_reason."""
    content, calls, finish = None, {}, None
    for chunk in stream:
        for c in chunk.choices:
            d = c.delta
            if d.content:
                content = (content or "") + d.content
            for tc in d.tool_calls or []:
                call = calls.setdefault(tc.index, {"id": None, "name": None, "arguments": ""})
                call["id"] = tc.id or call["id"]
                call["name"] = (tc.function.name if tc.function else None) or call["name"]
                call["arguments"] += (tc.function.arguments if tc.function else None) or ""
            finish = c.finish_reason or finish
    return content, [calls[i] for i in sorted(calls)], finish


def calls_of(message) -> list[dict]:
    return [{"id": c.id, "name": c.function.name, "arguments": c.function.arguments} for c in message.tool_calls or []]


def without_ids(calls: list[dict]) -> list[dict]:
    return [{k: v for k, v in c.items() if k != "id"} for c in calls]


# -- the pure parts ---------------------------------------------------------------------------


def test_the_setting_names_every_parser():
    import typing

    names = typing.get_args(typing.get_args(ApiSettings.model_fields["tool_call_parser"].annotation)[0])
    assert set(names) == set(TOOL_PARSERS)


def test_required_schema_is_vllms_array_of_named_calls():
    defs = {"Unit": {"type": "string", "enum": ["c", "f"]}}
    with_defs = {"type": "object", "properties": {"u": {"$ref": "#/$defs/Unit"}}, "$defs": defs}
    tools = [Tool.model_validate(t) for t in TOOLS] + [
        Tool.model_validate({"type": "function", "function": {"name": "bare"}}),
        Tool.model_validate({"type": "function", "function": {"name": "refs", "parameters": with_defs}}),
    ]
    schema = required_schema(tools)
    assert schema["type"] == "array" and schema["minItems"] == 1 and "maxItems" not in schema
    options = schema["items"]["anyOf"]
    assert [o["properties"]["name"] for o in options] == [
        {"type": "string", "enum": [n]} for n in ("get_weather", "get_time", "bare", "refs")
    ]
    assert options[0]["properties"]["parameters"] == WEATHER and options[0]["required"] == ["name", "parameters"]
    assert options[2]["properties"]["parameters"] == {"type": "object", "properties": {}}
    # $defs move to the top, where the references point; the tool's own schema is untouched.
    assert schema["$defs"] == defs and "$defs" not in options[3]["properties"]["parameters"]
    assert "$defs" in tools[3].function.parameters
    good = [{"name": "get_time", "parameters": {"zone": "UTC"}}, {"name": "refs", "parameters": {"u": "c"}}]
    jsonschema.validate(good, schema)
    for bad in ([], [{"name": "get_time", "parameters": {"zone": "PST"}}], [{"name": "refs", "parameters": {"u": 1}}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    assert required_schema(tools, parallel=False)["maxItems"] == 1
    clash = {"type": "object", "$defs": {"Unit": {"type": "integer"}}}
    tools.append(Tool.model_validate({"type": "function", "function": {"name": "other", "parameters": clash}}))
    with pytest.raises(APIError) as info:
        required_schema(tools)
    assert info.value.param == "tools.4.function.parameters.$defs"


def test_forced_outputs_parse_into_calls_or_stay_content():
    content, (call,) = NamedParser("f").extract('{"a": [1, "é"]}')
    assert content is None and call.name == "f" and json.loads(call.arguments) == {"a": [1, "é"]}
    assert NamedParser("f").extract('{"a": [1, ') == ('{"a": [1, ', [])  # cut at max_tokens
    content, calls = RequiredParser().extract(
        '[{"name": "f", "parameters": {}}, {"name": "g", "parameters": {"x": 1}}]'
    )
    assert content is None and [(c.name, json.loads(c.arguments)) for c in calls] == [("f", {}), ("g", {"x": 1})]
    for text in ('[{"name": "f", "parameters": {}', "[]", '{"name": "f"}'):
        assert RequiredParser().extract(text) == (text, [])
    # Streamed: nothing before the end, then the calls (or the text).
    stream = output_parser(ToolUse("required"), None).stream()
    assert stream.feed('[{"name": "f", ') == [] and stream.feed('"parameters": {}}]') == []
    deltas = [e.delta() for e in stream.finish()]
    assert deltas[0]["tool_calls"][0]["function"] == {"name": "f", "arguments": ""}
    assert deltas[1]["tool_calls"][0]["function"] == {"arguments": "{}"}
    assert ToolUse("named", "f").finish_reason("stop", stream.tool_calls) == "stop"  # as OpenAI's
    assert ToolUse("required").finish_reason("stop", stream.tool_calls) == "tool_calls"
    assert ToolUse("required").finish_reason("length", []) == "length"


def test_a_forced_choice_becomes_the_structured_output_and_excludes_the_requests_own():
    base = {"messages": MESSAGES, "tools": TOOLS}
    named = ChatCompletionRequest.model_validate(
        {**base, "tool_choice": {"type": "function", "function": {"name": "get_time"}}}
    ).to_jobs()
    assert json.loads(named.params.structured_outputs.json_schema) == TIME and named.tools == ToolUse(
        "named", "get_time"
    )
    req = ChatCompletionRequest.model_validate({**base, "tool_choice": "required", "parallel_tool_calls": False})
    so = req.to_jobs().params.structured_outputs
    assert json.loads(so.json_schema)["maxItems"] == 1 and so.disable_any_whitespace
    auto = ChatCompletionRequest.model_validate({**base, "structured_outputs": {"regex": "a"}}).to_jobs()
    assert auto.tools == ToolUse("auto", names=("get_weather", "get_time"))  # hermes's bare JSON calls are of these
    assert auto.params.structured_outputs.regex == "a"
    assert ChatCompletionRequest.model_validate({**base, "tool_choice": "none"}).to_jobs().tools is None
    assert auto.chat.tools == TOOLS  # the template gets them, whatever the choice
    for field, value in (
        ("response_format", {"type": "json_object"}),
        ("structured_outputs", {"regex": "a"}),
        ("guided_choice", ["a"]),
    ):
        with pytest.raises(APIError) as info:
            ChatCompletionRequest.model_validate({**base, "tool_choice": "required", field: value}).to_jobs()
        assert info.value.param == field and "tool_choice" in info.value.message


# -- requests refused before anything is queued ----------------------------------------------


def test_bad_tool_requests_are_400_naming_the_field(bare_api):
    call = {"id": "c1", "type": "function", "function": {"name": "get_time", "arguments": '{"zone": "UTC"}'}}
    cases = [
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice.function.name",
        ),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tool_choice": {"type": "function", "function": {"name": "get_time"}}}, "tool_choice"),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]},
            "tools.0.function.parameters",
        ),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"properties": []}}}]},
            "tools.0.function.parameters.properties",
        ),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"required": "x"}}}]},
            "tools.0.function.parameters.required",
        ),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": []}}]}, "tools.0.function.parameters"),
        ({"tools": [{"type": "function", "function": {"name": "no spaces"}}]}, "tools.0.function.name"),
        ({"tools": [{"type": "function"}]}, "tools.0.function"),
        ({"tools": TOOLS + TOOLS[:1]}, "tools.2.function.name"),
        ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format"),
        ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
        ({"messages": [*MESSAGES, {"role": "tool", "content": "sunny"}]}, "messages.1.tool_call_id"),
        ({"messages": [*MESSAGES, {"role": "user", "content": "x", "tool_call_id": "c1"}]}, "messages.1.tool_call_id"),
        ({"messages": [*MESSAGES, {"role": "user", "content": "x", "tool_calls": [call]}]}, "messages.1.tool_calls"),
        ({"messages": [*MESSAGES, {"role": "assistant"}]}, "messages.1.content"),
        (
            {
                "messages": [
                    *MESSAGES,
                    {"role": "assistant", "tool_calls": [{**call, "function": {"name": "f", "arguments": "[1]"}}]},
                ]
            },
            "messages.1.tool_calls.0.function.arguments",
        ),
    ]
    for extra, param in cases:
        body = {"model": bare_api.name, "messages": MESSAGES, **extra}
        resp = bare_api.post("/v1/chat/completions", json=body)
        assert resp.status_code == 400, (extra, resp.text)
        err = resp.json()["error"]
        assert err["param"] == param or err["param"].startswith(param + "."), (extra, err)
    # `auto` (the default with tools) without a parser: how to enable it, as vLLM says.
    resp = bare_api.post("/v1/chat/completions", json={"model": bare_api.name, "messages": MESSAGES, "tools": TOOLS})
    err = resp.json()["error"]
    assert resp.status_code == 400 and err["param"] == "tool_choice" and "GENQ_TOOL_CALL_PARSER" in err["message"]


# -- through the stack -----------------------------------------------------------------------


def test_the_template_renders_tools_calls_and_results(tools_stack):
    call = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}
    messages = [
        *MESSAGES,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny, 21 C"},
    ]
    resp = tools_stack.post("/tokenize", json={"model": tools_stack.name, "messages": messages, "tools": TOOLS})
    assert resp.status_code == 200, resp.text
    text = tools_stack.post("/detokenize", json={"tokens": resp.json()["tokens"]}).json()["prompt"]
    assert json.dumps(TOOLS[1], ensure_ascii=False) in text.replace("\n", "")
    assert '<tool_call>{"name": "get_weather", "arguments": {"city": "Rome"}}</tool_call>' in text
    assert '<tool_response id="c1">sunny, 21 C</tool_response>' in text


def test_a_tool_result_round_trip_is_answered(client, tools_stack):
    first = create(client, tools_stack, tools=TOOLS, tool_choice="required", parallel_tool_calls=False)
    (call,) = first.choices[0].message.tool_calls
    messages = [
        *MESSAGES,
        first.choices[0].message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": "sunny"},
    ]
    again = create(client, tools_stack, messages=messages, tools=TOOLS, tool_choice="none", max_tokens=4)
    assert again.choices[0].message.tool_calls is None and again.usage.prompt_tokens > first.usage.prompt_tokens


def test_auto_parses_the_models_call_out_of_the_content(client, tools_stack):
    forced = {"structured_outputs": {"choice": [f"Let me look.\n{CALL}"]}}
    out = create(client, tools_stack, tools=TOOLS, extra_body=forced)
    (choice,) = out.choices
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content.strip() == "Let me look." and "<tool_call>" not in choice.message.content
    (call,) = calls_of(choice.message)
    assert call["name"] == "get_weather" and json.loads(call["arguments"]) == {"city": "Paris", "unit": "celsius"}
    assert call["id"].startswith("chatcmpl-tool-")
    # Streamed, a client assembling the deltas gets the same content and calls.
    content, calls, finish = assembled(create(client, tools_stack, tools=TOOLS, extra_body=forced, stream=True))
    assert (content, without_ids(calls), finish) == (choice.message.content, without_ids([call]), "tool_calls")
    assert calls[0]["id"].startswith("chatcmpl-tool-")
    # `none`: no parsing, the markup is the content (the tools were still rendered).
    out = create(client, tools_stack, tools=TOOLS, tool_choice="none", extra_body=forced)
    assert out.choices[0].message.content == f"Let me look.\n{CALL}" and out.choices[0].message.tool_calls is None
    assert out.choices[0].finish_reason == "stop"
    # The bare or fenced JSON small models write instead of the markup (Qwen2.5-Coder-0.5B), a
    # call of one of the request's tools: a call, streamed the same; of another name: content.
    fenced = {"structured_outputs": {"choice": [f"```json\n{JSON_CALL}\n```"]}}
    out = create(client, tools_stack, tools=TOOLS, extra_body=fenced)
    assert out.choices[0].finish_reason == "tool_calls" and out.choices[0].message.content is None
    assert without_ids(calls_of(out.choices[0].message)) == without_ids([call])
    content, calls, finish = assembled(create(client, tools_stack, tools=TOOLS, extra_body=fenced, stream=True))
    assert (content, without_ids(calls), finish) == (None, without_ids([call]), "tool_calls")
    other = {"structured_outputs": {"choice": [JSON_CALL.replace("get_weather", "get_news")]}}
    out = create(client, tools_stack, tools=TOOLS, extra_body=other)
    assert out.choices[0].message.tool_calls is None and out.choices[0].message.content.startswith('{"name"')
    # Without a call in the output, the answer is plain content.
    out = create(client, tools_stack, tools=TOOLS, extra_body={"structured_outputs": {"choice": ["Sunny."]}})
    assert out.choices[0].message.content == "Sunny." and out.choices[0].finish_reason == "stop"
    assert "tool_calls" not in out.choices[0].message.model_dump(exclude_none=True)


def test_a_named_function_is_called_with_arguments_of_its_schema(client, tools_stack):
    choice_ = {"type": "function", "function": {"name": "get_weather"}}
    out = create(client, tools_stack, tools=TOOLS, tool_choice=choice_)
    (choice,) = out.choices
    assert choice.message.content is None and choice.finish_reason == "stop"  # OpenAI's answer to a named choice
    (call,) = calls_of(choice.message)
    assert call["name"] == "get_weather"
    jsonschema.validate(json.loads(call["arguments"]), WEATHER)
    content, calls, finish = assembled(create(client, tools_stack, tools=TOOLS, tool_choice=choice_, stream=True))
    assert (content, without_ids(calls), finish) == (None, without_ids([call]), "stop")


def test_required_calls_tools_with_arguments_of_their_schemas(client, tools_stack):
    for parallel in (False, True):
        out = create(
            client, tools_stack, tools=TOOLS, tool_choice="required", parallel_tool_calls=parallel, max_tokens=200
        )
        (choice,) = out.choices
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        calls = calls_of(choice.message)
        assert len(calls) >= 1 and (parallel or len(calls) == 1)
        for call in calls:
            jsonschema.validate(json.loads(call["arguments"]), SCHEMAS[call["name"]])
        stream = create(
            client,
            tools_stack,
            tools=TOOLS,
            tool_choice="required",
            parallel_tool_calls=parallel,
            max_tokens=200,
            stream=True,
        )
        assert assembled(stream)[0] is None
    # The same request streamed: the same calls (greedy), each with its own id.
    content, streamed, finish = assembled(
        create(client, tools_stack, tools=TOOLS, tool_choice="required", max_tokens=200, stream=True)
    )
    assert (content, without_ids(streamed), finish) == (None, without_ids(calls), "tool_calls")
    assert len({c["id"] for c in streamed}) == len(streamed)


def test_a_batch_line_and_the_client_get_the_same_calls(client, tools_stack):
    from genqueue import Client

    forced = {"structured_outputs": {"choice": [CALL]}}
    line = {"messages": MESSAGES, "tools": TOOLS, "max_tokens": 200, "temperature": 0}
    lines = [
        {**line, **forced},
        {**line, "tool_choice": "required", "parallel_tool_calls": False},
        {**line, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
        {**line, "structured_outputs": {"choice": [JSON_CALL]}},  # the tools' names go with the line
    ]
    with Client(tools_stack.base) as c:
        rows = c.run_batch(lines, model=tools_stack.name, endpoint="/v1/chat/completions", progress=False)
        direct = c.chat_completion(
            MESSAGES, model=tools_stack.name, **{k: v for k, v in lines[1].items() if k != "messages"}
        )
    auto, required, bad, bare = (r["response"] for r in rows)
    assert bare["body"]["choices"][0]["message"]["tool_calls"][0]["function"] == choice_function(auto)
    assert auto["status_code"] == 200 and required["status_code"] == 200, rows
    choice = auto["body"]["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    assert [c["function"]["name"] for c in choice["message"]["tool_calls"]] == ["get_weather"]
    assert json.loads(choice["message"]["tool_calls"][0]["function"]["arguments"]) == {
        "city": "Paris",
        "unit": "celsius",
    }
    # The forced call of a line is the client's own (greedy), ids aside.
    (call,) = required["body"]["choices"][0]["message"]["tool_calls"]
    (same,) = direct["choices"][0]["message"]["tool_calls"]
    assert call["function"] == same["function"] and call["id"] != same["id"]
    jsonschema.validate(json.loads(call["function"]["arguments"]), SCHEMAS[call["function"]["name"]])
    assert bad["status_code"] == 400 and bad["body"]["error"]["param"] == "tool_choice.function.name"


def choice_function(response: dict) -> dict:
    return response["body"]["choices"][0]["message"]["tool_calls"][0]["function"]


def test_genq_chat_calls_tools(tools_stack, tmp_path, capsys, monkeypatch):
    """`genq chat --tools FILE --tool-choice NAME`: the forced call prints as a JSON line;
    `--tool-choice none` prints the content; bad options exit with a message."""
    from genqueue.cli import main

    tools = tmp_path / "tools.json"
    tools.write_text(json.dumps(TOOLS))
    monkeypatch.setenv("GENQ_URL", tools_stack.base)
    base = ["chat", "What time is it?", "--model", tools_stack.name, "--temperature", "0", "--tools", str(tools)]
    assert main([*base, "--tool-choice", "get_time"]) == 0
    (line,) = capsys.readouterr().out.splitlines()
    call = json.loads(line)
    assert call["name"] == "get_time" and call["arguments"]["zone"] in ("UTC", "CET")
    assert main([*base, "--tool-choice", "none", "--max-tokens", "4"]) == 0
    assert capsys.readouterr().out.strip()  # the content: text, not a call
    with pytest.raises(SystemExit, match="--tool-choice needs --tools"):
        main(["chat", "hi", "--tool-choice", "required"])
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(SystemExit, match="bad.json"):
        main(["chat", "hi", "--tools", str(tmp_path / "bad.json")])


@pytest.fixture(scope="module")
def real_stack(make_module_stack):
    """SmolLM2-135M-Instruct (scripts/realmodel.py), with its own chat template, which does not
    render `tools`: a forced call needs none."""
    from scripts import realmodel

    s = make_module_stack(GENQ_MODEL=str(realmodel.ensure()), GENQ_MAX_BATCH_SIZE="4")
    s.start_api()
    s.start_worker()
    s.wait_ready(120)
    return s


def test_the_real_model_makes_a_required_call_that_matches_the_schema(real_stack):
    city = {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 40}, "days": {"type": "integer"}},
        "required": ["city", "days"],
    }
    tools = [{"type": "function", "function": {"name": "get_forecast", "parameters": city}}]
    with openai.OpenAI(base_url=real_stack.base + "/v1", api_key="unused", max_retries=0) as c:
        out = c.chat.completions.create(
            model=real_stack.name,
            messages=[{"role": "user", "content": "What will the weather be in Paris for the next 3 days?"}],
            tools=tools,
            tool_choice="required",
            max_tokens=96,
            temperature=0,
        )
    (choice,) = out.choices
    assert choice.finish_reason == "tool_calls", choice
    for call in choice.message.tool_calls:
        assert call.function.name == "get_forecast"
        jsonschema.validate(json.loads(call.function.arguments), city)

"""The output parsers of webapp/parsers/: each tool-call format on what its models write (one
call, several, content before, no call, broken markup, unicode, nested arguments), the two
reasoning parsers, and the property the API's streaming rests on: for every parser and any
split of an output into deltas (one character at a time included) the stream's content,
reasoning and calls are the unstreamed answer's. Pure text: no Redis, no model."""

from __future__ import annotations

import json
import random
import re

import pytest

from webapp.parsers import (
    REASONING_FIELD,
    Content,
    OutputParser,
    Reasoning,
    ToolCallArguments,
    ToolCallStart,
    UnknownParser,
    reasoning_parser,
    tool_parser,
)

W = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
VLLM_ID = re.compile(r"chatcmpl-tool-[0-9a-f]{32}")
NESTED = {"filter": {"tags": ["a", "b"], "range": {"min": -1.5, "max": None}}, "ok": True}


def make(parser: str):
    """A tool parser by its name; `hermes:a,b` is hermes given the request's tools a and b."""
    name, _, names = parser.partition(":")
    return tool_parser(name, tuple(filter(None, names.split(","))))


def calls(parser, text):
    content, found = make(parser).extract(text)
    return content, [(c.name, json.loads(c.arguments)) for c in found]


# (parser, output, expected content, expected calls as (name, arguments object))
CASES = [
    # hermes
    ("hermes", "The capital of France is Paris.", "The capital of France is Paris.", []),
    (
        "hermes",
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
        None,
        [("get_weather", {"city": "Paris"})],
    ),
    (
        "hermes",
        'Let me check.\n<tool_call>\n{"name": "a", "arguments": {"x": 1}}\n</tool_call>\n<tool_call>\n{"name": "b", "arguments": {}}\n</tool_call>',
        "Let me check.\n",
        [("a", {"x": 1}), ("b", {})],
    ),
    (
        "hermes",
        '<tool_call>{"name": "search", "arguments": ' + json.dumps(NESTED) + "}</tool_call>",
        None,
        [("search", NESTED)],
    ),
    (
        "hermes",
        'Météo ☀️ <tool_call>{"name": "wetter", "arguments": {"stadt": "Zürich 東京 🌧"}}</tool_call>',
        "Météo ☀️ ",
        [("wetter", {"stadt": "Zürich 東京 🌧"})],
    ),
    ("hermes", '<tool_call>{"name": "f", "arguments": {"a": 1}}', None, [("f", {"a": 1})]),  # never closed, JSON whole
    ("hermes", 'x <tool_call>{"name": "f", "argum', 'x <tool_call>{"name": "f", "argum', []),  # cut short
    ("hermes", "<tool_call>{name: f}</tool_call>", "<tool_call>{name: f}</tool_call>", []),
    ("hermes", '<tool_call>{"arguments": {}}</tool_call>', '<tool_call>{"arguments": {}}</tool_call>', []),  # no name
    ("hermes", '<tool_call>{"name": "f"}</tool_call>', '<tool_call>{"name": "f"}</tool_call>', []),  # no arguments
    (
        "hermes",
        '<tool_call>{"name": "f", "arguments": [1]}</tool_call>',
        '<tool_call>{"name": "f", "arguments": [1]}</tool_call>',
        [],
    ),
    (  # one broken call: all of it is content, as vLLM
        "hermes",
        '<tool_call>{"name": "a", "arguments": {}}</tool_call><tool_call>oops</tool_call>',
        '<tool_call>{"name": "a", "arguments": {}}</tool_call><tool_call>oops</tool_call>',
        [],
    ),
    ("hermes", "a <tool_ call> b <tool_call", "a <tool_ call> b <tool_call", []),  # no marker
    ("hermes", '<tool_call>{"name": "f", "arguments": "{\\"a\\": 2}"}</tool_call>', None, [("f", {"a": 2})]),  # quoted
    # hermes given the request's tools: bare or fenced JSON calls of them (Qwen2.5-Coder's)
    ("hermes:get_weather", W, None, [("get_weather", {"city": "Paris"})]),
    ("hermes:get_weather,f", "\n " + W + "\n", None, [("get_weather", {"city": "Paris"})]),
    ("hermes:get_weather", "```json\n" + W + "\n```", None, [("get_weather", {"city": "Paris"})]),
    ("hermes:get_weather", "```json\n" + W, None, [("get_weather", {"city": "Paris"})]),  # fence unclosed
    ("hermes:get_weather", "```\n" + W + "\n```\n", None, [("get_weather", {"city": "Paris"})]),
    (
        "hermes:get_weather",
        "Let me check.\n```JSON\n" + W + "\n```",
        "Let me check.\n",
        [("get_weather", {"city": "Paris"})],
    ),
    (
        "hermes:get_weather,f",
        "```json\n["
        + W
        + ', {"name": "f", "parameters": {"x": "ü"}}]\n```\n```json\n{"name": "f", "arguments": {}}\n```',
        None,
        [("get_weather", {"city": "Paris"}), ("f", {"x": "ü"}), ("f", {})],
    ),
    (
        "hermes:get_weather,f",
        W + "\n" + W.replace("Paris", "Rome"),
        None,
        [("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Rome"})],
    ),
    (
        "hermes:get_weather",
        "```python\nx = {1: 2}\n```\n```json\n" + W + "\n```",
        "```python\nx = {1: 2}\n```\n",
        [("get_weather", {"city": "Paris"})],
    ),
    (
        "hermes:get_weather",
        "<tool_call>" + W + "</tool_call>",
        None,
        [("get_weather", {"city": "Paris"})],
    ),  # the markup first
    ("hermes:other", W, W, []),  # not one of the tools
    ("hermes", W, W, []),  # no tools given: as vLLM, markup only
    (
        "hermes:get_weather",
        '{"name": "get_weather", "arguments": {"city": "Par',
        '{"name": "get_weather", "arguments": {"city": "Par',
        [],
    ),  # cut short
    ("hermes:get_weather", '{"name": "get_weather"}', '{"name": "get_weather"}', []),  # no arguments
    ("hermes:get_weather", W + " Done.", W + " Done.", []),  # text after a bare call
    (
        "hermes:get_weather",
        "```json\n" + W + "\n```\nThat fetches it.",
        "```json\n" + W + "\n```\nThat fetches it.",
        [],
    ),
    (
        "hermes:get_weather",
        'Use: {"name": "get_weather", "arguments": {}}',
        'Use: {"name": "get_weather", "arguments": {}}',
        [],
    ),  # a bare call only opens the output
    ("hermes:get_weather", '```json\n{"city": "Paris"}\n```', '```json\n{"city": "Paris"}\n```', []),
    ("hermes:get_weather", "[1, 2]", "[1, 2]", []),
    ("hermes:get_weather", "```python\nprint('{')\n```", "```python\nprint('{')\n```", []),
    ("hermes:get_weather", "``` \n", "``` \n", []),
    ("hermes:get_weather", "```json", "```json", []),
    ("hermes:get_weather", " \n", " \n", []),
    ("hermes:get_weather", "It is sunny in Paris.", "It is sunny in Paris.", []),
    # llama3_json
    ("llama3_json", "Paris is the capital of France.", "Paris is the capital of France.", []),
    (
        "llama3_json",
        '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}',
        None,
        [("get_weather", {"city": "Paris"})],
    ),
    ("llama3_json", '{"name": "f", "arguments": ' + json.dumps(NESTED) + "}", None, [("f", NESTED)]),
    (
        "llama3_json",
        '\n{"name": "a", "parameters": {"q": "Zürich ✓"}}; {"name": "b", "parameters": {}}',
        None,
        [("a", {"q": "Zürich ✓"}), ("b", {})],
    ),
    ("llama3_json", '{"name": "f", "parameters": {"a": 1}', '{"name": "f", "parameters": {"a": 1}', []),  # cut short
    ("llama3_json", '{"answer": 42}', '{"answer": 42}', []),  # JSON, not a call
    ("llama3_json", '{"name": "a", "parameters": {}}; {"oops": 1}', '{"name": "a", "parameters": {}}; {"oops": 1}', []),
    ("llama3_json", 'Sure: {"name": "f", "parameters": {}}', 'Sure: {"name": "f", "parameters": {}}', []),  # after text
    ("llama3_json", "<|python_tag|>print('hi')", "<|python_tag|>print('hi')", []),
    ("llama3_json", "<|python", "<|python", []),
    # mistral
    ("mistral", "Bonjour !", "Bonjour !", []),
    (
        "mistral",
        '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}]',
        None,
        [("get_weather", {"city": "Paris"})],
    ),
    (
        "mistral",
        '\n [TOOL_CALLS][{"name": "a", "arguments": {"x": [1, {"y": "ü"}]}}, {"name": "b"}]',
        None,
        [("a", {"x": [1, {"y": "ü"}]}), ("b", {})],
    ),
    (
        "mistral",
        'Checking. [TOOL_CALLS] {"name": "f", "arguments": ' + json.dumps(NESTED) + "}",
        "Checking. ",
        [("f", NESTED)],
    ),
    (
        "mistral",
        'Sure[TOOL_CALLS]get_weather[ARGS]{"city": "Zürich"}[TOOL_CALLS]now{}',
        "Sure",
        [("get_weather", {"city": "Zürich"}), ("now", {})],
    ),
    (
        "mistral",
        '[TOOL_CALLS] [{"name": "f", "arguments": {',
        '[TOOL_CALLS] [{"name": "f", "arguments": {',
        [],
    ),  # cut short
    ("mistral", '[TOOL_CALLS] [{"title": "f"}]', '[TOOL_CALLS] [{"title": "f"}]', []),
    ("mistral", "[TOOL_CALLS]", "[TOOL_CALLS]", []),
    ("mistral", "[TOOL_CALLS]f[ARGS]nope", "[TOOL_CALLS]f[ARGS]nope", []),
    ("mistral", "a [TOOL_CALL] b [TOOL", "a [TOOL_CALL] b [TOOL", []),
    # pythonic
    ("pythonic", "The weather in Paris is sunny.", "The weather in Paris is sunny.", []),
    ("pythonic", '[get_weather(city="Paris")]', None, [("get_weather", {"city": "Paris"})]),
    (
        "pythonic",
        "[a(x=1, y='Zürich 🌍', z=None), b(), c.d(flag=true, n=null, neg=-3, t=(1, 2), s={'k': [1.5, False]}, f=f'x')]",
        None,
        [
            ("a", {"x": 1, "y": "Zürich 🌍", "z": None}),
            ("b", {}),
            ("c.d", {"flag": True, "n": None, "neg": -3, "t": [1, 2], "s": {"k": [1.5, False]}, "f": "x"}),
        ],
    ),
    ("pythonic", "\n [search(q=" + repr(NESTED) + ")]\n", None, [("search", {"q": NESTED})]),
    ("pythonic", "[f(x=y)]", "[f(x=y)]", []),  # not a literal
    ("pythonic", "[f(1)]", "[f(1)]", []),  # positional
    ("pythonic", "[f(x=__import__('os').system('true'))]", "[f(x=__import__('os').system('true'))]", []),
    ("pythonic", "[f(a=1), g(b=", "[f(a=1), g(b=", []),  # cut short
    ("pythonic", "[1, 2, 3]", "[1, 2, 3]", []),
    ("pythonic", "[]", "[]", []),
    ("pythonic", "[f(a=1)] and more", "[f(a=1)] and more", []),
    ("pythonic", "[f(a=1e999)]", "[f(a=1e999)]", []),  # infinity is not JSON
]


@pytest.mark.parametrize("parser,text,content,expected", CASES)
def test_extract(parser, text, content, expected):
    assert calls(parser, text) == (content, expected)


def test_tool_call_shape_and_ids():
    content, found = tool_parser("hermes").extract('<tool_call>{"name": "f", "arguments": {"a": "é"}}</tool_call>')
    call = found[0]
    assert call.arguments == '{"a": "é"}'  # as vLLM writes it: ensure_ascii=False, ", " and ": "
    assert VLLM_ID.fullmatch(call.id)
    assert call.to_openai() == {"id": call.id, "type": "function", "function": {"name": "f", "arguments": '{"a": "é"}'}}
    _, found = tool_parser("mistral").extract(
        '[TOOL_CALLS][{"name": "f", "arguments": {}}, {"name": "g", "arguments": {}}]'
    )
    assert all(re.fullmatch(r"[A-Za-z0-9]{9}", c.id) for c in found)  # Mistral's templates want these
    assert found[0].id != found[1].id


def test_registry():
    for name in ("hermes", "llama3_json", "llama4_json", "mistral", "pythonic"):
        assert tool_parser(name).extract("hello") == ("hello", [])
    for name in ("deepseek_r1", "qwen3"):
        assert reasoning_parser(name).extract("a</think>b") == ("a", "b")
    with pytest.raises(UnknownParser, match="unknown tool-call parser 'hermes2': the names are hermes, llama3_json"):
        tool_parser("hermes2")
    with pytest.raises(ValueError, match="unknown reasoning parser 'r1': the names are deepseek_r1, qwen3"):
        reasoning_parser("r1")


# (parser, enable_thinking, output, reasoning, content)
THINKING = [
    ("deepseek_r1", True, "<think>\nLet me think.\n</think>\n\nParis.", "\nLet me think.\n", "\n\nParis."),
    ("deepseek_r1", True, "The template opened it.</think>Paris.", "The template opened it.", "Paris."),
    ("deepseek_r1", True, "Still thinking when cut", "Still thinking when cut", None),
    ("deepseek_r1", True, "<think>a</think>b</think>c", "a", "b</think>c"),
    ("deepseek_r1", True, "</think>only content", None, "only content"),
    ("deepseek_r1", True, "<think></think>", None, None),
    ("deepseek_r1", False, "r</think>c", "r", "c"),  # deepseek_r1 ignores enable_thinking, as vLLM's
    ("deepseek_r1", True, "Größe <think>思考 🤔</think>答え", "Größe 思考 🤔", "答え"),
    ("deepseek_r1", True, "a <thin k> </thinking> <think", "a <thin k> </thinking> <think", None),
    ("qwen3", True, "<think>\nplan\n</think>\n\nanswer", "\nplan\n", "\n\nanswer"),
    ("qwen3", True, "plan</think>answer", "plan", "answer"),
    ("qwen3", True, "no tags at all", "no tags at all", None),  # vLLM 0.32: thinking on, all reasoning
    ("qwen3", True, "<think>a</think>b</think>c", "a", "bc"),  # a stray end dropped, as vLLM's
    (
        "qwen3",
        True,
        '<think>I will call.<tool_call>{"name": "f"}</tool_call>',
        "I will call.",
        '<tool_call>{"name": "f"}</tool_call>',
    ),
    ("qwen3", False, "no tags at all", None, "no tags at all"),
    ("qwen3", False, "<think>kept</think>as is", None, "<think>kept</think>as is"),
]


@pytest.mark.parametrize("parser,enable,text,reasoning,content", THINKING)
def test_reasoning(parser, enable, text, reasoning, content):
    assert reasoning_parser(parser, enable_thinking=enable).extract(text) == (reasoning, content)


def splits(text: str, seed: int):
    """`text` cut into deltas: whole, one character each, and random cuts (pieces of 0 to 12)."""
    yield [text]
    yield list(text)
    rng = random.Random(seed)
    for _ in range(20):
        pieces, at = [], 0
        while at < len(text):
            size = rng.randint(0, 12)
            pieces.append(text[at : at + size])
            at += size
        yield pieces


def run(stream, deltas):
    events = []
    for delta in deltas:
        events += stream.feed(delta)
    return events + stream.finish()


def assemble(events):
    """What a client makes of a stream's deltas (as the openai client's stream helpers do)."""
    content = "".join(e.text for e in events if isinstance(e, Content))
    reasoning = "".join(e.text for e in events if isinstance(e, Reasoning))
    found = {}
    for e in events:
        if isinstance(e, ToolCallStart):
            assert e.index == len(found) and e.index not in found  # indexes in order, each started once
            found[e.index] = [e.name, ""]
        elif isinstance(e, ToolCallArguments):
            assert e.index in found  # arguments only after the call's start
            found[e.index][1] += e.arguments
        else:
            assert e.text  # no empty deltas
    return reasoning or None, content or None, [tuple(found[i]) for i in range(len(found))]


@pytest.mark.parametrize("case", range(len(CASES)))
def test_tool_stream_equals_extract(case):
    parser, text, content, _ = CASES[case]
    want_content, want_calls = make(parser).extract(text)
    for deltas in splits(text, case):
        _, got_content, got_calls = assemble(run(make(parser).stream(), deltas))
        assert got_content == want_content, deltas
        assert got_calls == [(c.name, c.arguments) for c in want_calls], deltas


@pytest.mark.parametrize("case", range(len(THINKING)))
def test_reasoning_stream_equals_extract(case):
    parser, enable, text, _, _ = THINKING[case]
    want = reasoning_parser(parser, enable).extract(text)
    for deltas in splits(text, case):
        reasoning, content, found = assemble(run(reasoning_parser(parser, enable).stream(), deltas))
        assert (reasoning, content) == want and not found, deltas


def test_content_streams_before_the_end():
    """Content is sent as it comes, held back only where markup may begin."""
    stream = tool_parser("hermes").stream()
    assert stream.feed("Let me ") == [Content("Let me ")]
    assert stream.feed("check <tool") == [Content("check ")]  # "<tool" may begin a call
    assert stream.feed('_call>{"name": "f", "arguments": {}}</tool_call>') == []
    events = stream.finish()
    assert [type(e) for e in events] == [ToolCallStart, ToolCallArguments]
    assert events[0].delta() == {
        "tool_calls": [{"index": 0, "id": events[0].id, "type": "function", "function": {"name": "f", "arguments": ""}}]
    }
    assert events[1].delta() == {"tool_calls": [{"index": 0, "function": {"arguments": "{}"}}]}
    assert [c.name for c in stream.calls] == ["f"]
    plain = tool_parser("pythonic").stream()
    assert (
        plain.feed("  ") == [] and plain.feed("The") == [Content("  The")] and plain.feed(" end") == [Content(" end")]
    )
    thinking = reasoning_parser("deepseek_r1").stream()
    assert thinking.feed("hmm</th") == [Reasoning("hmm")]
    assert thinking.feed("ink>Paris") == [Content("Paris")]
    assert Reasoning("x").delta() == {REASONING_FIELD: "x"} and REASONING_FIELD == "reasoning"  # vLLM 0.32's field


COMBINED = [
    (
        "qwen3",
        "hermes",
        '<think>\nWeather, so call it.\n</think>\n\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
    ),
    ("qwen3", "hermes", '<think>Call without closing.<tool_call>{"name": "f", "arguments": {"a": [1]}}</tool_call>'),
    ("qwen3", "hermes", "<think>short</think>Just an answer, no call."),
    (
        "deepseek_r1",
        "hermes",
        'The call <tool_call>{"name": "f", "arguments": {}}</tool_call> is only thought of.</think>Done.',
    ),
    ("deepseek_r1", "pythonic", "Use the tool.</think>\n[get_time(tz='Europe/Paris')]"),
    ("deepseek_r1", "llama3_json", 'ok</think> {"name": "f", "parameters": {"x": "ÿ"}}'),
    ("deepseek_r1", "mistral", 'hm</think>Voilà[TOOL_CALLS] [{"name": "f", "arguments": {}}]'),
    (None, "hermes", 'Hi <tool_call>{"name": "f", "arguments": {}}</tool_call>'),
    ("qwen3", None, "<think>r</think>c"),
    (None, None, "plain"),
]


@pytest.mark.parametrize("case", range(len(COMBINED)))
def test_output_parser(case):
    reasoning, tools, text = COMBINED[case]
    parser = OutputParser(reasoning and reasoning_parser(reasoning), tools and tool_parser(tools))
    want = parser.parse(text)
    for deltas in splits(text, case):
        stream = parser.stream()
        got = assemble(run(stream, deltas))
        assert got == (want.reasoning, want.content, [(c.name, c.arguments) for c in want.tool_calls]), deltas
        assert [c.name for c in stream.tool_calls] == [c.name for c in want.tool_calls]


def test_output_parser_examples():
    qwen = OutputParser(reasoning_parser("qwen3"), tool_parser("hermes"))
    got = qwen.parse(COMBINED[0][2])
    assert (got.reasoning, got.content) == ("\nWeather, so call it.\n", "\n\n")
    assert [(c.name, c.arguments) for c in got.tool_calls] == [("get_weather", '{"city": "Paris"}')]
    r1 = OutputParser(reasoning_parser("deepseek_r1"), tool_parser("hermes")).parse(COMBINED[3][2])
    assert r1.tool_calls == [] and r1.content == "Done." and "<tool_call>" in r1.reasoning
    assert OutputParser().parse("") == OutputParser().parse("") and OutputParser().parse("").content is None


FRAGMENTS = [
    "<tool_call>", "</tool_call>", "<tool_", "[TOOL_CALLS]", "[TOOL_", "[ARGS]", "<|python_tag|>", "<|py",
    "<think>", "</think>", "</thi", "<th", '{"name": "f", "arguments": {"a": 1}}', '{"name": "g", "parameters": {}}',
    '[{"name": "h", "arguments": {}}]', "[f(a=1)]", "[g(b='é'), h()]", "f", "{}", "{", "}", "[", "]", "; ",
    " ", "\n", "text", "ü🌍", "<", ">", "/", "```", "```json\n", "`", "json", "```\n",
]  # fmt: skip
CALLS = [
    '<tool_call>{"name": "f", "arguments": {"a": [1, "ü"]}}</tool_call>', '<tool_call>\n{"name": "g", "arguments": {}}\n',
    '<|python_tag|>{"name": "f", "parameters": {"q": "x"}}', '{"name": "f", "arguments": {}}; {"name": "g", "parameters": {}}',
    '[TOOL_CALLS][{"name": "f", "arguments": {"b": null}}]', '[TOOL_CALLS]f[ARGS]{"x": "🌍"}[TOOL_CALLS]g{}',
    "[f(a=1, b='ü'), g()]", "[f(x=[1, {'k': None}])]",
    '```json\n{"name": "g", "arguments": {"a": "ü"}}\n```', '```\n[{"name": "f", "parameters": {}}]', "```python\nf()\n```\n",
]  # fmt: skip


def random_output(rng: random.Random) -> str:
    """A few random fragments around (usually) one well-formed call of some format, often after
    the end of a think span."""
    pieces = ["thought</think>"] if rng.random() < 0.4 else []
    pieces += [rng.choice(FRAGMENTS) for _ in range(rng.choice([0, 0, 1, 3]))]
    if rng.random() < 0.8:
        pieces.append(rng.choice(CALLS))
    return "".join(pieces + [rng.choice(FRAGMENTS) for _ in range(rng.choice([0, 0, 1, 2]))])


@pytest.mark.parametrize("seed", range(8))
def test_streams_equal_extract_on_random_outputs(seed):
    """Outputs made of markup fragments in random order: whatever they parse to, a stream split
    anywhere says the same, for every tool parser alone and under each reasoning parser."""
    rng = random.Random(seed)
    for _ in range(25):
        text = random_output(rng)
        for reasoning in (None, "deepseek_r1", "qwen3"):
            for tools in (None, "hermes", "hermes:f,g", "llama3_json", "mistral", "pythonic"):
                parser = OutputParser(reasoning and reasoning_parser(reasoning), tools and make(tools))
                want = parser.parse(text)
                want = (want.reasoning, want.content, [(c.name, c.arguments) for c in want.tool_calls])
                for deltas in [list(text), *list(splits(text, seed))[2:5]]:
                    assert assemble(run(parser.stream(), deltas)) == want, (reasoning, tools, deltas)

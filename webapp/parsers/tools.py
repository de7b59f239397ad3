"""The JSON tool-call formats, named and parsed as vLLM's `--tool-call-parser` does (vLLM 0.32,
vllm/tool_parsers/ and vllm/parser/mistral.py), so that a model served by vLLM with one of
them calls tools the same way here.

Where these differ from vLLM, it is to keep one rule: text that is not a well-formed call is
content, whole (vLLM sometimes returns only part of it), and a stream equals the unstreamed
answer (base.py says why calls are sent at the end). The differences are named at each class.
"""

from __future__ import annotations

import re

from webapp.parsers.base import Scan, ToolCall, ToolParser, call_of, mistral_call_id, raw_decode, tag_overlap


class MarkerParser(ToolParser):
    """Formats whose calls begin at a marker anywhere in the output: content is what precedes
    the first marker, and may stream until it comes."""

    marker = ""

    def scan(self, text: str, sent: int) -> tuple[int, Scan]:
        at = text.find(self.marker, sent)
        if at >= 0:
            return at, "tools"
        return len(text) - tag_overlap(text, self.marker), "open"


class HermesParser(MarkerParser):
    """Hermes 2 Pro, Qwen2.5/Qwen3 (their chat templates' `tools`), and most fine-tunes:

        optional content<tool_call>
        {"name": "f", "arguments": {"a": 1}}
        </tool_call>
        <tool_call>...</tool_call>

    As vLLM: content is the text before the first `<tool_call>` (None if empty); text between
    and after the calls is dropped; a last `<tool_call>` never closed (the output was cut, or
    the model stopped at the tag) is a call if its JSON is whole; one body that does not parse
    (or lacks `name` or `arguments`) makes the whole output content, calls included."""

    name = "hermes"
    marker = "<tool_call>"
    _calls = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)", re.DOTALL)

    def _extract(self, text):
        first = text.find(self.marker)
        if first < 0:
            return text or None, []
        calls = []
        for match in self._calls.finditer(text, first):
            body = match.group(1) if match.group(1) is not None else match.group(2)
            try:
                obj, end = raw_decode(body)
            except ValueError:
                return text, []
            call = call_of(obj, ("arguments",))
            if call is None or body[end:].strip():
                return text, []
            calls.append(call)
        return text[:first] or None, calls


class Llama3JsonParser(ToolParser):
    """Llama 3.1/3.2/3.3 with vLLM's tool_chat_template_llama3.x_json.jinja (and Llama 4 with
    its JSON template, vLLM's `llama4_json`): the whole output is calls,

        <|python_tag|>{"name": "f", "parameters": {"a": 1}}; {"name": "g", "parameters": {}}

    the tag optional, `arguments` taken as well as `parameters`. As vLLM's unstreamed parser,
    every `{` outside an earlier call begins one JSON call, what lies between them (`; `) is
    skipped, and one that does not parse or lacks `name` makes the whole output content. As
    vLLM's streamed parser, only an output that begins with the tag or `{` (here after any
    whitespace) is calls: vLLM's unstreamed parser also takes a `{...}` found after some text,
    dropping that text, which its streamed parser sends as content."""

    name = "llama3_json"
    tag = "<|python_tag|>"

    def _extract(self, text):
        rest = text.lstrip()
        if rest.startswith(self.tag):
            rest = rest[len(self.tag) :]
        elif not rest.startswith("{"):
            return text or None, []
        calls, at = [], rest.find("{")
        while at >= 0:
            try:
                obj, end = raw_decode(rest, at)
            except ValueError:
                return text, []
            call = call_of(obj, ("arguments", "parameters"))
            if call is None:
                return text, []
            calls.append(call)
            at = rest.find("{", end)
        return (None, calls) if calls else (text or None, [])

    def scan(self, text, sent):
        rest = text.lstrip()
        if not rest or (len(rest) < len(self.tag) and self.tag.startswith(rest)):
            return 0, "open"
        if rest.startswith(("{", self.tag)):
            return 0, "tools"
        return len(text), "text"


class MistralParser(MarkerParser):
    """Mistral and Mixtral instruct models: content, then `[TOOL_CALLS]` and the calls, either
    a JSON list (tokenizers before v11; one object is taken too)

        [TOOL_CALLS] [{"name": "f", "arguments": {"a": 1}}, {"name": "g", "arguments": {}}]

    or, from v11 (Mistral Small 3.1+, Devstral, Magistral), one call per marker:

        [TOOL_CALLS]f[ARGS]{"a": 1}[TOOL_CALLS]g{"b": 2}

    vLLM picks the form by the tokenizer's vocabulary; here the text after the marker does
    (a `[` or `{` is the list form). As vLLM: content before the marker that is only whitespace
    is None; missing arguments are `{}`; text after the list is dropped; ids are nine letters
    or digits (mistral_call_id). Unlike vLLM, a list entry that is not a call, or JSON that does
    not parse, makes the whole output content (vLLM skips the entry, or returns only the text
    after the marker)."""

    name = "mistral"
    marker = "[TOOL_CALLS]"
    args = "[ARGS]"
    _name = re.compile(r"\s*([A-Za-z0-9_.\-]+)\s*(?:\[ARGS\])?")

    def scan(self, text, sent):
        safe, state = super().scan(text, sent)
        # Content that is only whitespace before the calls is None: hold it until more comes.
        return (safe if text[:safe].strip() else 0), state

    def _extract(self, text):
        first = text.find(self.marker)
        if first < 0:
            return text or None, []
        content = text[:first] if text[:first].strip() else None
        segments = [s for s in text[first:].split(self.marker) if s.strip()]
        if not segments:
            return text, []
        if segments[0].lstrip()[:1] in ("[", "{"):
            calls = self._list(segments[0])
        else:
            calls = [self._named(segment) for segment in segments]
        if not calls or None in calls:
            return text, []
        return content, calls

    def _list(self, segment: str) -> list[ToolCall | None]:
        try:
            parsed, _ = raw_decode(segment)
        except ValueError:
            return []
        items = [parsed] if isinstance(parsed, dict) else parsed if isinstance(parsed, list) else []
        return [call_of(item, ("arguments",), mistral_call_id, default="{}") for item in items]

    def _named(self, segment: str) -> ToolCall | None:
        match = self._name.match(segment)
        if not match:
            return None
        try:
            obj, _ = raw_decode(segment, match.end())
        except ValueError:
            return None
        return call_of({"name": match.group(1), "arguments": obj}, ("arguments",), mistral_call_id)

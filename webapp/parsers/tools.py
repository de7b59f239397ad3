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
    (or lacks `name` or `arguments`) makes the whole output content, calls included.

    Unlike vLLM, given the request's tool `names` (the API passes them), an output without the
    markup may also call tools as small models (Qwen2.5-Coder-0.5B/1.5B) often write it: bare
    JSON (the output is call objects, or a JSON list of them, and whitespace) or fenced JSON
    (content, then ```json or ``` blocks of the same, and whitespace; the last fence may be
    unclosed). Each object needs a `name` among `names` and `arguments` (or `parameters`) an
    object; anything else makes the whole output content, as above. ```python and other
    fences are content; a stream holds back from a ```json fence (or a leading `{`/`[`) on."""

    name = "hermes"
    marker = "<tool_call>"
    fence = "```"
    _calls = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)", re.DOTALL)

    def __init__(self, names: tuple[str, ...] | list[str] = ()):
        self.names = frozenset(names)

    def _extract(self, text):
        first = text.find(self.marker)
        if first < 0:
            return self._json(text) if self.names else (text or None, [])
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

    def scan(self, text, sent):
        at, state = super().scan(text, sent)
        if not self.names or state == "tools":
            return at, state
        start, kind = self._json_start(text)
        safe = min(at, start)
        # Whitespace alone before JSON calls is no content (None): hold it until text comes.
        return (safe if text[:safe].strip() else 0), ("tools" if kind == "call" else "open")

    def _json_start(self, text: str) -> tuple[int, str]:
        """Where JSON calls may begin and whether they have ("call": from there on, the output
        is held until its end), or may still ("open": content is safe up to there)."""
        lead = len(text) - len(text.lstrip())
        if lead == len(text):
            return 0, "open"
        if text[lead] in "{[":
            return lead, "call"
        at = 0
        while (p := text.find(self.fence, at)) >= 0:
            kind, after = self._fence(text, p)
            if kind != "code":
                return p, kind
            close = text.find(self.fence, after)
            if close < 0:  # inside a code block: content, bar a fence's or the marker's start
                return len(text) - tag_overlap(text, self.fence), "open"
            at = close + len(self.fence)
        return len(text) - tag_overlap(text, self.fence), "open"

    def _fence(self, text: str, p: int) -> tuple[str, int]:
        """The fence at `p`: "call" (```json, or ``` and a body that begins with `{` or `[`),
        "code" (another language or body; its text begins at the second value), or "open"."""
        eol = text.find("\n", p)
        if eol < 0:
            return "open", 0
        info = text[p + len(self.fence) : eol].strip().lower()
        if info == "json":
            return "call", eol + 1
        if info:
            return "code", eol + 1
        body = text[eol + 1 :].lstrip()
        if not body:
            return "open", 0
        return ("call" if body[0] in "{[" else "code"), eol + 1

    def _json(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """Bare or fenced JSON calls (see the class); the whole text as content where not."""
        start, kind = self._json_start(text)
        if kind != "call":
            return text or None, []
        content = text[:start] if text[:start].strip() else None
        calls: list[ToolCall] = []
        at, fenced = start, text.startswith(self.fence, start)
        while at < len(text):
            if fenced:
                if not text.startswith(self.fence, at):
                    return text, []
                eol = text.find("\n", at)
                info = text[at + len(self.fence) : eol].strip().lower() if eol >= 0 else None
                if info not in ("json", ""):
                    return text, []
                close = text.find(self.fence, eol + 1)
                body, at = (
                    (text[eol + 1 :], len(text)) if close < 0 else (text[eol + 1 : close], close + len(self.fence))
                )
                found = self._objects(body)
            else:
                found, at = self._objects(text[at:]), len(text)
            if not found:
                return text, []
            calls += found
            while at < len(text) and text[at].isspace():
                at += 1
        return content, calls

    def _objects(self, body: str) -> list[ToolCall]:
        """The calls of `body`: objects (or a list of them) and whitespace; [] where not."""
        calls, at = [], 0
        while body[at:].strip():
            try:
                value, at = raw_decode(body, at)
            except ValueError:
                return []
            for obj in value if isinstance(value, list) else [value]:
                call = call_of(obj, ("arguments", "parameters"))
                if call is None or call.name not in self.names:
                    return []
                calls.append(call)
        return calls


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

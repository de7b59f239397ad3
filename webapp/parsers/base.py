"""What every parser shares: the tool call, the stream events, and the one streaming loop
(`ToolStream`) that all tool-call formats use.

The events are what an OpenAI chat stream carries, so a route turns each into one chunk's
`delta` (`Event.delta()`): content, reasoning, and per tool call first a delta with its
`index`, `id`, `type: "function"` and name (arguments ""), then its arguments.

Why a tool call is only sent once it is whole: whether some text is a call or content ("text
that looks like a call but does not parse stays content") is known only once the call's
markup ends, often only at the end of the output (a list that must close, a later call that
does not parse and turns everything back into content, as vLLM decides). vLLM streams names
and argument pieces before that and so can stream calls that its unstreamed answer does not
have, and argument text that differs from the unstreamed `arguments`. Here a stream's content
and calls are those of `extract` on the whole text, for any split into deltas: content is sent
as soon as no later text can turn it into markup, and the calls at `finish()`. A call cut short
(`max_tokens`) is content, as in vLLM's unstreamed answer (its stream has sent part of it).
"""

from __future__ import annotations

import json
import secrets
import uuid
from dataclasses import dataclass, field
from typing import Literal

# The field of a chat message and stream delta that holds the reasoning: vLLM 0.32's name
# (its ChatMessage and DeltaMessage have `reasoning`; older vLLM and DeepSeek's API call it
# `reasoning_content`).
REASONING_FIELD = "reasoning"

_ALNUM = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789"


def vllm_call_id() -> str:
    """vLLM's default tool call id (`make_tool_call_id`): `chatcmpl-tool-` and 32 hex digits."""
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


def mistral_call_id() -> str:
    """Nine letters or digits: Mistral's chat templates refuse any other id when the call comes
    back in the next request's messages (vLLM's MistralToolCall makes the same)."""
    return "".join(secrets.choice(_ALNUM) for _ in range(9))


@dataclass(frozen=True)
class ToolCall:
    """One call as OpenAI returns it: `arguments` is a JSON object's text."""

    name: str
    arguments: str
    id: str = field(default_factory=vllm_call_id)

    def to_openai(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(frozen=True)
class Content:
    text: str

    def delta(self) -> dict:
        return {"content": self.text}


@dataclass(frozen=True)
class Reasoning:
    text: str

    def delta(self) -> dict:
        return {REASONING_FIELD: self.text}


@dataclass(frozen=True)
class ToolCallStart:
    """The first delta of a call, as OpenAI streams it: its index, id, type and name."""

    index: int
    id: str
    name: str

    def delta(self) -> dict:
        function = {"name": self.name, "arguments": ""}
        return {"tool_calls": [{"index": self.index, "id": self.id, "type": "function", "function": function}]}


@dataclass(frozen=True)
class ToolCallArguments:
    """A piece of a call's arguments; a stream's pieces of one index join into its `arguments`."""

    index: int
    arguments: str

    def delta(self) -> dict:
        return {"tool_calls": [{"index": self.index, "function": {"arguments": self.arguments}}]}


Event = Content | Reasoning | ToolCallStart | ToolCallArguments


def tag_overlap(text: str, tag: str) -> int:
    """The length of the longest suffix of `text` that begins `tag` (a tag split across deltas)."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


def _no_constant(name: str):
    raise ValueError(f"{name} is not JSON")


# json.loads takes NaN and Infinity, which json.dumps would write back: not JSON for a client.
_decoder = json.JSONDecoder(parse_constant=_no_constant)


def raw_decode(text: str, start: int = 0) -> tuple[object, int]:
    """The JSON value that begins at `start` (after any whitespace) and where it ends."""
    while start < len(text) and text[start].isspace():
        start += 1
    return _decoder.raw_decode(text, start)


def arguments_json(value: object) -> str | None:
    """A call's arguments as OpenAI's `arguments` text, or None where they are not an object.

    An object is written as vLLM writes it (`json.dumps(..., ensure_ascii=False)`); a string
    that holds an object's JSON (some models quote their arguments) is kept as it is."""
    if isinstance(value, str):
        try:
            return value if isinstance(_decoder.decode(value), dict) else None
        except ValueError:
            return None
    if isinstance(value, dict):
        return json.dumps(value, ensure_ascii=False, allow_nan=False)
    return None


def call_of(obj: object, keys: tuple[str, ...], make_id=vllm_call_id, default: str | None = None) -> ToolCall | None:
    """The call a decoded `{"name": ..., <key>: {...}}` object names, or None if it is not one.

    `keys` are the names of its arguments field in order of preference (Llama writes
    `parameters`); `default` stands for missing arguments where the format allows that."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    key = next((k for k in keys if k in obj), None)
    arguments = default if key is None else arguments_json(obj[key])
    return None if arguments is None else ToolCall(obj["name"], arguments, make_id())


Scan = Literal["open", "tools", "text"]


class ToolParser:
    """A tool-call format. `extract` is the truth; `scan` says how much content a stream may
    send before the end, and `stream()` makes the stateful per-response object."""

    name = ""

    def extract(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(content, calls) of a whole output; text that does not parse stays content."""
        try:
            return self._extract(text)
        except Exception:  # a parser bug or a pathological input (RecursionError) is content
            return text or None, []

    def _extract(self, text: str) -> tuple[str | None, list[ToolCall]]:
        raise NotImplementedError

    def scan(self, text: str, sent: int) -> tuple[int, Scan]:
        """How many leading characters of `text` (the output so far, of which `sent` were sent
        as content) are content whatever follows, and whether the tool markup has begun
        ("tools": send nothing more before the end), cannot begin anymore ("text": send
        everything from now on) or may still begin ("open")."""
        raise NotImplementedError

    def stream(self) -> ToolStream:
        return ToolStream(self)


class ToolStream:
    """One response's text deltas in, events out; `finish()` when the output has ended."""

    def __init__(self, parser: ToolParser):
        self.parser = parser
        self.text = ""
        self.sent = 0  # characters of `text` sent as content
        self.state: Scan = "open"
        self.calls: list[ToolCall] = []
        self.done = False

    def feed(self, delta: str) -> list[Event]:
        if self.done:
            return []
        self.text += delta
        if self.state == "open":
            safe, self.state = self.parser.scan(self.text, self.sent)
        elif self.state == "text":
            safe = len(self.text)
        else:
            return []
        if safe <= self.sent:
            return []
        piece, self.sent = self.text[self.sent : safe], safe
        return [Content(piece)]

    def finish(self) -> list[Event]:
        """The rest of the content, then each call: its start, then its arguments."""
        if self.done:
            return []
        self.done = True
        content, self.calls = self.parser.extract(self.text)
        content = content or ""
        # By construction what was sent begins the content (tests/test_parsers.py checks it for
        # any split); were it not so, sending the rest is still the least wrong answer.
        events: list[Event] = [Content(content[self.sent :])] if len(content) > self.sent else []
        for index, call in enumerate(self.calls):
            events.append(ToolCallStart(index, call.id, call.name))
            events.append(ToolCallArguments(index, call.arguments))
        return events

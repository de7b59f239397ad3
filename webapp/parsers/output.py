"""A whole chat output through both parsers, in vLLM's order: the reasoning parser first, then
the tool parser on what follows the reasoning (a call written inside the think span is
reasoning, not a call). Either may be absent (no GENQ_REASONING_PARSER, no tools or
`tool_choice: "none"`); with neither, the output is content as it is.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from webapp.parsers.base import Content, Event, ToolCall, ToolParser
from webapp.parsers.reasoning import ThinkParser


@dataclass(frozen=True)
class Parsed:
    reasoning: str | None
    content: str | None
    tool_calls: list[ToolCall] = field(default_factory=list)


class OutputParser:
    def __init__(self, reasoning: ThinkParser | None = None, tools: ToolParser | None = None):
        self.reasoning = reasoning
        self.tools = tools

    def parse(self, text: str) -> Parsed:
        reasoning, content = self.reasoning.extract(text) if self.reasoning else (None, text or None)
        if self.tools is None:
            return Parsed(reasoning, content)
        content, calls = self.tools.extract(content or "")
        return Parsed(reasoning, content, calls)

    def stream(self) -> OutputStream:
        return OutputStream(self)


class OutputStream:
    """`feed(delta)` for each text delta in order, `finish()` once at the end; the events of a
    stream add up to `OutputParser.parse` of its whole text, however it was split."""

    def __init__(self, parser: OutputParser):
        self.reasoning = parser.reasoning.stream() if parser.reasoning else None
        self.tools = parser.tools.stream() if parser.tools else None

    @property
    def tool_calls(self) -> list[ToolCall]:
        """The calls, once `finish()` has run (for `finish_reason: "tool_calls"`)."""
        return self.tools.calls if self.tools else []

    def _through_tools(self, events: list[Event], end: bool) -> list[Event]:
        if self.tools is None:
            return events
        out: list[Event] = []
        for event in events:
            out += self.tools.feed(event.text) if isinstance(event, Content) else [event]
        return out + (self.tools.finish() if end else [])

    def feed(self, delta: str) -> list[Event]:
        events = self.reasoning.feed(delta) if self.reasoning else ([Content(delta)] if delta else [])
        return self._through_tools(events, end=False)

    def finish(self) -> list[Event]:
        return self._through_tools(self.reasoning.finish() if self.reasoning else [], end=True)

    def step(self, delta: str, end: bool) -> list[Event]:
        """One token event's: `feed(delta)` and, at the stream's end, `finish()`."""
        events = self.feed(delta) if delta else []
        return events + self.finish() if end else events


def deltas(stream: OutputStream | None, delta: str, end: bool) -> list[dict]:
    """A token event's chat deltas (`content`, reasoning, `tool_calls`): through `stream`, or
    the text as content where the output has no parser."""
    if stream is None:
        return [{"content": delta}] if delta else []
    return [e.delta() for e in stream.step(delta, end)]

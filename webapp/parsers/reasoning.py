"""Reasoning parsers: the `<think>...</think>` span of a reasoning model goes to the message's
reasoning field (base.REASONING_FIELD), the rest to content, as vLLM's `--reasoning-parser`
names `deepseek_r1` and `qwen3` do in vLLM 0.32.

Both start in reasoning: DeepSeek-R1 distills' and Qwen3 thinking templates (2507) end the
prompt with `<think>`, so the output often has only `</think>`. Text before `</think>` is
reasoning; a `<think>` in it is dropped (text before that stays reasoning, as vLLM's streamed
deepseek_r1 sends it; its unstreamed one drops it); an output without `</think>` (thinking that
never ended, or was cut) is all reasoning. vLLM 0.32's qwen3 does the same while thinking is
on (its default); with `enable_thinking=False` (the request's `chat_template_kwargs`) a qwen3
output is all content. qwen3 also ends reasoning at a `<tool_call>` (kept, as content, for the
tool parser) and drops a stray `</think>` after the end, as vLLM's does. Empty parts are None.

The stream is the parser: `extract` runs it over the whole text, so a stream split anywhere
(a tag across deltas is held back until it is known) gives the same reasoning and content.
"""

from __future__ import annotations

from webapp.parsers.base import Content, Event, Reasoning, tag_overlap

THINK_START = "<think>"
THINK_END = "</think>"


class ThinkParser:
    name = ""
    implicit_end: tuple[str, ...] = ()  # tags that end reasoning and stay in the content
    drop_stray_end = False  # drop a `</think>` that comes after reasoning ended
    reads_enable_thinking = False  # vLLM's deepseek_r1 ignores chat_template_kwargs

    def __init__(self, enable_thinking: bool = True):
        self.enable_thinking = enable_thinking or not self.reads_enable_thinking

    def extract(self, text: str) -> tuple[str | None, str | None]:
        """(reasoning, content) of a whole output."""
        stream = self.stream()
        events = stream.feed(text) + stream.finish()
        reasoning = "".join(e.text for e in events if isinstance(e, Reasoning))
        content = "".join(e.text for e in events if isinstance(e, Content))
        return reasoning or None, content or None

    def stream(self) -> ThinkStream:
        return ThinkStream(self)


class DeepSeekR1Parser(ThinkParser):
    name = "deepseek_r1"


class Qwen3Parser(ThinkParser):
    name = "qwen3"
    implicit_end = ("<tool_call>",)
    drop_stray_end = True
    reads_enable_thinking = True


class ThinkStream:
    """Text deltas in, Reasoning and Content events out; `finish()` sends what was held back."""

    def __init__(self, parser: ThinkParser):
        self.parser = parser
        self.thinking = parser.enable_thinking
        self.held = ""  # the end of the text so far that may be the start of a tag

    def _tags(self) -> tuple[str, ...]:
        if self.thinking:
            return (THINK_START, THINK_END, *self.parser.implicit_end)
        return (THINK_END,) if self.parser.drop_stray_end and self.parser.enable_thinking else ()

    def _out(self, text: str) -> list[Event]:
        if not text:
            return []
        return [Reasoning(text) if self.thinking else Content(text)]

    def feed(self, delta: str) -> list[Event]:
        text, events = self.held + delta, []
        while True:
            tags = self._tags()
            found = [(text.find(tag), tag) for tag in tags]
            found = [(at, tag) for at, tag in found if at >= 0]
            if not found:
                keep = max((tag_overlap(text, tag) for tag in tags), default=0)
                events += self._out(text[: len(text) - keep])
                self.held = text[len(text) - keep :]
                return events
            at, tag = min(found)
            events += self._out(text[:at])
            if tag in self.parser.implicit_end:
                text = text[at:]  # the tag stays, as content
            else:
                text = text[at + len(tag) :]
            if tag != THINK_START:
                self.thinking = False

    def finish(self) -> list[Event]:
        """A held partial tag that never completed is text."""
        events, self.held = self._out(self.held), ""
        return events

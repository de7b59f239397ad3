"""Parsers of a model's output text for the chat API: tool calls (`tool_choice: "auto"`, the
parser GENQ_TOOL_CALL_PARSER names) and reasoning (GENQ_REASONING_PARSER), with vLLM's names
and formats so that a model that works with vLLM's `--tool-call-parser` / `--reasoning-parser`
works here. Pure text in, content / reasoning / calls out, streamed or not; nothing here knows
Flask, Redis or a tokenizer.

    parser = OutputParser(reasoning_parser("qwen3"), tool_parser("hermes"))
    parser.parse(text)                  # Parsed(reasoning, content, tool_calls)
    stream = parser.stream()            # per response
    stream.feed(delta) ... stream.finish()  # lists of events; event.delta() is a chunk's delta
"""

from __future__ import annotations

from webapp.parsers.base import (
    REASONING_FIELD,
    Content,
    Event,
    Reasoning,
    ToolCall,
    ToolCallArguments,
    ToolCallStart,
    ToolParser,
    ToolStream,
)
from webapp.parsers.output import OutputParser, OutputStream, Parsed
from webapp.parsers.pythonic import PythonicParser
from webapp.parsers.reasoning import DeepSeekR1Parser, Qwen3Parser, ThinkParser, ThinkStream
from webapp.parsers.tools import HermesParser, Llama3JsonParser, MistralParser

# vLLM's names; llama4_json is vLLM's other name for the same parser.
TOOL_PARSERS: dict[str, type[ToolParser]] = {
    "hermes": HermesParser,
    "llama3_json": Llama3JsonParser,
    "llama4_json": Llama3JsonParser,
    "mistral": MistralParser,
    "pythonic": PythonicParser,
}
REASONING_PARSERS: dict[str, type[ThinkParser]] = {"deepseek_r1": DeepSeekR1Parser, "qwen3": Qwen3Parser}


class UnknownParser(ValueError):
    """A parser name that is not one of ours; the message lists the names there are."""


def _unknown(kind: str, name: str, names) -> UnknownParser:
    return UnknownParser(f"unknown {kind} parser {name!r}: the names are {', '.join(sorted(names))}")


def tool_parser(name: str, names: tuple[str, ...] | list[str] = ()) -> ToolParser:
    """`names`: the request's tools' names; hermes then also takes bare or fenced JSON calls of
    them (HermesParser), the other formats ignore them."""
    if name not in TOOL_PARSERS:
        raise _unknown("tool-call", name, TOOL_PARSERS)
    return HermesParser(names) if name == "hermes" else TOOL_PARSERS[name]()


def reasoning_parser(name: str, enable_thinking: bool = True) -> ThinkParser:
    """`enable_thinking`: the request's `chat_template_kwargs.enable_thinking` (qwen3 reads it)."""
    if name not in REASONING_PARSERS:
        raise _unknown("reasoning", name, REASONING_PARSERS)
    return REASONING_PARSERS[name](enable_thinking)


__all__ = [
    "REASONING_FIELD",
    "REASONING_PARSERS",
    "TOOL_PARSERS",
    "Content",
    "DeepSeekR1Parser",
    "Event",
    "HermesParser",
    "Llama3JsonParser",
    "MistralParser",
    "OutputParser",
    "OutputStream",
    "Parsed",
    "PythonicParser",
    "Qwen3Parser",
    "Reasoning",
    "ThinkParser",
    "ThinkStream",
    "ToolCall",
    "ToolCallArguments",
    "ToolCallStart",
    "ToolParser",
    "ToolStream",
    "UnknownParser",
    "reasoning_parser",
    "tool_parser",
]

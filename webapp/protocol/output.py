"""What a chat answer makes of a job's text, in vLLM's order: the reasoning parser first
(GENQ_REASONING_PARSER: the think span goes to the message's `reasoning`), then the tool
parser on what follows (`tool_choice`, webapp/protocol/tools.py). Either may be absent; with
neither, the text is the content as it is."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from webapp.parsers import OutputParser, reasoning_parser
from webapp.parsers.reasoning import THINK_END
from webapp.protocol.tools import ToolUse


@dataclass(frozen=True)
class ReasoningUse:
    """The reasoning parser of a chat answer: `parser` (set at submit from
    GENQ_REASONING_PARSER; None: the output is not split) and the request's
    `chat_template_kwargs.enable_thinking` (qwen3 reads it: thinking off, all content)."""

    parser: str | None = None
    enable_thinking: bool = True

    def entry(self) -> dict[str, Any]:
        return {"parser": self.parser, "enable_thinking": self.enable_thinking}

    def end(self) -> str | None:
        """The text that ends the reasoning, where the output begins in it (None: it does not),
        from which on a structured output's constraint holds (StructuredOutput.after)."""
        if not self.parser or not reasoning_parser(self.parser, self.enable_thinking).enable_thinking:
            return None
        return THINK_END


def output_parser(tools: ToolUse | None, reasoning: ReasoningUse | None) -> OutputParser | None:
    """The parser of a chat choice's text; None when the text is content as it is."""
    think = reasoning_parser(reasoning.parser, reasoning.enable_thinking) if reasoning and reasoning.parser else None
    if tools is None and think is None:
        return None
    return OutputParser(think, tools.tool_parser() if tools is not None else None)


def finish_reason(tools: ToolUse | None, finish: str, calls: list) -> str:
    return tools.finish_reason(finish, calls) if tools is not None else finish

"""Tool calling on /v1/chat/completions: the request's `tools` and `tool_choice`, what the
answer does with them (`ToolUse`), and the JSON schemas that force a call.

The tools reach the chat template (its `tools` variable, rendered by the worker) whatever
`tool_choice` says, as in vLLM. Then, per `tool_choice`:

- `none`: the output is content, as it is.
- `auto` (the default with tools): the model's own output is parsed by the parser
  GENQ_TOOL_CALL_PARSER names (webapp/parsers/, vLLM's names and formats); the API refuses
  `auto` with tools when none is set, as vLLM does.
- a named function: the output is forced (structured output, xgrammar in the worker) to that
  function's `parameters` schema, and is the call's arguments.
- `required`: the output is forced to a non-empty JSON array of `{"name", "parameters"}`, one
  item per call, each of one of the tools with its own schema (`required_schema`, as vLLM
  builds it), and becomes the calls.

A forced output that does not parse (cut short by `max_tokens`) stays content, with the
job's finish_reason, as an `auto` call that does not parse does.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from webapp.parsers import ToolCall, ToolParser, tool_parser
from webapp.parsers.base import Scan
from webapp.protocol.common import invalid

# OpenAI's rule for a function's name.
NAME_PATTERN = r"^[A-Za-z0-9_-]{1,64}$"
# The schema of a function without `parameters`: any object (OpenAI's reading).
ANY_OBJECT: dict[str, Any] = {"type": "object", "properties": {}}


class FunctionDef(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    name: str = Field(pattern=NAME_PATTERN)
    description: str | None = None
    parameters: dict[str, Any] | None = Field(None, description="a JSON schema of the arguments, an object's")
    strict: bool | None = None


class Tool(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["function"]
    function: FunctionDef


class FunctionName(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    name: str


class NamedToolChoice(BaseModel):
    """`tool_choice` naming the function to call."""

    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["function"]
    function: FunctionName


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class FunctionCall(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    name: str
    arguments: str = Field(description="the arguments, a JSON object's text")


class ToolCallIn(BaseModel):
    """A call an assistant message of the conversation made (as the answer returned it)."""

    model_config = ConfigDict(extra="forbid", strict=True)
    id: str
    type: Literal["function"]
    function: FunctionCall


class ToolCallOut(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


def check_schema(schema: Any, field: str) -> None:
    """400 naming `field` for a `parameters` that is not a JSON schema of an object: the checks
    that catch a malformed one at submit (what the schema says beyond them, xgrammar reads in
    the worker; one it cannot compile fails the job with its error)."""
    if not isinstance(schema, dict):
        raise invalid(field, "a JSON schema is an object")
    if schema.get("type", "object") != "object":
        raise invalid(field, f'a function\'s parameters are an object (type "object"), not {schema["type"]!r}')
    props = schema.get("properties", {})
    if not isinstance(props, dict) or not all(isinstance(v, (dict, bool)) for v in props.values()):
        raise invalid(f"{field}.properties", "an object of JSON schemas")
    required = schema.get("required", [])
    if not isinstance(required, list) or not all(isinstance(v, str) for v in required):
        raise invalid(f"{field}.required", "a list of property names")
    if not isinstance(schema.get("$defs", {}), dict):
        raise invalid(f"{field}.$defs", "an object of JSON schemas")


def parameters_of(tool: Tool) -> dict[str, Any]:
    return tool.function.parameters if tool.function.parameters is not None else ANY_OBJECT


def required_schema(tools: list[Tool], parallel: bool = True) -> dict[str, Any]:
    """The schema of `tool_choice: "required"`'s output, as vLLM builds it: a non-empty array
    (of one item without `parallel`) of calls, each `{"name": <a tool's>, "parameters": <that
    tool's schema>}`. The tools' `$defs` move to the top, where their `#/$defs/...`
    references then point (two tools that define one name differently: 400)."""
    defs: dict[str, Any] = {}
    options = []
    for i, tool in enumerate(tools):
        params = dict(parameters_of(tool))
        for name, schema in params.pop("$defs", {}).items():
            if defs.setdefault(name, schema) != schema:
                raise invalid(f"tools.{i}.function.parameters.$defs", f"{name!r} is defined otherwise by another tool")
        options.append(
            {
                "properties": {"name": {"type": "string", "enum": [tool.function.name]}, "parameters": params},
                "required": ["name", "parameters"],
            }
        )
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": options}}
    if not parallel:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return schema


@dataclass(frozen=True)
class ToolUse:
    """What the answer does with the output: `auto` parses it with the parser `parser` names
    (set at submit from GENQ_TOOL_CALL_PARSER), `named` makes it the arguments of a call of
    `name`, `required` makes its array the calls."""

    mode: Literal["auto", "named", "required"]
    name: str | None = None
    parser: str | None = None
    names: tuple[str, ...] = ()  # the tools' names (`auto`: hermes takes bare JSON calls of them)

    def tool_parser(self) -> ToolParser:
        if self.mode == "auto":
            return tool_parser(self.parser or "", self.names)
        return NamedParser(self.name or "") if self.mode == "named" else RequiredParser()

    def finish_reason(self, finish: str, calls: list[ToolCall]) -> str:
        """vLLM's and OpenAI's: `tool_calls` when the model called tools, `stop` for a forced
        named call (OpenAI's answer), else the job's."""
        if not calls:
            return finish
        return "stop" if self.mode == "named" else "tool_calls"

    def entry(self) -> dict[str, Any]:
        entry: dict[str, Any] = {"mode": self.mode, "name": self.name, "parser": self.parser}
        return entry | ({"names": list(self.names)} if self.names else {})


class _ForcedParser(ToolParser):
    """An output forced by a schema: the calls only once it has ended (a stream sends nothing
    before), its whole text content when it does not parse."""

    def scan(self, text: str, sent: int) -> tuple[int, Scan]:
        return sent, "tools"


class NamedParser(_ForcedParser):
    def __init__(self, name: str):
        self.name = name

    def _extract(self, text: str) -> tuple[str | None, list[ToolCall]]:
        try:
            arguments = json.loads(text)
        except ValueError:
            return text or None, []
        if not isinstance(arguments, dict):
            return text or None, []
        return None, [ToolCall(self.name, json.dumps(arguments, ensure_ascii=False))]


class RequiredParser(_ForcedParser):
    def _extract(self, text: str) -> tuple[str | None, list[ToolCall]]:
        try:
            items = json.loads(text)
        except ValueError:
            return text or None, []
        ok = isinstance(items, list) and all(
            isinstance(c, dict) and isinstance(c.get("name"), str) and isinstance(c.get("parameters"), dict)
            for c in items
        )
        if not ok or not items:
            return text or None, []
        return None, [ToolCall(c["name"], json.dumps(c["parameters"], ensure_ascii=False)) for c in items]

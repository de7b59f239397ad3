"""Anthropic's Messages API (`POST /v1/messages`), as vLLM serves it: the request, which turns
itself into the chat request of its conversation (`chat_body`: webapp/protocol/chat.py makes
the job, so the chat template, tool calls, stop strings and usage are the chat route's), and
the `message` object, stream events and errors it is answered with."""

from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from webapp.errors import error_body
from webapp.protocol.common import invalid, unsupported
from webapp.protocol.sampling import Seed

# vLLM's sampling extensions a Messages request may carry, passed to the chat request as they are.
EXTRAS = ("ignore_eos", "min_p", "repetition_penalty", "min_tokens", "seed")
NEUTRAL: dict[str, tuple] = {
    "thinking": (None, {"type": "disabled"}),
    "service_tier": (None, "auto", "standard_only"),
    "container": (None,),
    "mcp_servers": (None, []),
    "output_config": (None,),
    "inference_geo": (None,),
    "speed": (None,),
}


class MessagesRequest(BaseModel):
    """Body of POST /v1/messages: `system`, then `messages` (`user` and `assistant`, content
    a string or blocks: `text`, an assistant's `tool_use`, a user's `tool_result`)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    model: str | None = None
    max_tokens: int = Field(ge=1, description="the most tokens to generate")
    messages: list[dict[str, Any]] = Field(min_length=1)
    system: str | list[dict[str, Any]] | None = None
    stop_sequences: list[str] | None = None
    temperature: float | None = Field(None, ge=0.0, le=2.0, allow_inf_nan=False)
    top_p: float | None = Field(None, gt=0.0, le=1.0, allow_inf_nan=False)
    top_k: int | None = Field(None, ge=-1)
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    stream: bool | None = False
    metadata: dict[str, Any] | None = None
    # vLLM's extensions (EXTRAS).
    ignore_eos: bool | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    seed: Seed = None
    # Accepted at their neutral values only (NEUTRAL).
    thinking: Any = None
    service_tier: Any = None
    container: Any = None
    mcp_servers: Any = None
    output_config: Any = None
    inference_geo: Any = None
    speed: Any = None
    # Accepted and not used: the prefix cache needs no breakpoints.
    cache_control: dict[str, Any] | None = None

    def chat_body(self) -> dict[str, Any]:
        for name, neutral in NEUTRAL.items():
            if getattr(self, name) not in neutral:
                raise unsupported(name)
        messages: list[dict[str, Any]] = []
        if self.system is not None:
            messages.append({"role": "system", "content": texts(self.system, "system")})
        for i, m in enumerate(self.messages):
            messages += to_chat(m, f"messages.{i}")
        body: dict[str, Any] = {
            "model": self.model,
            "messages": messages,
            "max_tokens": self.max_tokens,
            "stop": self.stop_sequences,
            "temperature": 1.0 if self.temperature is None else self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "tools": self.chat_tools(),
            "tool_choice": self.chat_tool_choice(),
            "stream": bool(self.stream),
        }
        for name in EXTRAS:
            body[name] = getattr(self, name)
        return {k: v for k, v in body.items() if v is not None}

    def chat_tools(self) -> list[dict[str, Any]] | None:
        if self.tools is None:
            return None
        out = []
        for i, tool in enumerate(self.tools):
            if tool.get("type", "custom") != "custom":
                raise invalid(f"tools.{i}.type", f"only client tools are supported, not {tool.get('type')!r}")
            if not isinstance(tool.get("name"), str):
                raise invalid(f"tools.{i}.name", "needed (a string)")
            fn = {"name": tool["name"], "parameters": tool.get("input_schema")}
            if tool.get("description") is not None:
                fn["description"] = tool["description"]
            out.append({"type": "function", "function": fn})
        return out

    def chat_tool_choice(self) -> Any:
        choice = self.tool_choice
        if choice is None:
            return None
        kind = choice.get("type")
        if kind == "tool":
            if not isinstance(choice.get("name"), str):
                raise invalid("tool_choice.name", "the tool's name")
            named = {"type": "function", "function": {"name": choice["name"]}}
        else:
            named = None
        mapped = {"auto": "auto", "any": "required", "none": "none", "tool": named}
        if kind not in mapped:
            raise invalid("tool_choice.type", '"auto", "any", "tool" or "none"')
        if choice.get("disable_parallel_tool_use") and kind == "any":
            raise unsupported("tool_choice.disable_parallel_tool_use")
        return mapped[kind]


def texts(content: Any, field: str) -> str:
    """A string, or text blocks joined by newlines; 400 naming a block of another type."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise invalid(field, "a string or a list of text blocks")
    out = []
    for j, block in enumerate(content):
        kind = block.get("type") if isinstance(block, dict) else None
        if kind != "text" or not isinstance(block.get("text"), str):
            raise invalid(f"{field}.{j}.type", f"only text blocks are supported here, not {kind!r}")
        out.append(block["text"])
    return "\n".join(out)


def to_chat(message: Any, field: str) -> list[dict[str, Any]]:
    """One Anthropic message as chat messages: a user's tool results are `tool` messages
    (before its text), an assistant's tool uses its `tool_calls`."""
    if not isinstance(message, dict) or message.get("role") not in ("user", "assistant"):
        raise invalid(f"{field}.role", '"user" or "assistant"')
    role, content = message["role"], message.get("content")
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    if not isinstance(content, list):
        raise invalid(f"{field}.content", "a string or a list of content blocks")
    text: list[str] = []
    calls: list[dict[str, Any]] = []
    results: list[dict[str, Any]] = []
    for j, block in enumerate(content):
        where = f"{field}.content.{j}"
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text" and isinstance(block.get("text"), str):
            text.append(block["text"])
        elif kind == "tool_use" and role == "assistant":
            if not isinstance(block.get("id"), str) or not isinstance(block.get("name"), str):
                raise invalid(where, "a tool_use block needs `id` and `name`")
            if not isinstance(block.get("input", {}), dict):
                raise invalid(f"{where}.input", "an object")
            arguments = json.dumps(block.get("input", {}), ensure_ascii=False)
            calls.append(
                {"id": block["id"], "type": "function", "function": {"name": block["name"], "arguments": arguments}}
            )
        elif kind == "tool_result" and role == "user":
            if not isinstance(block.get("tool_use_id"), str):
                raise invalid(f"{where}.tool_use_id", "the id of the tool_use it answers")
            body = texts(block.get("content", ""), f"{where}.content")
            results.append({"role": "tool", "content": body, "tool_call_id": block["tool_use_id"]})
        elif kind == "thinking" and role == "assistant":
            continue  # the model's own earlier thinking: chat templates drop it too
        else:
            raise invalid(f"{where}.type", f"a {role} message's block of type {kind!r} is not supported")
    out = list(results)
    if role == "assistant":
        out.append({"role": "assistant", "content": "\n".join(text) if text else None, "tool_calls": calls or None})
        if out[-1]["content"] is None and not calls:
            out[-1]["content"] = ""
    elif text or not results:
        out.append({"role": "user", "content": "\n".join(text)})
    return [{k: v for k, v in m.items() if v is not None or k == "content"} for m in out]


def stop_reason(finish: str, calls: list, stops: list[str] | None) -> str:
    """The job's finish reason as Anthropic's `stop_reason`."""
    if calls:
        return "tool_use"
    if finish == "length":
        return "max_tokens"
    if finish == "stop" and stops:
        return "stop_sequence"
    return "end_turn"


def stop_sequence(reason: str, stops: list[str] | None) -> str | None:
    """Which stop sequence ended it: known only when there was one (the job's result does not say
    which of several matched)."""
    return stops[0] if reason == "stop_sequence" and stops and len(stops) == 1 else None


def usage(prompt: int, completion: int, cached: int) -> dict[str, int]:
    """Anthropic's usage: `input_tokens` are those not read from the (prefix) cache."""
    return {
        "input_tokens": prompt - cached,
        "output_tokens": completion,
        "cache_read_input_tokens": cached,
        "cache_creation_input_tokens": 0,
    }


def tool_use(call_id: str, name: str, arguments: str) -> dict[str, Any]:
    try:
        args = json.loads(arguments)
    except ValueError:
        args = {}
    return {"type": "tool_use", "id": call_id, "name": name, "input": args}


def message(
    msg_id: str, model: str, content: list[dict[str, Any]], reason: str | None, stops: list[str] | None, use: dict
) -> dict[str, Any]:
    return {
        "id": msg_id,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content,
        "stop_reason": reason,
        "stop_sequence": stop_sequence(reason, stops) if reason else None,
        "usage": use,
    }


def error(status: int, code: str, text: str, param: str | None = None) -> dict[str, Any]:
    """Anthropic's error body (`{"type": "error", "error": {"type", "message"}}`) that is also
    this API's one error shape (webapp/protocol/errors.py: `code`, `param`); Anthropic's
    clients tell errors apart by their HTTP status."""
    return {"type": "error", **error_body(status, code, text, param)}

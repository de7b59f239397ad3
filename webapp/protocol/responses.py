"""OpenAI's Responses API (`POST /v1/responses`), with the request fields vLLM's protocol takes:
the request, what it makes of its `input` items (a conversation, in chat messages), and the
`response` object and stream events it is answered with.

A response is a chat completion underneath: `ResponsesRequest.chat_request` turns it into the
`ChatCompletionRequest` of its conversation (webapp/protocol/chat.py), whose `to_jobs()` makes
the job, so the chat template, tool calls, reasoning, structured output and usage are the chat
route's. What a job's result makes of the output (`output_items`) is `chat_choice`'s message
(webapp/completions.py) in the Responses API's items. How a response is kept and streamed:
webapp/responses.py."""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from webapp.protocol.common import invalid, unsupported
from webapp.protocol.sampling import DEFAULTS, Seed, Stop, Temperature, TopP

# Input item types a conversation can hold here; others (images, files, built-in tools' calls,
# item references) are refused naming the item.
ROLES = ("user", "assistant", "system", "developer")
TEXT_PARTS = ("input_text", "output_text", "text")
# vLLM's sampling extensions a Responses request may carry, passed to the chat request as they are.
EXTRAS = ("ignore_eos", "top_k", "min_p", "repetition_penalty", "min_tokens", "stop_token_ids", "seed", "stop")
# Fields accepted at the values that change nothing.
NEUTRAL: dict[str, tuple] = {
    "truncation": (None, "disabled", "auto"),
    "include": (None, []),
    "service_tier": (None, "auto", "default"),
    "prompt": (None,),
    "top_logprobs": (None, 0),
    "max_tool_calls": (None,),
    "conversation": (None,),
    "prompt_cache_key": (None,),
    "safety_identifier": (None,),
    "user": (None,),
}


class ResponsesRequest(BaseModel):
    """Body of POST /v1/responses. `input`: a string (one user message) or a list of items:
    messages (`role`, `content` as a string or `input_text`/`output_text` parts), a
    `function_call` the model made and its `function_call_output`, `reasoning` items (skipped).
    A field sent as null takes its default."""

    model_config = ConfigDict(extra="forbid", strict=True)

    model: str | None = None
    input: str | list[dict[str, Any]] = Field(description="a user message, or a list of input items")
    instructions: str | None = Field(None, description="a system message before the conversation (not carried on)")
    max_output_tokens: int | None = Field(None, ge=1, description="default: GENQ_DEFAULT_MAX_NEW_TOKENS")
    temperature: Temperature = DEFAULTS["temperature"]
    top_p: TopP = DEFAULTS["top_p"]
    tools: list[dict[str, Any]] | None = Field(None, description="function tools (`type: function`, `name`, ...)")
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = Field(None, description="`format`: text, json_object or json_schema")
    reasoning: dict[str, Any] | None = Field(None, description="`effort`: the chat template's reasoning_effort")
    previous_response_id: str | None = Field(None, description="continue that response's conversation")
    store: bool | None = Field(True, description="keep the response (GET /v1/responses/{id})")
    background: bool | None = Field(False, description="answer at once (`queued`); poll or stream it later")
    stream: bool | None = False
    metadata: dict[str, str] | None = None
    priority: int | None = None
    # vLLM's extensions (EXTRAS).
    ignore_eos: bool | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    stop_token_ids: list[int] | None = None
    seed: Seed = None
    stop: Stop = None
    # Accepted at their neutral values only (NEUTRAL).
    truncation: Any = None
    include: Any = None
    service_tier: Any = None
    prompt: Any = None
    top_logprobs: Any = None
    max_tool_calls: Any = None
    conversation: Any = None
    prompt_cache_key: Any = None
    safety_identifier: Any = None
    user: Any = None

    def check(self) -> None:
        for name, neutral in NEUTRAL.items():
            if getattr(self, name) not in neutral:
                raise unsupported(name)
        if self.background and self.store is False:
            raise invalid("background", "a background response needs store: true")

    def input_items(self) -> list[dict[str, Any]]:
        """The input as a list of items (a string is one user message)."""
        if isinstance(self.input, str):
            return [{"type": "message", "role": "user", "content": self.input}]
        if not self.input:
            raise invalid("input", "at least one item")
        return self.input

    def chat_tools(self) -> list[dict[str, Any]] | None:
        """The function tools in chat's shape (`{"type": "function", "function": {...}}`)."""
        if self.tools is None:
            return None
        out = []
        for i, tool in enumerate(self.tools):
            if tool.get("type") != "function":
                raise invalid(f"tools.{i}.type", f"only function tools are supported, not {tool.get('type')!r}")
            fn = {k: v for k, v in tool.items() if k != "type" and v is not None}
            if "name" not in fn:
                raise invalid(f"tools.{i}.name", "needed")
            out.append({"type": "function", "function": fn})
        return out

    def chat_tool_choice(self) -> Any:
        choice = self.tool_choice
        if not isinstance(choice, dict):
            return choice
        if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
            raise invalid("tool_choice", '"none", "auto", "required" or {"type": "function", "name": ...}')
        return {"type": "function", "function": {"name": choice["name"]}}

    def response_format(self) -> dict[str, Any] | None:
        fmt = (self.text or {}).get("format")
        if fmt is None:
            return None
        if not isinstance(fmt, dict) or fmt.get("type") not in ("text", "json_object", "json_schema"):
            raise invalid("text.format.type", '"text", "json_object" or "json_schema"')
        if fmt["type"] != "json_schema":
            return {"type": fmt["type"]}
        if not isinstance(fmt.get("schema"), dict):
            raise invalid("text.format.schema", "a JSON schema (an object)")
        spec = {k: fmt[k] for k in ("name", "description", "schema", "strict") if fmt.get(k) is not None}
        return {"type": "json_schema", "json_schema": spec}

    def chat_body(self, history: list[dict[str, Any]], messages: list[dict[str, Any]]) -> dict[str, Any]:
        """The chat request of this response: `instructions`, then the conversation so far
        (`history`, chat messages), then this input's `messages`."""
        system = [{"role": "system", "content": self.instructions}] if self.instructions else []
        body: dict[str, Any] = {
            "model": self.model,
            "messages": system + history + messages,
            "max_tokens": self.max_output_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "tools": self.chat_tools(),
            "tool_choice": self.chat_tool_choice(),
            "parallel_tool_calls": self.parallel_tool_calls,
            "response_format": self.response_format(),
        }
        effort = (self.reasoning or {}).get("effort")
        if effort is not None:
            body["reasoning_effort"] = effort
        if self.priority is not None:
            body["priority"] = self.priority
        for name in EXTRAS:
            if getattr(self, name) is not None:
                body[name] = getattr(self, name)
        return {k: v for k, v in body.items() if v is not None}


def _text_of(content: Any, field: str) -> str:
    """A message's content (a string or text parts) as one text; 400 naming a part of
    another type."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise invalid(field, "a string or a list of input_text parts")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in TEXT_PARTS:
            raise invalid(f"{field}.{j}.type", f"only text parts are supported, not {kind!r}")
        if not isinstance(part.get("text"), str):
            raise invalid(f"{field}.{j}.text", "a string")
        texts.append(part["text"])
    return "\n".join(texts)


def to_messages(items: list[dict[str, Any]], field: str = "input") -> list[dict[str, Any]]:
    """Input items as chat messages (ChatMessageIn's shape): consecutive function calls join
    one assistant message, a call's output is a `tool` message; 400 naming the item for a
    type this server does not take."""
    out: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        where = f"{field}.{i}"
        if not isinstance(item, dict):
            raise invalid(where, "an input item (an object)")
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ROLES:
                raise invalid(f"{where}.role", f"one of {', '.join(ROLES)}")
            out.append({"role": role, "content": _text_of(item.get("content"), f"{where}.content")})
        elif kind == "function_call":
            name, args, call_id = item.get("name"), item.get("arguments"), item.get("call_id")
            if not isinstance(name, str) or not isinstance(args, str) or not isinstance(call_id, str):
                raise invalid(where, "a function_call needs `call_id`, `name` and `arguments` (strings)")
            call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": args}}
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant" and last.get("tool_calls") is not None:
                last["tool_calls"].append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output, call_id = item.get("output"), item.get("call_id")
            if not isinstance(call_id, str):
                raise invalid(f"{where}.call_id", "the id of the call it answers (a string)")
            text = output if isinstance(output, str) else _text_of(output, f"{where}.output")
            out.append({"role": "tool", "content": text, "tool_call_id": call_id})
        elif kind == "reasoning":
            continue  # the model's own earlier reasoning: chat templates drop it too
        else:
            raise invalid(f"{where}.type", f"input items of type {kind!r} are not supported")
    return out


def input_item_list(resp_id: str, items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The input items as GET .../input_items lists them: each with an id, messages with
    their content as parts."""
    out = []
    for i, item in enumerate(items):
        kind = item.get("type", "message")
        entry = {**item, "type": kind, "id": item.get("id") or f"{_prefix(kind)}_{_suffix(resp_id)}_in{i}"}
        if kind == "message":
            content = item.get("content")
            if isinstance(content, str):
                part = "output_text" if item.get("role") == "assistant" else "input_text"
                entry["content"] = [{"type": part, "text": content}]
            entry.setdefault("status", "completed")
        out.append(entry)
    return out


def _prefix(kind: str) -> str:
    return {"message": "msg", "function_call": "fc", "function_call_output": "fco", "reasoning": "rs"}.get(kind, "item")


def _suffix(resp_id: str) -> str:
    return resp_id.removeprefix("resp_")


def message_id(resp_id: str) -> str:
    return f"msg_{_suffix(resp_id)}"


def reasoning_id(resp_id: str) -> str:
    return f"rs_{_suffix(resp_id)}"


def call_item_id(resp_id: str, k: int) -> str:
    return f"fc_{_suffix(resp_id)}_{k}"


def text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def message_item(resp_id: str, text: str, status: str = "completed") -> dict[str, Any]:
    content = [text_part(text)] if status == "completed" else []
    return {"id": message_id(resp_id), "type": "message", "role": "assistant", "status": status, "content": content}


def reasoning_item(resp_id: str, text: str) -> dict[str, Any]:
    return {
        "id": reasoning_id(resp_id),
        "type": "reasoning",
        "summary": [],
        "content": [{"type": "reasoning_text", "text": text}],
    }


def call_item(resp_id: str, k: int, call_id: str, name: str, arguments: str, status: str = "completed") -> dict:
    return {
        "id": call_item_id(resp_id, k),
        "type": "function_call",
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
        "status": status,
    }


def output_items(resp_id: str, content: str | None, reasoning: str | None, calls: list[dict]) -> list[dict]:
    """A reply's output items: its reasoning, its text, its calls (chat's `tool_calls`)."""
    items = []
    if reasoning:
        items.append(reasoning_item(resp_id, reasoning))
    if content:
        items.append(message_item(resp_id, content))
    for k, c in enumerate(calls):
        items.append(call_item(resp_id, k, c["id"], c["function"]["name"], c["function"]["arguments"]))
    return items


def assistant_messages(output: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A response's output as the chat messages that continue its conversation."""
    content = "".join(p["text"] for it in output if it["type"] == "message" for p in it["content"])
    calls = [
        {"id": it["call_id"], "type": "function", "function": {"name": it["name"], "arguments": it["arguments"]}}
        for it in output
        if it["type"] == "function_call"
    ]
    if not content and not calls:
        return [{"role": "assistant", "content": ""}]
    return [{"role": "assistant", "content": content or None, **({"tool_calls": calls} if calls else {})}]


def usage(prompt: int, completion: int, cached: int) -> dict[str, Any]:
    return {
        "input_tokens": prompt,
        "input_tokens_details": {"cached_tokens": cached},
        "output_tokens": completion,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": prompt + completion,
    }


def response_object(
    rec: dict[str, Any],
    status: str,
    output: list[dict[str, Any]] | None = None,
    use: dict[str, Any] | None = None,
    error: dict[str, Any] | None = None,
    incomplete: str | None = None,
) -> dict[str, Any]:
    """OpenAI's `response` object of a kept record (webapp/responses.py) in `status`."""
    req = rec["request"]
    tool_choice = req.get("tool_choice")
    return {
        "id": rec["id"],
        "object": "response",
        "created_at": rec["created"],
        "status": status,
        "background": rec["background"],
        "error": error,
        "incomplete_details": {"reason": incomplete} if incomplete else None,
        "instructions": req.get("instructions"),
        "max_output_tokens": req.get("max_output_tokens"),
        "model": rec["model"],
        "output": output or [],
        "parallel_tool_calls": req.get("parallel_tool_calls") is not False,
        "previous_response_id": req.get("previous_response_id"),
        "reasoning": req.get("reasoning"),
        "store": rec["store"],
        "temperature": req.get("temperature"),
        "text": req.get("text") or {"format": {"type": "text"}},
        "tool_choice": "auto" if tool_choice is None else tool_choice,
        "tools": req.get("tools") or [],
        "top_p": req.get("top_p"),
        "truncation": "disabled",
        "usage": use,
        "metadata": req.get("metadata") or {},
    }


def dumps(obj: Any) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))

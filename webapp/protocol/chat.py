"""OpenAI's /v1/chat/completions, with vLLM's extensions: the request (it turns itself into the
conversation's jobs, `to_jobs()`), its answer and its stream's chunks; and the chat-template
options it shares with /tokenize (`ChatTemplateFields`).

A conversation is one job per choice; its messages travel with the job (JobSpec.chat) and the
worker renders them with the model's chat template (worker/chat.py), with the request's
`tools`; what `tool_choice` makes of the output is webapp/protocol/tools.py's. Unknown fields
as for completions (webapp/protocol/completions.py), the neutral ones here `NEUTRAL`."""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from tasks.schemas import LOGPROBS_MAX, ChatMessage, ChatOptions
from webapp.errors import APIError
from webapp.protocol.common import N_MAX, StreamOptions, Usage, invalid
from webapp.protocol.jobs import Jobs
from webapp.protocol.output import ReasoningUse
from webapp.protocol.sampling import DEFAULTS, SamplingRequest, Seed, Stop, Temperature, TopP
from webapp.protocol.tools import (
    NamedToolChoice,
    Tool,
    ToolCallIn,
    ToolCallOut,
    ToolChoice,
    ToolUse,
    check_schema,
    parameters_of,
    required_schema,
)

# Parameters accepted only at a value that changes nothing, with those values.
NEUTRAL: dict[str, tuple] = {
    "functions": (None, []),
    "function_call": (None, "none", "auto"),
    "audio": (None,),
    "modalities": (None, ["text"]),
    "prediction": (None,),
    "web_search_options": (None,),
    "chat_template": (None,),
    "documents": (None, []),
    "echo": (None, False),
    "use_beam_search": (None, False),
    "length_penalty": (None, 1.0),
    "return_tokens_as_token_ids": (None, False),
    "logits_processors": (None, []),
    "mm_processor_kwargs": (None, {}),
    "vllm_xargs": (None, {}),
}

# Names apply_chat_template takes itself: not the template's to set.
RESERVED_TEMPLATE_KWARGS = frozenset(
    {
        "conversation",
        "chat_template",
        "tools",
        "documents",
        "add_generation_prompt",
        "continue_final_message",
        "tokenize",
        "padding",
        "truncation",
        "max_length",
        "return_tensors",
        "return_dict",
        "return_assistant_tokens_mask",
        "tokenizer_kwargs",
    }
)


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["text"]
    text: str


class ChatMessageIn(BaseModel):
    """A message of the conversation: `content` is a string or a list of text parts. An
    assistant message may carry the calls it made (`tool_calls`; then `content` may be null or
    left out), a `tool` message is a call's result (`tool_call_id` names the call)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    role: Literal["system", "developer", "user", "assistant", "tool"] = Field(
        description="`developer`: OpenAI's name for `system` on newer models, rendered as `system`"
    )
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None

    def to_message(self, i: int) -> ChatMessage:
        """The job's message (`i`: its place, which the errors name)."""
        field = f"messages.{i}"
        if self.tool_calls and self.role != "assistant":
            raise invalid(f"{field}.tool_calls", "only an assistant message carries tool calls")
        if self.role == "tool" and not self.tool_call_id:
            raise invalid(f"{field}.tool_call_id", "a tool message needs the id of the call it answers")
        if self.tool_call_id is not None and self.role != "tool":
            raise invalid(f"{field}.tool_call_id", "only a tool message answers a call")
        if self.content is None and not self.tool_calls:
            raise invalid(f"{field}.content", "needed (only an assistant message with tool_calls may leave it out)")
        for j, call in enumerate(self.tool_calls or []):
            try:
                ok = isinstance(json.loads(call.function.arguments), dict)
            except ValueError:
                ok = False
            if not ok:
                raise invalid(f"{field}.tool_calls.{j}.function.arguments", "a JSON object's text")
        # Text parts are joined by newlines, as vLLM joins them for a string-content template.
        text = self.content if not isinstance(self.content, list) else "\n".join(p.text for p in self.content)
        calls = [c.model_dump(mode="json") for c in self.tool_calls] if self.tool_calls else None
        return ChatMessage(
            role="system" if self.role == "developer" else self.role,
            content=text,
            name=self.name,
            tool_calls=calls,
            tool_call_id=self.tool_call_id,
        )


class ChatTemplateFields(BaseModel):
    """The chat-template options of a chat request and of /tokenize with messages."""

    messages: list[ChatMessageIn] = Field(min_length=1)
    add_generation_prompt: bool = Field(True, description="end the prompt where the assistant's reply begins")
    continue_final_message: bool = Field(False, description="the reply continues the last (assistant) message")
    chat_template_kwargs: dict[str, Any] | None = Field(None, description="more variables for the template")
    tools: list[Tool] | None = Field(None, description="functions the model may call (the template's `tools`)")

    def chat_options(self) -> ChatOptions:
        if self.add_generation_prompt and self.continue_final_message:
            raise APIError(
                400,
                "invalid_request",
                "add_generation_prompt and continue_final_message cannot both be true",
                param="continue_final_message",
            )
        kwargs = self.chat_template_kwargs or {}
        clash = sorted(RESERVED_TEMPLATE_KWARGS & kwargs.keys())
        if clash:
            raise invalid("chat_template_kwargs", f"{clash[0]!r} cannot be set there")
        names: set[str] = set()
        for i, tool in enumerate(self.tools or []):
            if tool.function.parameters is not None:
                check_schema(tool.function.parameters, f"tools.{i}.function.parameters")
            if tool.function.name in names:
                raise invalid(f"tools.{i}.function.name", f"{tool.function.name!r} names two tools")
            names.add(tool.function.name)
        return ChatOptions(
            messages=[m.to_message(i) for i, m in enumerate(self.messages)],
            add_generation_prompt=self.add_generation_prompt,
            continue_final_message=self.continue_final_message,
            chat_template_kwargs=kwargs,
            tools=[t.model_dump(mode="json", exclude_none=True) for t in self.tools] if self.tools else None,
        )


class ChatCompletionRequest(ChatTemplateFields, SamplingRequest):
    """Body of POST /v1/chat/completions. A field sent as null takes its default. vLLM's
    sampling and output fields (`VLLMFields`, `response_format` among them) as completions'."""

    model_config = ConfigDict(extra="forbid", strict=True)
    NEUTRAL = NEUTRAL

    model: str | None = None
    max_completion_tokens: int | None = Field(None, ge=1, description="default: max_tokens")
    max_tokens: int | None = Field(None, ge=1, description="default: GENQ_DEFAULT_MAX_NEW_TOKENS")
    temperature: Temperature = DEFAULTS["temperature"]
    top_p: TopP = DEFAULTS["top_p"]
    stop: Stop = None
    seed: Seed = None
    n: int | None = Field(1, ge=1, le=N_MAX, description=f"choices, at most {N_MAX}")
    best_of: int | None = Field(
        None, ge=1, le=N_MAX, description="generate this many, return the n of highest cumulative logprob"
    )
    logprobs: bool | None = False
    top_logprobs: int | None = Field(None, ge=0, le=LOGPROBS_MAX, description="with logprobs")
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    tool_choice: ToolChoice | None = Field(
        None, description='"none", "auto" (the default with tools), "required" or {"type": "function", ...}'
    )
    parallel_tool_calls: bool | None = Field(None, description="false: at most one call (`required`)")
    # Accepted at their neutral values only (NEUTRAL); anything else is refused.
    functions: Any = None
    function_call: Any = None
    audio: Any = None
    modalities: Any = None
    prediction: Any = None
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"] | None = Field(
        None,
        description="reaches the chat template as its `reasoning_effort` variable, and as "
        '`enable_thinking` (false for "none") unless chat_template_kwargs sets that (vLLM\'s reading)',
    )
    web_search_options: Any = None
    chat_template: Any = None
    documents: Any = None
    echo: Any = None
    use_beam_search: Any = None
    length_penalty: Any = None
    return_tokens_as_token_ids: Any = None
    logits_processors: Any = None
    mm_processor_kwargs: Any = None
    vllm_xargs: Any = None

    @field_validator("add_generation_prompt", "continue_final_message", mode="before")
    @classmethod
    def _null_is_default(cls, v, info):
        if v is None:
            return info.field_name == "add_generation_prompt"
        return v

    def to_jobs(self) -> Jobs:
        """The conversation's jobs: one per choice, with its SamplingParams and messages."""
        self.refuse_neutral()
        if self.top_logprobs is not None and not self.logprobs:
            raise invalid("top_logprobs", "needs logprobs: true")
        most = self.max_completion_tokens or self.max_tokens
        self.check_min_tokens(most)
        chat = self.chat_options()
        kwargs = dict(chat.chat_template_kwargs or {})
        if self.reasoning_effort is not None:  # as vLLM's build_chat_params
            kwargs.setdefault("reasoning_effort", self.reasoning_effort)
            kwargs.setdefault("enable_thinking", self.reasoning_effort != "none")
            chat = chat.model_copy(update={"chat_template_kwargs": kwargs})
        thinking = kwargs.get("enable_thinking", True)
        if not isinstance(thinking, bool):
            raise invalid("chat_template_kwargs.enable_thinking", "true or false")
        params = self.to_params(most, (self.top_logprobs or 0) if self.logprobs else None)
        self.check_best_of()
        # The reasoning parser is the deployment's, set at submit (webapp/completions.py).
        reasoning = ReasoningUse(enable_thinking=thinking)
        return self.jobs([""], params, api="chat", chat=chat, tools=self.tool_use(), reasoning=reasoning)

    def tool_use(self) -> ToolUse | None:
        """What `tool_choice` makes of the output (None: content as it is); 400 naming the
        field for a choice the tools cannot meet."""
        choice = self.tool_choice
        if not self.tools:
            if choice in (None, "none", "auto"):
                return None
            raise invalid("tool_choice", "needs tools")
        if choice is None or choice == "auto":
            return ToolUse("auto", names=tuple(t.function.name for t in self.tools))
        if choice == "none":
            return None
        if choice == "required":
            return ToolUse("required")
        assert isinstance(choice, NamedToolChoice)
        if choice.function.name not in {t.function.name for t in self.tools}:
            raise invalid("tool_choice.function.name", f"{choice.function.name!r} is not one of the tools' names")
        return ToolUse("named", choice.function.name)

    def forced_schema(self) -> dict[str, Any] | None:
        """The JSON schema that forces the output of `required` or a named function."""
        use = self.tool_use()
        if use is None or use.mode == "auto":
            return None
        if use.mode == "required":
            return required_schema(self.tools or [], self.parallel_tool_calls is not False)
        (tool,) = [t for t in self.tools or [] if t.function.name == use.name]
        return parameters_of(tool)

    def structured(self) -> dict | None:
        """The request's own constraint, or the one that forces a call (`forced_schema`);
        both at once: 400 naming the request's."""
        own = super().structured()
        schema = self.forced_schema()
        if schema is None:
            return own
        if own is not None:
            raise invalid(self.constraint_field(), f"cannot be combined with tool_choice {self.tool_choice_name}")
        # Without whitespace between JSON tokens: a small model that loops on blank space would
        # otherwise reach max_tokens inside the call (and the call's arguments are no shorter).
        return {"json_schema": json.dumps(schema, sort_keys=True), "disable_any_whitespace": True}

    @property
    def tool_choice_name(self) -> str:
        c = self.tool_choice
        return f"{{function: {c.function.name}}}" if isinstance(c, NamedToolChoice) else repr(c)

    def constraint_field(self) -> str:
        """The field that carries the request's own structured output."""
        if self.response_format is not None and self.response_format.type != "text":
            return "response_format"
        if self.structured_outputs is not None:
            return "structured_outputs"
        guided = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")
        return next((g for g in guided if getattr(self, g) is not None), "structured_outputs")


# -- its answer -----------------------------------------------------------------------------


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(description="the `top_logprobs` likeliest tokens at this place")


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob] | None


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = Field(description="null when the reply is tool calls alone")
    reasoning: str | None = Field(None, description="the think span (with GENQ_REASONING_PARSER; left out without one)")
    tool_calls: list[ToolCallOut] | None = Field(None, description="the calls the reply makes (left out if none)")


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = Field(None, description="with the request's `logprobs`")
    finish_reason: Literal["stop", "length", "tool_calls"]


class ChatCompletionResponse(BaseModel):
    """POST /v1/chat/completions' answer."""

    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class DeltaFunction(BaseModel):
    name: str | None = None
    arguments: str


class DeltaToolCall(BaseModel):
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunction


class Delta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning: str | None = Field(None, description="a piece of the think span (left out if none)")
    tool_calls: list[DeltaToolCall] | None = Field(
        None, description="a call's start (index, id, type, name), then its arguments (left out if none)"
    )


class ChatStreamChoice(BaseModel):
    index: int
    delta: Delta = Field(description="the choice's new text (its first chunk: the role)")
    logprobs: ChatLogprobs | None = None
    finish_reason: Literal["stop", "length", "tool_calls"] | None = Field(
        None, description="null until the choice has ended"
    )


class ChatCompletionChunk(BaseModel):
    """One chunk of a streamed chat completion: every choice opens with its role, then its
    text comes; with `stream_options.include_usage`, a last chunk without choices has `usage`."""

    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: Usage | None = Field(None, description="only in the last chunk, and left out of the others")


def logprobs_of(lp: dict | None, top: int) -> ChatLogprobs | None:
    """A job's log-probabilities (completions' format) in chat's: per token, its own and the
    `top` likeliest."""
    if lp is None:
        return None

    def entry(token: str, value: float) -> dict:
        return {"token": token, "logprob": value, "bytes": list(token.encode("utf-8"))}

    content = []
    for token, value, alts in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"]):
        best = sorted(alts.items(), key=lambda kv: -kv[1])[:top]
        content.append({**entry(token, value), "top_logprobs": [entry(t, v) for t, v in best]})
    return ChatLogprobs(content=content)

"""OpenAI's /v1/chat/completions, with vLLM's extensions: the request (it turns itself into the
conversation's jobs, `to_jobs()`), its answer and its stream's chunks; and the chat-template
options it shares with /tokenize (`ChatTemplateFields`).

A conversation is one job per choice; its messages travel with the job (JobSpec.chat) and the
worker renders them with the model's chat template (worker/chat.py). Unknown fields as for
completions (webapp/protocol/completions.py), the neutral ones here `NEUTRAL`."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from tasks.schemas import LOGPROBS_MAX, ChatMessage, ChatOptions
from webapp.errors import APIError
from webapp.protocol.common import N_MAX, StreamOptions, Usage, invalid
from webapp.protocol.jobs import Jobs
from webapp.protocol.sampling import DEFAULTS, SamplingRequest, Seed, Stop, Temperature, TopP

# Parameters accepted only at a value that changes nothing, with those values.
NEUTRAL: dict[str, tuple] = {
    "tools": (None, []),
    "tool_choice": (None, "none", "auto"),
    "functions": (None, []),
    "function_call": (None, "none", "auto"),
    "audio": (None,),
    "modalities": (None, ["text"]),
    "prediction": (None,),
    "reasoning_effort": (None,),
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
    """A message of the conversation: `content` is a string or a list of text parts."""

    model_config = ConfigDict(extra="forbid", strict=True)

    role: Literal["system", "user", "assistant"]
    content: str | list[TextPart]
    name: str | None = None

    def to_message(self) -> ChatMessage:
        # Text parts are joined by newlines, as vLLM joins them for a string-content template.
        text = self.content if isinstance(self.content, str) else "\n".join(p.text for p in self.content)
        return ChatMessage(role=self.role, content=text, name=self.name)


class ChatTemplateFields(BaseModel):
    """The chat-template options of a chat request and of /tokenize with messages."""

    messages: list[ChatMessageIn] = Field(min_length=1)
    add_generation_prompt: bool = Field(True, description="end the prompt where the assistant's reply begins")
    continue_final_message: bool = Field(False, description="the reply continues the last (assistant) message")
    chat_template_kwargs: dict[str, Any] | None = Field(None, description="more variables for the template")

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
        return ChatOptions(
            messages=[m.to_message() for m in self.messages],
            add_generation_prompt=self.add_generation_prompt,
            continue_final_message=self.continue_final_message,
            chat_template_kwargs=kwargs,
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
    # Accepted at their neutral values only (NEUTRAL); anything else is refused.
    tools: Any = None
    tool_choice: Any = None
    functions: Any = None
    function_call: Any = None
    audio: Any = None
    modalities: Any = None
    prediction: Any = None
    reasoning_effort: Any = None
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
    parallel_tool_calls: bool | None = None

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
        params = self.to_params(most, (self.top_logprobs or 0) if self.logprobs else None)
        self.check_best_of()
        return self.jobs([""], params, api="chat", chat=self.chat_options())


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
    content: str


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = Field(None, description="with the request's `logprobs`")
    finish_reason: Literal["stop", "length"]


class ChatCompletionResponse(BaseModel):
    """POST /v1/chat/completions' answer."""

    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class Delta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatStreamChoice(BaseModel):
    index: int
    delta: Delta = Field(description="the choice's new text (its first chunk: the role)")
    logprobs: ChatLogprobs | None = None
    finish_reason: Literal["stop", "length"] | None = Field(None, description="null until the choice has ended")


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

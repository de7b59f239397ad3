"""OpenAI's wire formats, with vLLM's extensions: /v1/completions, /v1/chat/completions and
/v1/models, and vLLM's /tokenize and /detokenize. Each request sits next to its responses (in the
spirit of vLLM's `protocol.py`) and turns itself into the request's jobs (`to_jobs()`).

The unknown-field policy (README): the parameters this server implements go into the job's
SamplingParams; those that cannot change the output are accepted and ignored; those that would
and are not implemented are accepted at their neutral values only (`NEUTRAL`, `CHAT_NEUTRAL`)
and refused with a 400 naming them otherwise; a field in neither OpenAI's schema nor vLLM's is
a 400 (`extra="forbid"`). Errors name the request's fields (`max_tokens`), not the job's."""

from __future__ import annotations

import json
import re
import time
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, RootModel, ValidationInfo, field_validator

from tasks.schemas import (
    LOGPROBS_MAX,
    PRIORITY_MAX,
    PRIORITY_MIN,
    SEED_MAX,
    SEED_MIN,
    STOP_TOKEN_IDS_MAX,
    TOKEN_ID_MAX,
    ChatMessage,
    ChatOptions,
    Logprobs,
    PromptLogprob,
    SamplingParams,
)
from webapp.errors import APIError
from webapp.protocol.jobs import Scheduling

if TYPE_CHECKING:
    from webapp.completions import Jobs

FINISH = {"length": "length", "stop": "stop", "eos": "stop", "cancelled": "stop"}

# The most completions one request may ask per prompt (`n`): each is a job of its own.
N_MAX = 16

# `max_tokens` when a request leaves it out or sends null: OpenAI's and vLLM's 16.
DEFAULT_MAX_TOKENS = 16

# The job's parameters that the request names otherwise: an error about one names the request's.
REQUEST_FIELDS = {"max_new_tokens": "max_tokens"}

# Parameters accepted only at a value that changes nothing, with those values. OpenAI's
# `suffix`, and vLLM's extensions this server does not implement.
NEUTRAL: dict[str, tuple] = {
    "suffix": (None, ""),
    "use_beam_search": (False,),
    "length_penalty": (None, 1.0),
    "logprob_token_ids": (None,),
    "prompt_embeds": (None,),
    "return_tokens_as_token_ids": (None, False),
    "watermarking": (None, False),
    "logits_processors": (None, []),
    "vllm_xargs": (None, {}),
    "kv_transfer_params": (None,),
    "repetition_detection": (None,),
    "thinking_token_budget": (None, -1),
}


def named_as_requested(exc: APIError) -> APIError:
    """`exc` naming the request's fields (`max_tokens`), not the job's (`max_new_tokens`)."""
    message, param = exc.message, exc.param
    for ours, theirs in REQUEST_FIELDS.items():
        message = re.sub(rf"\b{ours}\b", theirs, message)
        if param == ours or (param is None and message.startswith(f"{theirs}:")):
            param = theirs
    return APIError(exc.status, exc.code, message, exc.headers, param)


class JsonSchemaFormat(BaseModel):
    """`response_format.json_schema`: OpenAI's (vLLM's) named JSON Schema."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    name: str | None = None
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """OpenAI's `response_format`: text (no constraint), any JSON object, or a JSON Schema."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsIn(BaseModel):
    """vLLM's `structured_outputs` (StructuredOutputsParams), as a request sends it."""

    model_config = ConfigDict(extra="forbid")
    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    # Accepted at their neutral values only.
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None
    structural_tag: str | None = None


class VLLMFields(BaseModel):
    """vLLM's sampling and output parameters that completions and chat share, all implemented:
    `output_params()` is their part of the job's SamplingParams. A field sent as null takes its
    default."""

    min_p: float | None = Field(None, ge=0.0, le=1.0, allow_inf_nan=False)
    logit_bias: dict[str, float] | None = Field(None, description="token id (as text) -> bias, clamped to ±100")
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    include_stop_str_in_output: bool | None = False
    skip_special_tokens: bool | None = True
    spaces_between_special_tokens: bool | None = True
    add_special_tokens: bool | None = None
    truncate_prompt_tokens: int | None = Field(None, ge=-1, le=TOKEN_ID_MAX)
    prompt_logprobs: int | None = Field(None, ge=0, le=LOGPROBS_MAX)
    return_token_ids: bool | None = False
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsIn | None = None
    # vLLM's former names of structured_outputs' fields.
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    def structured(self) -> dict | None:
        """The job's StructuredOutput (as a dict), from `response_format`, `structured_outputs`
        or the `guided_*` fields (response_format overrides, as in vLLM); 400 naming the field
        for what is not valid."""
        so = self.structured_outputs
        out: dict[str, Any] = {}
        name = "structured_outputs"
        if so is not None:
            for field in ("disable_additional_properties", "whitespace_pattern", "structural_tag"):
                if getattr(so, field) not in (None, False):
                    raise APIError(
                        400, "unsupported_parameter", f"{name}.{field} is not supported", param=f"{name}.{field}"
                    )
            kinds = {
                "json": so.json_,
                "regex": so.regex,
                "choice": so.choice,
                "grammar": so.grammar,
                "json_object": so.json_object or None,
            }
            out = {k: v for k, v in kinds.items() if v is not None}
            if so.disable_any_whitespace:
                out["disable_any_whitespace"] = True
        guided = {
            "json": self.guided_json,
            "regex": self.guided_regex,
            "choice": self.guided_choice,
            "grammar": self.guided_grammar,
        }
        if any(v is not None for v in guided.values()):
            name = next(f"guided_{k}" for k, v in guided.items() if v is not None)
            out.update({k: v for k, v in guided.items() if v is not None})
        rf = self.response_format
        if rf is not None and rf.type != "text":
            name = "response_format"
            for k in ("json", "regex", "choice", "grammar", "json_object"):
                out.pop(k, None)
            if rf.type == "json_object":
                out["json_object"] = True
            elif rf.json_schema is None or rf.json_schema.json_schema is None:
                raise APIError(
                    400, "invalid_request", "response_format: json_schema.schema is needed", param="response_format"
                )
            else:
                out["json"] = rf.json_schema.json_schema
        kinds = [k for k in ("json", "regex", "choice", "grammar", "json_object") if k in out]
        if not kinds:
            if so is not None:
                raise APIError(
                    400,
                    "invalid_request",
                    f"{name}: one of json, regex, choice, grammar, json_object is needed",
                    param=name,
                )
            return None
        if len(kinds) > 1:
            raise APIError(
                400,
                "invalid_request",
                f"{name}: only one kind of constraint may be given, not {' and '.join(kinds)}",
                param=name,
            )
        if "json" in out:
            schema = out.pop("json")
            if isinstance(schema, str):
                try:
                    schema = json.loads(schema)
                except ValueError:
                    raise APIError(400, "invalid_request", f"{name}: the JSON schema is not JSON", param=name) from None
            if not isinstance(schema, (dict, bool)):
                raise APIError(400, "invalid_request", f"{name}: a JSON schema is an object", param=name)
            out["json_schema"] = json.dumps(schema, sort_keys=True)
        if "regex" in out:
            try:
                re.compile(out["regex"])
            except re.error as exc:
                raise APIError(
                    400, "invalid_request", f"{name}: not a regular expression ({exc})", param=name
                ) from None
        if "choice" in out and (not out["choice"] or len(out["choice"]) > 256):
            raise APIError(400, "invalid_request", f"{name}: 1 to 256 choices", param=name)
        return out

    def output_params(self) -> dict:
        """These fields as the job's SamplingParams fields."""
        bias: dict[int, float] = {}
        for k, v in (self.logit_bias or {}).items():
            try:
                bias[int(k)] = v
            except ValueError:
                raise APIError(
                    400, "invalid_request", f"logit_bias: {k!r} is not a token id", param="logit_bias"
                ) from None
        return {
            "min_p": self.min_p or 0.0,
            "logit_bias": bias,
            "allowed_token_ids": self.allowed_token_ids or None,
            "bad_words": list(self.bad_words or []),
            "structured_outputs": self.structured(),
            "include_stop_str_in_output": bool(self.include_stop_str_in_output),
            "skip_special_tokens": self.skip_special_tokens is not False,
            "spaces_between_special_tokens": self.spaces_between_special_tokens is not False,
            "add_special_tokens": self.add_special_tokens,
            "truncate_prompt_tokens": self.truncate_prompt_tokens,
            "prompt_logprobs": self.prompt_logprobs,
            "return_token_ids": bool(self.return_token_ids),
        }


class SharedFields(BaseModel):
    """The fields completions and chat declare alike: OpenAI's penalties, vLLM's sampling
    extensions, the priority, and OpenAI's fields that are accepted and not used."""

    presence_penalty: float | None = Field(0.0, ge=-2.0, le=2.0, allow_inf_nan=False)
    frequency_penalty: float | None = Field(0.0, ge=-2.0, le=2.0, allow_inf_nan=False)
    # vLLM's extensions.
    top_k: int | None = Field(0, ge=-1, description="0 or -1 disables top-k")
    ignore_eos: bool | None = False
    repetition_penalty: float | None = Field(1.0, gt=0.0, le=10.0, allow_inf_nan=False)
    min_tokens: int | None = Field(0, ge=0, le=2**31 - 1)
    stop_token_ids: list[int] | None = Field(None, max_length=STOP_TOKEN_IDS_MAX)
    priority: int = Field(0, ge=PRIORITY_MIN, le=PRIORITY_MAX, strict=True, description="lower is served first")
    # Accepted and not used: they do not change what is generated.
    user: str | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None
    request_id: str | None = None
    cache_salt: str | None = None


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False
    continuous_usage_stats: bool = Field(False, description="vLLM's; accepted, not used")


# -- /v1/completions ------------------------------------------------------------------------


class CompletionRequest(SharedFields, VLLMFields):
    """Body of POST /v1/completions. A field sent as null takes its default. `prompt`: text,
    several texts, token ids (`[10, 20, 30]`) or several prompts of token ids."""

    model_config = ConfigDict(extra="forbid")

    prompt: str | list[str] | list[int] | list[list[int]]
    model: str | None = None
    max_tokens: int | None = Field(DEFAULT_MAX_TOKENS, ge=1)
    temperature: float | None = Field(1.0, ge=0.0, le=2.0)
    top_p: float | None = Field(1.0, gt=0.0, le=1.0)
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=SEED_MIN, le=SEED_MAX)
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    echo: bool | None = False
    n: int | None = Field(1, ge=1, le=N_MAX, description=f"completions per prompt, at most {N_MAX}")
    best_of: int | None = Field(
        None, ge=1, le=N_MAX, description="generate this many per prompt, return the n of highest cumulative logprob"
    )
    logprobs: int | None = Field(
        None,
        ge=0,
        le=LOGPROBS_MAX,
        description="per token, the log-probabilities of the chosen and the n likeliest tokens",
    )
    # Accepted and not used: it does not change what is generated.
    session_id: str | None = None
    stream_interval: int | None = Field(None, ge=1)
    truncation_side: Literal["left", "right"] | None = None
    # Accepted at their neutral values only (NEUTRAL); anything else is refused.
    suffix: str | None = None
    use_beam_search: bool = False
    length_penalty: float | None = None
    logprob_token_ids: list[int] | None = None
    prompt_embeds: Any = None
    return_tokens_as_token_ids: bool | None = None
    watermarking: bool | None = None
    logits_processors: list[Any] | None = None
    vllm_xargs: dict[str, Any] | None = None
    kv_transfer_params: dict[str, Any] | None = None
    repetition_detection: dict[str, Any] | None = None
    thinking_token_budget: int | None = None

    @field_validator("prompt")
    @classmethod
    def _prompts(cls, v):
        prompts = [v] if isinstance(v, str) or (v and isinstance(v[0], int)) else v
        if not prompts:
            raise ValueError("at least one prompt is needed")
        if any(len(p) == 0 for p in prompts):
            raise ValueError("prompts must not be empty")
        if any(not 0 <= t <= TOKEN_ID_MAX for p in prompts if isinstance(p, list) for t in p):
            raise ValueError(f"token ids are whole numbers from 0 to {TOKEN_ID_MAX}")
        return v

    @field_validator("min_tokens")
    @classmethod
    def _min_within_max(cls, v: int | None, info: ValidationInfo) -> int | None:
        if "max_tokens" not in info.data:  # itself invalid: that error says enough
            return v
        most = info.data["max_tokens"] or DEFAULT_MAX_TOKENS
        if v and v > most:
            raise ValueError(f"must not exceed max_tokens ({most})")
        return v

    @property
    def prompts(self) -> list[str | list[int]]:
        """Each prompt: a text, or token ids."""
        p = self.prompt
        return [p] if isinstance(p, str) or isinstance(p[0], int) else p

    @property
    def choices(self) -> int:
        """Completions per prompt (`n`)."""
        return self.n or 1

    def refuse_unsupported(self, n: bool = False, logprobs: bool = False) -> None:
        """400 `unsupported_parameter`, naming it, for a parameter this server does not
        implement at the value sent. `n`, `logprobs`: whether the caller returns several
        choices per prompt and log-probabilities (otherwise they too are taken only at their
        neutral values)."""
        unsupported = [name for name, neutral in NEUTRAL.items() if getattr(self, name) not in neutral]
        if self.best_of not in (None, 1, self.choices) and not n:
            unsupported.append("best_of")
        if self.choices != 1 and not n:
            unsupported.append("n")
        if self.logprobs is not None and not logprobs:
            unsupported.append("logprobs")
        if unsupported:
            param = unsupported[0]
            hint = " (send the prompt several times instead)" if param in ("n", "best_of") else ""
            raise APIError(400, "unsupported_parameter", f"{param} is not supported{hint}", param=param)
        if self.logprobs is not None and self.echo:
            raise APIError(
                400,
                "unsupported_parameter",
                "logprobs with echo is not supported (it would need the prompt's log-probabilities)",
                param="logprobs",
            )
        if self.best_of is not None and self.best_of < self.choices:
            raise APIError(400, "invalid_request", f"best_of must be at least n ({self.choices})", param="best_of")
        if (self.best_of or 1) > self.choices and self.stream:
            raise APIError(400, "invalid_request", "best_of above n cannot be streamed", param="best_of")
        if self.echo and any(not isinstance(p, str) for p in self.prompts):
            raise APIError(
                400, "unsupported_parameter", "echo with a prompt of token ids is not supported", param="echo"
            )

    def to_jobs(self) -> Jobs:
        """The request's jobs: each prompt `n` times, with its SamplingParams (400 for a
        parameter this server does not implement)."""
        from webapp.completions import Jobs

        self.refuse_unsupported(n=True, logprobs=True)
        return Jobs(
            self.prompts,
            SamplingParams.model_validate(self.sampling()),
            Scheduling(priority=self.priority),
            model=self.model,
            n=self.choices,
            stream=bool(self.stream),
            echo=bool(self.echo),
            include_usage=bool(self.stream_options and self.stream_options.include_usage),
            best_of=self.best_of if (self.best_of or 1) > self.choices else None,
        )

    def sampling(self) -> dict:
        """The job's SamplingParams, as a dict (null fields take their defaults)."""
        stops = [self.stop] if isinstance(self.stop, str) else (self.stop or [])
        return {
            "max_new_tokens": DEFAULT_MAX_TOKENS if self.max_tokens is None else self.max_tokens,
            "temperature": 1.0 if self.temperature is None else self.temperature,
            "top_p": 1.0 if self.top_p is None else self.top_p,
            "top_k": max(self.top_k or 0, 0),
            "seed": self.seed,
            "stop": stops,
            "ignore_eos": bool(self.ignore_eos),
            "repetition_penalty": 1.0 if self.repetition_penalty is None else self.repetition_penalty,
            "presence_penalty": self.presence_penalty or 0.0,
            "frequency_penalty": self.frequency_penalty or 0.0,
            "min_tokens": self.min_tokens or 0,
            "stop_token_ids": list(self.stop_token_ids or []),
            "logprobs": self.logprobs,
            **self.output_params(),
        }


class CompletionChoice(BaseModel):
    index: int = Field(description="prompt i's choice j (of n) is i * n + j")
    text: str
    logprobs: Logprobs | None = Field(None, description="with the request's `logprobs`")
    finish_reason: Literal["stop", "length"] | None = Field(None, description="null until the choice has ended")
    # vLLM's, each only with the request's field of that name (left out otherwise).
    prompt_logprobs: list[dict[str, PromptLogprob] | None] | None = None
    prompt_token_ids: list[int] | None = None
    token_ids: list[int] | None = None


class PromptTokensDetails(BaseModel):
    cached_tokens: int = Field(0, description="prompt tokens served from the engine's prefix cache (not computed)")


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails = Field(
        default_factory=PromptTokensDetails, description="always present (cached_tokens 0 when nothing was cached)"
    )


class CompletionResponse(BaseModel):
    """POST /v1/completions' answer."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class CompletionStreamResponse(BaseModel):
    """One chunk of a streamed completion (`data:` of an SSE event): a choice's new text, or,
    with `stream_options.include_usage`, a last chunk without choices that has `usage`."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = Field(None, description="only in the last chunk, and left out of the others")


def completion(
    cmpl_id: str,
    model: str,
    choices: list[CompletionChoice | dict],
    usage: Usage | dict | None = None,
    created: int | None = None,
) -> dict:
    """A completion's body: the whole answer (with `usage`), or a stream chunk (without)."""
    fields = dict(id=cmpl_id, created=created or int(time.time()), model=model, choices=choices)
    if usage is not None:
        body = CompletionResponse(**fields, usage=usage).model_dump(mode="json")
    else:
        body = CompletionStreamResponse(**fields).model_dump(mode="json", exclude={"usage"})
    for c in body["choices"]:  # vLLM's fields only where asked for
        for name in VLLM_CHOICE_FIELDS:
            if c.get(name) is None:
                c.pop(name, None)
    return body


VLLM_CHOICE_FIELDS = ("prompt_logprobs", "prompt_token_ids", "token_ids")


def choice(
    index: int, text: str, finish_reason: str | None, logprobs: Logprobs | dict | None = None, **vllm: Any
) -> CompletionChoice:
    """`vllm`: VLLM_CHOICE_FIELDS (None: left out)."""
    return CompletionChoice(
        index=index,
        text=text,
        logprobs=logprobs,
        finish_reason=FINISH.get(finish_reason, "stop") if finish_reason else None,
        **vllm,
    )


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> Usage:
    return Usage(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        total_tokens=prompt_tokens + completion_tokens,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=cached_tokens),
    )


def cached_tokens(counts: dict[str, Any] | None) -> int:
    """A job's result's (or its stream's final usage's) `cached_tokens`: 0 when it has none (a
    worker from before the prefix cache, during a rolling upgrade)."""
    return int((counts or {}).get("cached_tokens") or 0)


def usage_of(results: list[dict[str, Any]], prompts: list[dict[str, Any]] | None = None) -> Usage:
    """The usage of a request whose jobs gave `results`: their completion tokens, and the prompt
    and cached tokens of `prompts` (default: all of them; best_of counts each prompt once)."""
    prompts = results if prompts is None else prompts
    return usage(
        sum(r["prompt_tokens"] for r in prompts),
        sum(r["completion_tokens"] for r in results),
        sum(cached_tokens(r) for r in prompts),
    )


# -- /v1/models ----------------------------------------------------------------------------


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(description="unix time the first live worker serving it started")
    owned_by: str = "genqueue"
    max_model_len: int | None = Field(None, description="the model's context, in tokens")
    devices: list[str] = Field([], description="where its live workers run it (cpu, cuda:N)")


class ModelList(BaseModel):
    """GET /v1/models' answer: the models live workers serve."""

    object: Literal["list"] = "list"
    data: list[ModelCard]


# -- /v1/chat/completions ---------------------------------------------------------------------
# A conversation is one job per choice; its messages travel with the job (JobSpec.chat) and the
# worker renders them with the model's chat template (worker/chat.py).

# Parameters accepted only at a value that changes nothing, with those values.
CHAT_NEUTRAL: dict[str, tuple] = {
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
    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]
    text: str


class ChatMessageIn(BaseModel):
    """A message of the conversation: `content` is a string or a list of text parts."""

    model_config = ConfigDict(extra="forbid")

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
            raise APIError(
                400,
                "invalid_request",
                f"chat_template_kwargs: {clash[0]!r} cannot be set there",
                param="chat_template_kwargs",
            )
        return ChatOptions(
            messages=[m.to_message() for m in self.messages],
            add_generation_prompt=self.add_generation_prompt,
            continue_final_message=self.continue_final_message,
            chat_template_kwargs=kwargs,
        )


class ChatCompletionRequest(ChatTemplateFields, SharedFields, VLLMFields):
    """Body of POST /v1/chat/completions. A field sent as null takes its default. vLLM's
    sampling and output fields (`VLLMFields`, `response_format` among them) as completions'."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    max_completion_tokens: int | None = Field(None, ge=1, description="default: max_tokens")
    max_tokens: int | None = Field(None, ge=1, description="default: GENQ_DEFAULT_MAX_NEW_TOKENS")
    temperature: float | None = Field(1.0, ge=0.0, le=2.0)
    top_p: float | None = Field(1.0, gt=0.0, le=1.0)
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=SEED_MIN, le=SEED_MAX)
    n: int | None = Field(1, ge=1, le=N_MAX, description=f"choices, at most {N_MAX}")
    best_of: int | None = Field(
        None, ge=1, le=N_MAX, description="generate this many, return the n of highest cumulative logprob"
    )
    logprobs: bool | None = False
    top_logprobs: int | None = Field(None, ge=0, le=LOGPROBS_MAX, description="with logprobs")
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    # Accepted at their neutral values only (CHAT_NEUTRAL); anything else is refused.
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

    def refuse_unsupported(self) -> None:
        for name, neutral in CHAT_NEUTRAL.items():
            if getattr(self, name) not in neutral:
                raise APIError(400, "unsupported_parameter", f"{name} is not supported", param=name)
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError(400, "invalid_request", "top_logprobs: needs logprobs: true", param="top_logprobs")

    def to_jobs(self) -> Jobs:
        """The conversation's jobs: one per choice, with its SamplingParams and messages."""
        from webapp.completions import Jobs

        self.refuse_unsupported()
        most = self.max_completion_tokens or self.max_tokens
        if self.min_tokens and most is not None and self.min_tokens > most:
            raise APIError(
                400, "invalid_request", f"min_tokens: must not exceed max_tokens ({most})", param="min_tokens"
            )
        params = SamplingParams.model_validate(
            {
                "max_new_tokens": most,
                "temperature": 1.0 if self.temperature is None else self.temperature,
                "top_p": 1.0 if self.top_p is None else self.top_p,
                "top_k": max(self.top_k or 0, 0),
                "seed": self.seed,
                "stop": [self.stop] if isinstance(self.stop, str) else (self.stop or []),
                "ignore_eos": bool(self.ignore_eos),
                "repetition_penalty": 1.0 if self.repetition_penalty is None else self.repetition_penalty,
                "presence_penalty": self.presence_penalty or 0.0,
                "frequency_penalty": self.frequency_penalty or 0.0,
                "min_tokens": self.min_tokens or 0,
                "stop_token_ids": list(self.stop_token_ids or []),
                "logprobs": (self.top_logprobs or 0) if self.logprobs else None,
                **self.output_params(),
            }
        )
        n, best_of = self.n or 1, self.best_of
        if best_of is not None and best_of < n:
            raise APIError(400, "invalid_request", f"best_of must be at least n ({n})", param="best_of")
        if (best_of or 1) > n and self.stream:
            raise APIError(400, "invalid_request", "best_of above n cannot be streamed", param="best_of")
        return Jobs(
            [""],
            params,
            Scheduling(priority=self.priority),
            model=self.model,
            n=self.n or 1,
            api="chat",
            stream=bool(self.stream),
            include_usage=bool(self.stream_options and self.stream_options.include_usage),
            chat=self.chat_options(),
            best_of=best_of if (best_of or 1) > n else None,
        )


# -- chat's responses -----------------------------------------------------------------------


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


def finish(reason: str | None) -> str | None:
    return FINISH.get(reason, "stop") if reason else None


# -- /tokenize and /detokenize (vLLM's) --------------------------------------------------------


class TokenizePrompt(BaseModel):
    """Body of POST /tokenize for a prompt."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    prompt: str
    add_special_tokens: bool = Field(True, description="as a completion's prompt is tokenized")
    return_token_strs: bool = False


class TokenizeChat(ChatTemplateFields):
    """Body of POST /tokenize for a conversation: the prompt its chat template renders."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    add_special_tokens: bool = Field(False, description="the template holds its special tokens already")
    return_token_strs: bool = False


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int | None
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    tokens: list[int] = Field(max_length=1 << 20)


class DetokenizeResponse(BaseModel):
    prompt: str


class TokenizeRequest(RootModel[TokenizeChat | TokenizePrompt]):
    """Body of POST /tokenize: a `prompt`, or the `messages` of a conversation."""

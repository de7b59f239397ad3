"""OpenAI's completions wire format: the request we accept and the bodies we send, as pydantic
models (the request next to its responses, in the spirit of vLLM's `protocol.py`).

The request takes OpenAI's parameters and vLLM's extensions. Those this server implements are
passed to the job's SamplingParams; those it does not are accepted at their neutral values
(which change nothing: clients written for vLLM send many of them that way) and refused with a
400 naming the parameter otherwise (`refuse_unsupported`)."""

from __future__ import annotations

import re
import time
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from tasks.schemas import (
    LOGPROBS_MAX, PRIORITY_MAX, PRIORITY_MIN, STOP_TOKEN_IDS_MAX, Logprobs, SamplingParams, Scheduling,
)
from webapp.errors import APIError

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
# `logit_bias` and `suffix`, and vLLM's extensions this server does not implement.
NEUTRAL: dict[str, tuple] = {
    "logit_bias": (None, {}),
    "suffix": (None, ""),
    "use_beam_search": (False,),
    "min_p": (None, 0.0),
    "length_penalty": (None, 1.0),
    "include_stop_str_in_output": (False,),
    "skip_special_tokens": (True,),
    "spaces_between_special_tokens": (True,),
    "add_special_tokens": (True,),
    "truncate_prompt_tokens": (None,),
    "allowed_token_ids": (None, []),
    "bad_words": (None, []),
    "prompt_logprobs": (None,),
    "logprob_token_ids": (None,),
    "prompt_embeds": (None,),
    "response_format": (None, {"type": "text"}),
    "structured_outputs": (None,),
    "guided_json": (None,),
    "guided_regex": (None,),
    "guided_choice": (None,),
    "guided_grammar": (None,),
    "return_tokens_as_token_ids": (None, False),
    "return_token_ids": (None, False),
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


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False
    continuous_usage_stats: bool = Field(False, description="vLLM's; accepted, not used")


class CompletionRequest(BaseModel):
    """Body of POST /v1/completions. A field sent as null takes its default."""

    model_config = ConfigDict(extra="forbid")

    prompt: str | list[str]
    model: str | None = None
    max_tokens: int | None = Field(DEFAULT_MAX_TOKENS, ge=1)
    temperature: float | None = Field(1.0, ge=0.0, le=2.0)
    top_p: float | None = Field(1.0, gt=0.0, le=1.0)
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=0)
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    echo: bool | None = False
    n: int | None = Field(1, ge=1, le=N_MAX, description=f"completions per prompt, at most {N_MAX}")
    best_of: int | None = Field(None, description="only null or equal to n")
    logprobs: int | None = Field(
        None, ge=0, le=LOGPROBS_MAX,
        description="per token, the log-probabilities of the chosen and the n likeliest tokens",
    )  # fmt: skip
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
    request_id: str | None = None
    session_id: str | None = None
    cache_salt: str | None = None
    stream_interval: int | None = Field(None, ge=1)
    truncation_side: Literal["left", "right"] | None = None
    # Accepted at their neutral values only (NEUTRAL); anything else is refused.
    logit_bias: dict[str, float] | None = None
    suffix: str | None = None
    use_beam_search: bool = False
    min_p: float | None = None
    length_penalty: float | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    add_special_tokens: bool = True
    truncate_prompt_tokens: int | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    prompt_logprobs: int | None = None
    logprob_token_ids: list[int] | None = None
    prompt_embeds: Any = None
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: Any = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    return_tokens_as_token_ids: bool | None = None
    return_token_ids: bool | None = None
    watermarking: bool | None = None
    logits_processors: list[Any] | None = None
    vllm_xargs: dict[str, Any] | None = None
    kv_transfer_params: dict[str, Any] | None = None
    repetition_detection: dict[str, Any] | None = None
    thinking_token_budget: int | None = None

    @field_validator("prompt")
    @classmethod
    def _prompts(cls, v):
        prompts = [v] if isinstance(v, str) else v
        if not prompts:
            raise ValueError("at least one prompt is needed")
        if any(p == "" for p in prompts):
            raise ValueError("prompts must not be empty")
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
    def prompts(self) -> list[str]:
        return [self.prompt] if isinstance(self.prompt, str) else self.prompt

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
        if self.best_of not in (None, 1, self.choices):
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
                400, "unsupported_parameter",
                "logprobs with echo is not supported (it would need the prompt's log-probabilities)",
                param="logprobs",
            )  # fmt: skip

    def to_jobs(self) -> "Jobs":
        """The request's jobs: each prompt `n` times, with its SamplingParams (400 for a
        parameter this server does not implement)."""
        from webapp.completions import Jobs

        self.refuse_unsupported(n=True, logprobs=True)
        return Jobs(
            self.prompts, SamplingParams.model_validate(self.sampling()), Scheduling(priority=self.priority),
            model=self.model, n=self.choices, stream=bool(self.stream), echo=bool(self.echo),
            include_usage=bool(self.stream_options and self.stream_options.include_usage),
        )  # fmt: skip

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
        }


class CompletionChoice(BaseModel):
    index: int = Field(description="prompt i's choice j (of n) is i * n + j")
    text: str
    logprobs: Logprobs | None = Field(None, description="with the request's `logprobs`")
    finish_reason: Literal["stop", "length"] | None = Field(None, description="null until the choice has ended")


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


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
        return CompletionResponse(**fields, usage=usage).model_dump(mode="json")
    return CompletionStreamResponse(**fields).model_dump(mode="json", exclude={"usage"})


def choice(index: int, text: str, finish_reason: str | None, logprobs: Logprobs | dict | None = None) -> CompletionChoice:
    return CompletionChoice(
        index=index,
        text=text,
        logprobs=logprobs,
        finish_reason=FINISH.get(finish_reason, "stop") if finish_reason else None,
    )


def usage(prompt_tokens: int, completion_tokens: int) -> Usage:
    return Usage(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        total_tokens=prompt_tokens + completion_tokens,
    )


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

"""OpenAI's /v1/completions, with vLLM's extensions: the request (it turns itself into the
request's jobs, `to_jobs()`), its answer and its stream's chunks.

The unknown-field policy (docs/api.md): the parameters this server implements go into the job's
SamplingParams; those that cannot change the output are accepted and ignored; those that would
and are not implemented are accepted at their neutral values only (`NEUTRAL`) and refused with
a 400 naming them otherwise; a field in neither OpenAI's schema nor vLLM's is a 400
(`extra="forbid"`). Errors name the request's fields (`max_tokens`), not the job's."""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from tasks.schemas import LOGPROBS_MAX, TOKEN_ID_MAX, Logprobs, PromptLogprob
from webapp.protocol.common import N_MAX, StreamOptions, Usage, finish, unsupported
from webapp.protocol.jobs import Jobs
from webapp.protocol.sampling import DEFAULTS, SamplingRequest, Seed, Stop, Temperature, TopP

# `max_tokens` when a request leaves it out or sends null: OpenAI's and vLLM's 16.
DEFAULT_MAX_TOKENS = 16

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


class CompletionRequest(SamplingRequest):
    """Body of POST /v1/completions. A field sent as null takes its default. `prompt`: text,
    several texts, token ids (`[10, 20, 30]`) or several prompts of token ids."""

    model_config = ConfigDict(extra="forbid", strict=True)
    NEUTRAL = NEUTRAL

    prompt: str | list[str] | list[int] | list[list[int]]
    model: str | None = None
    max_tokens: int | None = Field(DEFAULT_MAX_TOKENS, ge=1)
    temperature: Temperature = DEFAULTS["temperature"]
    top_p: TopP = DEFAULTS["top_p"]
    stop: Stop = None
    seed: Seed = None
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

    @property
    def prompts(self) -> list[str | list[int]]:
        """Each prompt: a text, or token ids."""
        p = self.prompt
        return [p] if isinstance(p, str) or isinstance(p[0], int) else p

    def to_jobs(self) -> Jobs:
        """The request's jobs: each prompt `n` times, with its SamplingParams (400 for a
        parameter this server does not implement). `min_tokens` above `max_tokens` is the job's
        own check (SamplingParams)."""
        self.refuse_neutral()
        if self.logprobs is not None and self.echo:
            raise unsupported("logprobs", "with echo is not supported (it would need the prompt's log-probabilities)")
        self.check_best_of()
        if self.echo and any(not isinstance(p, str) for p in self.prompts):
            raise unsupported("echo", "with a prompt of token ids is not supported")
        most = DEFAULT_MAX_TOKENS if self.max_tokens is None else self.max_tokens
        return self.jobs(self.prompts, self.to_params(most, self.logprobs), echo=bool(self.echo))


# -- its answer -----------------------------------------------------------------------------


class CompletionChoice(BaseModel):
    index: int = Field(description="prompt i's choice j (of n) is i * n + j")
    text: str
    logprobs: Logprobs | None = Field(None, description="with the request's `logprobs`")
    finish_reason: Literal["stop", "length"] | None = Field(None, description="null until the choice has ended")
    # vLLM's, each only with the request's field of that name (left out otherwise).
    prompt_logprobs: list[dict[str, PromptLogprob] | None] | None = None
    prompt_token_ids: list[int] | None = None
    token_ids: list[int] | None = None


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
    return CompletionChoice(index=index, text=text, logprobs=logprobs, finish_reason=finish(finish_reason), **vllm)

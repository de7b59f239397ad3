"""OpenAI's completions wire format: the request we accept and the bodies we send."""

from __future__ import annotations

import time

from pydantic import BaseModel, ConfigDict, Field, field_validator

from webapp.errors import APIError

FINISH = {"length": "length", "stop": "stop", "eos": "stop", "cancelled": "stop"}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False


class CompletionRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    prompt: str | list[str]
    model: str | None = None
    max_tokens: int | None = Field(16, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=0)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    echo: bool = False
    n: int = 1
    # Accepted at their defaults only; anything else is refused by `refuse_unsupported`.
    logprobs: int | None = None
    best_of: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    suffix: str | None = None
    # vLLM's extensions.
    top_k: int = Field(0, ge=-1)
    ignore_eos: bool = False

    @field_validator("prompt")
    @classmethod
    def _prompts(cls, v):
        prompts = [v] if isinstance(v, str) else v
        if not prompts:
            raise ValueError("at least one prompt is needed")
        if any(p == "" for p in prompts):
            raise ValueError("prompts must not be empty")
        return v

    @property
    def prompts(self) -> list[str]:
        return [self.prompt] if isinstance(self.prompt, str) else self.prompt

    def refuse_unsupported(self) -> None:
        unsupported = {
            "n": self.n != 1,
            "best_of": self.best_of not in (None, 1),
            "logprobs": self.logprobs is not None,
            "presence_penalty": self.presence_penalty != 0,
            "frequency_penalty": self.frequency_penalty != 0,
            "logit_bias": bool(self.logit_bias),
            "suffix": self.suffix is not None,
        }
        for param, bad in unsupported.items():
            if bad:
                hint = " (send the prompt several times instead)" if param in ("n", "best_of") else ""
                raise APIError(
                    400, "unsupported_parameter", f"{param} is not supported{hint}", param=param
                )

    def sampling(self) -> dict:
        stops = [self.stop] if isinstance(self.stop, str) else (self.stop or [])
        return {
            "max_new_tokens": self.max_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": max(self.top_k, 0),
            "seed": self.seed,
            "stop": stops,
            "ignore_eos": self.ignore_eos,
        }


def completion(
    cmpl_id: str, model: str, choices: list[dict], usage: dict | None = None, created: int | None = None
) -> dict:
    body = {
        "id": cmpl_id,
        "object": "text_completion",
        "created": created or int(time.time()),
        "model": model,
        "choices": choices,
    }
    if usage is not None:
        body["usage"] = usage
    return body


def choice(index: int, text: str, finish_reason: str | None) -> dict:
    return {
        "index": index,
        "text": text,
        "logprobs": None,
        "finish_reason": FINISH.get(finish_reason, finish_reason) if finish_reason else None,
    }


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }



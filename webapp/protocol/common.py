"""What OpenAI's APIs here share beyond sampling (webapp/protocol/sampling.py): the errors that
name a request's field, `n`'s limit, finish reasons, stream options and usage."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from webapp.errors import APIError

# The most completions one request may ask per prompt (`n`): each is a job of its own.
N_MAX = 16

# A job's finish reason as OpenAI says it.
FINISH = {"length": "length", "stop": "stop", "eos": "stop", "cancelled": "stop"}


def finish(reason: str | None) -> str | None:
    return FINISH.get(reason, "stop") if reason else None


def invalid(field: str, why: str) -> APIError:
    """400 `invalid_request` for the request's `field`: "field: why"."""
    return APIError(400, "invalid_request", f"{field}: {why}", param=field)


def unsupported(field: str, why: str = "is not supported") -> APIError:
    """400 `unsupported_parameter`: a field this server takes only at a value that changes nothing."""
    return APIError(400, "unsupported_parameter", f"{field} {why}", param=field)


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    include_usage: bool = False
    continuous_usage_stats: bool = Field(False, description="vLLM's; accepted, not used")


class PromptTokensDetails(BaseModel):
    cached_tokens: int = Field(0, description="prompt tokens served from the engine's prefix cache (not computed)")


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails = Field(
        default_factory=PromptTokensDetails, description="always present (cached_tokens 0 when nothing was cached)"
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

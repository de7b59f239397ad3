"""The limits a request's jobs are checked against before they are queued: this deployment's
(`check`) and its API key's (`for_key`), with errors that name the request's own fields
(OpenAI's `max_tokens`, the job API's `max_new_tokens`: `Jobs.max_tokens_field`), and its
key's rates (`admit`: the keys file's rpm= and tpm=, tasks/usage.py).
webapp.completions.CompletionService.submit applies them, and the model's context after them
(webapp/context.py)."""

from __future__ import annotations

from tasks.config import Settings
from tasks.schemas import SamplingParams
from tasks.usage import RPM, RateLimiter
from webapp.auth import ApiKey
from webapp.errors import APIError
from webapp.protocol.jobs import Jobs


def check(req: Jobs, prompts: list[str], settings: Settings) -> None:
    """The limits of this deployment's settings, not of the schema, on the request's jobs
    (`prompts`: each job's text)."""
    if req.params.max_new_tokens is not None and req.params.max_new_tokens > settings.max_new_tokens_limit:
        raise too_many_tokens(req, settings.max_new_tokens_limit)
    if len(prompts) > settings.max_queue_depth:
        # A 429 would tell the client to retry a request that can never fit.
        raise APIError(
            413,
            "too_many_prompts",
            f"{len(prompts)} prompts; at most {settings.max_queue_depth} jobs may wait "
            "for a model, so send at most that many per request",
            param="prompts",
        )
    for what, texts in (("prompt", prompts), ("stop", req.params.stop)):
        if any("\0" in t for t in texts):
            # Valid JSON, but C-string code on the way (tokenizers, engines) may cut there.
            raise APIError(400, "invalid_request", f"{what}: must not contain NUL (\\u0000)", param=what)
    longest = max((len(p) for p in prompts), default=0)
    if longest > settings.max_prompt_chars:
        raise APIError(
            400,
            "prompt_too_long",
            f"prompt: {longest} characters; the limit is {settings.max_prompt_chars}",
        )


def for_key(req: Jobs, prompts: list[str], key: ApiKey | None, settings: Settings) -> SamplingParams:
    """The jobs' params within an API key's own limits: its max_new_tokens ceiling (the
    default is kept under it too), and no more prompts per request than it may have jobs
    waiting (a 429 would tell the client to retry a request that can never fit)."""
    params = req.params
    if key is None:
        return params
    if key.max_queued is not None and len(prompts) > key.max_queued:
        raise APIError(
            413,
            "too_many_prompts",
            f"{len(prompts)} prompts; this API key may have at most {key.max_queued} jobs waiting",
            param="prompts",
        )
    ceiling = key.max_new_tokens
    if ceiling is not None and params.max_new_tokens is None:
        if settings.default_max_new_tokens > ceiling:
            return params.model_copy(update={"max_new_tokens": ceiling})
    elif ceiling is not None and params.max_new_tokens > ceiling:
        raise too_many_tokens(req, ceiling, " (this API key's limit)")
    return params


def too_many_tokens(req: Jobs, limit: int, whose: str = "") -> APIError:
    """400 for jobs that ask for more than `limit` new tokens, naming the request's field (a
    body of SamplingParams fields, /v1/jobs's, names it in the message alone, as it always has)."""
    name = req.max_tokens_name
    return APIError(400, "invalid_request", f"{name}: must be at most {limit}{whose}", param=req.max_tokens_field)


def admit(limiter: RateLimiter, key: ApiKey | None) -> None:
    """429 `rate_limit_exceeded` (OpenAI's code) with Retry-After, the seconds until the window
    frees, when the key has sent `rpm` requests in the last minute, or its jobs that ended in the
    last minute used `tpm` tokens (prompt and completion); else the request counts as one."""
    if key is None or (key.rpm is None and key.tpm is None):
        return
    seen = limiter.admit(key.name, key.rpm, key.tpm)
    if seen.refused is None:
        return
    if seen.refused == RPM:
        what = f"{seen.requests} requests in the last minute; its limit (rpm) is {key.rpm}"
    else:
        what = f"{seen.tokens} tokens in the last minute; its limit (tpm) is {key.tpm}"
    raise APIError(
        429,
        "rate_limit_exceeded",
        f"this API key used {what}; try again in {seen.retry_after} s",
        {"Retry-After": str(seen.retry_after)},
    )

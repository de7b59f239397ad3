"""One embeddings request (POST /v1/embeddings): checked against this deployment's limits
(GENQ_MAX_EMBED_INPUTS, GENQ_MAX_PROMPT_CHARS) and the model its live workers serve, then
queued as one job that carries all its inputs (JobSpec.embed) on the model's queue like any
other job (its record, its message, its result in the backend; recovered if its worker is
lost), and answered once it ends. The embed engine checks each input's tokens against the
model's limit (a 400 that names the input's index) and packs the inputs of every job it holds
into shared forwards (worker/engines/embed.py)."""

from __future__ import annotations

import time
from typing import Any

from flask import request

from tasks.schemas import EmbedOptions, SamplingParams
from webapp import idempotency, limits
from webapp.auth import ApiKey
from webapp.completions import CompletionService, current_completions
from webapp.errors import APIError
from webapp.protocol import embeddings
from webapp.protocol.embeddings import EmbeddingRequest
from webapp.protocol.jobs import Scheduling
from webapp.service import JobService


def check(req: EmbeddingRequest, s: JobService) -> None:
    """The deployment's limits on a request's inputs (the schema's are checked already)."""
    settings = s.settings
    if len(req.input) > settings.max_embed_inputs:
        raise APIError(
            400,
            "too_many_inputs",
            f"input: {len(req.input)} inputs; at most {settings.max_embed_inputs} per request (GENQ_MAX_EMBED_INPUTS)",
            param="input",
        )
    for i, t in enumerate(req.input):
        if isinstance(t, str) and len(t) > settings.max_prompt_chars:
            raise APIError(
                400,
                "prompt_too_long",
                f"input[{i}]: {len(t)} characters; the limit is {settings.max_prompt_chars}",
                param="input",
            )
        if isinstance(t, str) and "\0" in t:
            raise APIError(400, "invalid_request", f"input[{i}]: must not contain NUL (\\u0000)", param="input")


def check_model(req: EmbeddingRequest, s: JobService, model: str) -> None:
    """400 for what the model's live workers announce they cannot do: generate text only, or
    cut vectors to `dimensions` (the worker checks the same, should none be live)."""
    s.require_task(model, embed=True)
    if req.dimensions is None:
        return
    for w in s.workers_for(model):
        if w.embedding is not None:
            why = w.embedding.check(req.dimensions)
            if why is not None:
                raise APIError(400, "invalid_request", f"dimensions: {why}", param="dimensions")
            return


def submit(
    req: EmbeddingRequest,
    owner: ApiKey | None,
    completions: CompletionService,
    wait: bool = True,
    priority: int | None = None,
) -> dict[str, Any]:
    """Check the request and queue its one job through `completions`' job service (its rate
    limiter too); returns what its answer needs (`body`), as JSON: a batch line keeps it as its
    pending entry. `wait`: the caller blocks for the answer, so it fails at once with 503 when
    no live worker serves the model. `priority`: the job's, in place of the request's (a batch
    line's)."""
    s = completions.jobs
    check(req, s)
    model = s.resolve_model(req.model)
    if wait:
        s.require_worker(model)
    check_model(req, s, model)
    embed = EmbedOptions(inputs=req.input, dimensions=req.dimensions, truncate_prompt_tokens=req.truncate_prompt_tokens)
    sched = Scheduling(priority=req.priority if priority is None else priority)
    created = int(time.time())

    def create() -> dict[str, Any]:
        limits.admit(completions.rates, owner)  # last: a request refused for its input is not counted
        ids = s.enqueue([""], SamplingParams(), model, stream=False, sched=sched, owner=owner, embed=embed)
        return {"ids": ids, "model": model, "created": created}

    made, _ = idempotency.once(owner.name if owner else "", create)
    return {**made, "api": "embeddings", "encoding_format": req.encoding_format}


def body(entry: dict[str, Any], result: dict[str, Any]) -> dict[str, Any]:
    """The answer of a request (`entry`: what `submit` returned) from its job's result."""
    return embeddings.body(
        f"embd-{entry['ids'][0]}",
        int(entry["created"]),
        entry["model"],
        result["embeddings"],
        entry.get("encoding_format", "float"),
        result["prompt_tokens"],
    )


def answer(req: EmbeddingRequest, owner: ApiKey | None) -> dict[str, Any]:
    """Queue the request's job and answer with its vectors once it has ended. A client that
    goes away meanwhile has its job cancelled, unless it sent an Idempotency-Key (a retry
    takes the job up)."""
    keep = idempotency.header_key() is not None
    completions = current_completions()
    entry = submit(req, owner, completions)
    (result,) = completions.jobs.collect(entry["ids"], request.environ, abandon=not keep)
    return body(entry, result)

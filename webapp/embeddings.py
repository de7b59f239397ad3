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
from webapp.completions import current_completions
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


def answer(req: EmbeddingRequest, owner: ApiKey | None) -> dict[str, Any]:
    """Queue the request's job and answer with its vectors once it has ended."""
    completions = current_completions()
    s = completions.jobs
    keep = idempotency.header_key() is not None
    check(req, s)
    model = s.resolve_model(req.model)
    s.require_worker(model)
    check_model(req, s, model)
    embed = EmbedOptions(inputs=req.input, dimensions=req.dimensions, truncate_prompt_tokens=req.truncate_prompt_tokens)
    created = int(time.time())

    def create() -> dict[str, Any]:
        limits.admit(completions.rates, owner)  # last: a request refused for its input is not counted
        ids = s.enqueue(
            [""],
            SamplingParams(),
            model,
            stream=False,
            sched=Scheduling(priority=req.priority),
            owner=owner,
            embed=embed,
        )
        return {"ids": ids, "model": model, "created": created}

    made, _ = idempotency.once(owner.name if owner else "", create)
    (result,) = s.collect(made["ids"], request.environ, abandon=not keep)
    return embeddings.body(
        f"embd-{made['ids'][0]}",
        int(made["created"]),
        made["model"],
        result["embeddings"],
        req.encoding_format,
        result["prompt_tokens"],
    )

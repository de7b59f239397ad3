"""OpenAI-compatible endpoints: `POST /v1/completions` (plain and streamed) and
`GET /v1/models`. Every prompt of a request is its own job, like everywhere else."""

from __future__ import annotations

import time

from flask import Blueprint, request

from tasks.schemas import SamplingParams, Scheduling
from webapp import auth, protocol, sse
from webapp.errors import APIError, error_body, error_response, job_error_status
from webapp.openapi import BLOCKING_ERRORS, SSE, doc
from webapp.routes._body import parse
from webapp.service import current_service

bp = Blueprint("openai", __name__, url_prefix="/v1")


@bp.errorhandler(APIError)
def _named_as_requested(exc: APIError):
    """Errors name OpenAI's fields (`max_tokens`), not the job's (`max_new_tokens`)."""
    exc = protocol.named_as_requested(exc)
    return error_response(exc.status, exc.code, exc.message, exc.headers, exc.param)


@bp.get("/models")
@doc(response=protocol.ModelList, errors=(503,))
def models():
    """The models live workers serve."""
    seen: dict[str, protocol.ModelCard] = {}
    for w in current_service().live_workers(fresh=True):
        card = seen.setdefault(w.model, protocol.ModelCard(id=w.model, created=int(w.started), max_model_len=w.max_model_len))
        card.created = min(card.created, int(w.started))
    return protocol.ModelList(data=list(seen.values())).model_dump(mode="json")


@bp.post("/completions")
@doc(body=protocol.CompletionRequest, response=protocol.CompletionResponse,
     stream=SSE("with `stream`: OpenAI's completion chunks, then `[DONE]`"), errors=BLOCKING_ERRORS)
def completions():
    """OpenAI's completions: every prompt its own job."""
    service = current_service()
    req = parse(protocol.CompletionRequest)
    req.refuse_unsupported(n=True, logprobs=True)
    params = SamplingParams.model_validate(req.sampling())
    prompts, n = req.prompts, req.choices
    service.validate([p for p in prompts for _ in range(n)], params)
    model = service.resolve_model(req.model)
    service.require_worker(model)
    sched = Scheduling(priority=req.priority)
    # One job per choice: prompt i's j-th is job (and choice index) i * n + j.
    owner = auth.current_owner()
    ids = service.submit(prompts, params, model, stream=bool(req.stream), sched=sched, owner=owner, n=n)
    cmpl_id = f"cmpl-{ids[0]}"
    created = int(time.time())

    if not req.stream:
        results = service.collect(ids, request.environ)
        choices = [
            protocol.choice(k, (prompts[k // n] if req.echo else "") + r["text"], r["finish_reason"], r.get("logprobs"))
            for k, r in enumerate(results)
        ]
        total = protocol.usage(
            sum(r["prompt_tokens"] for r in results), sum(r["completion_tokens"] for r in results)
        )
        return protocol.completion(cmpl_id, model, choices, total, created)

    index = {job_id: i for i, job_id in enumerate(ids)}
    include_usage = bool(req.stream_options and req.stream_options.include_usage)

    def chunk(i: int, text: str, finish: str | None = None, logprobs: dict | None = None) -> str:
        choice = protocol.choice(i, text, finish, logprobs)
        return sse.event(protocol.completion(cmpl_id, model, [choice], created=created))

    counts = [0, 0]

    def token(job_id, ev):
        if ev.finish and ev.usage:
            counts[0] += ev.usage["prompt_tokens"]
            counts[1] += ev.usage["completion_tokens"]
        return chunk(index[job_id], ev.text, ev.finish, ev.logprobs)

    def end(_, ev):
        return sse.Last(sse.event(error_body(job_error_status(ev.error["code"]), **ev.error)))

    def restart(job_id, ev):
        # OpenAI's stream has no way to take text back; greedy and seeded jobs replay
        # without a seam (tasks/streams.py), a sampled one can only end here.
        message = f"choice {index[job_id]} started over on another worker; send the request again"
        return sse.Last(sse.event(error_body(502, "worker_lost", message)))

    def tail(complete: bool):
        if complete and include_usage:
            yield sse.event(protocol.completion(cmpl_id, model, [], protocol.usage(*counts), created))
        yield sse.event("[DONE]")

    head = [chunk(k, prompts[k // n]) for k in range(len(ids))] if req.echo else []
    return sse.relay(service.events(ids, cancel_on_exit=True), token, end, restart, head, tail)

"""OpenAI-compatible endpoints: `POST /v1/completions` (plain and streamed) and
`GET /v1/models`. Every prompt of a request is its own job, like everywhere else."""

from __future__ import annotations

import time

from flask import Blueprint, current_app

from tasks.schemas import SamplingParams
from tasks.streams import StreamEnd
from webapp import protocol, sse
from webapp.errors import error_body
from webapp.routes._body import parse

bp = Blueprint("openai", __name__, url_prefix="/v1")


@bp.get("/models")
def models():
    service = current_app.extensions["genq"]
    seen: dict[str, dict] = {}
    for w in service.live_workers(fresh=True):
        entry = seen.setdefault(
            w.model,
            {"id": w.model, "object": "model", "created": int(w.started), "owned_by": "genqueue",
             "max_model_len": w.max_model_len},
        )
        entry["created"] = min(entry["created"], int(w.started))
    return {"object": "list", "data": list(seen.values())}


@bp.post("/completions")
def completions():
    service = current_app.extensions["genq"]
    req = parse(protocol.CompletionRequest)
    req.refuse_unsupported()
    params = SamplingParams.model_validate(req.sampling())
    prompts = req.prompts
    service.validate(prompts, params)
    model = service.resolve_model(req.model)
    service.require_worker(model)
    ids = service.submit(prompts, params, model, stream=req.stream)
    cmpl_id = f"cmpl-{ids[0]}"
    created = int(time.time())

    if not req.stream:
        deadline = time.monotonic() + service.settings.max_wait
        results = [service.outcome(job_id, deadline) for job_id in ids]
        choices = [
            protocol.choice(i, (prompts[i] if req.echo else "") + r["text"], r["finish_reason"])
            for i, r in enumerate(results)
        ]
        total = protocol.usage(
            sum(r["prompt_tokens"] for r in results), sum(r["completion_tokens"] for r in results)
        )
        return protocol.completion(cmpl_id, model, choices, total, created)

    index = {job_id: i for i, job_id in enumerate(ids)}
    include_usage = bool(req.stream_options and req.stream_options.include_usage)

    def chunk(i: int, text: str, finish: str | None = None) -> str:
        return sse.event(protocol.completion(cmpl_id, model, [protocol.choice(i, text, finish)], created=created))

    def chunks():
        counts = [0, 0]
        if req.echo:
            for i, prompt in enumerate(prompts):
                yield chunk(i, prompt)
        for item in service.events(ids):
            if item is None:
                yield sse.KEEPALIVE
                continue
            job_id, ev = item
            if isinstance(ev, StreamEnd):
                status = 409 if ev.status == "cancelled" else 502
                yield sse.event(error_body(status, **ev.error))
                break
            yield chunk(index[job_id], ev.text, ev.finish)
            if ev.finish and ev.usage:
                counts[0] += ev.usage["prompt_tokens"]
                counts[1] += ev.usage["completion_tokens"]
        else:
            if include_usage:
                yield sse.event(protocol.completion(cmpl_id, model, [], protocol.usage(*counts), created))
        yield sse.event("[DONE]")

    return sse.response(chunks())

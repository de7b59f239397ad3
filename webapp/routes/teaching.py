"""The teaching server's endpoints, same JSON as before, now served through the job queue.

Each prompt becomes its own job, so the prompts of one call and of concurrent calls are
batched together by the worker. A call blocks (or streams) until its jobs have ended, and
fails at once with 503 when no worker serves the model.
"""

from __future__ import annotations

import time

from flask import Blueprint, current_app

from tasks.schemas import BasicGenerateRequest, GenerateRequest, SamplingParams
from tasks.streams import StreamEnd
from webapp import sse
from webapp.routes._body import parse

bp = Blueprint("teaching", __name__)


def _submit(prompts: list[str], req, engine: str | None = None, stream: bool = False) -> list[str]:
    service = current_app.extensions["genq"]
    params = SamplingParams.model_validate(req.model_dump(exclude={"prompt", "prompts"}))
    service.validate(prompts, params)
    model = service.model_for_engine(engine) if engine else service.resolve_model(None)
    if not prompts:
        return []
    service.require_worker(model)
    return service.submit(prompts, params, model, stream)


def _completions(ids: list[str]) -> list[str]:
    service = current_app.extensions["genq"]
    deadline = time.monotonic() + service.settings.max_wait
    return [service.outcome(job_id, deadline)["text"] for job_id in ids]


@bp.post("/basic_generate")
def basic_generate():
    req = parse(BasicGenerateRequest)
    (completion,) = _completions(_submit([req.prompt], req))
    return {"generated_text": req.prompt + completion}


@bp.post("/generate")
def generate():
    req = parse(GenerateRequest)
    completions = _completions(_submit(req.prompts, req))
    return {"generated_texts": [p + c for p, c in zip(req.prompts, completions)]}


@bp.post("/generate_vllm")
def generate_vllm():
    """Completions without their prompts, as vLLM returns them, from a vLLM worker."""
    req = parse(GenerateRequest)
    return {"generated_texts": _completions(_submit(req.prompts, req, engine="vllm"))}


@bp.post("/generate_stream")
def generate_stream():
    """One `data: {"token", "sequence_id"}` line per generated token."""
    req = parse(BasicGenerateRequest)
    (job_id,) = _submit([req.prompt], req, stream=True)
    service = current_app.extensions["genq"]

    def chunks():
        for item in service.events([job_id]):
            if item is None:
                yield sse.KEEPALIVE
                continue
            _, ev = item
            if isinstance(ev, StreamEnd):
                yield sse.event({"error": ev.error, "sequence_id": job_id})
            elif ev.text or not ev.finish:
                yield sse.event({"token": ev.text, "sequence_id": job_id})

    return sse.response(chunks())

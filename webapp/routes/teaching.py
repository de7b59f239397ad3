"""The teaching server's endpoints, same JSON as before, now served through the job queue.

Each prompt becomes its own job, so the prompts of one call and of concurrent calls are
batched together by the worker. The call blocks until every job has ended.
"""

from __future__ import annotations

import time

from flask import Blueprint, current_app

from tasks.schemas import BasicGenerateRequest, GenerateRequest, SamplingParams
from webapp.routes._body import parse

bp = Blueprint("teaching", __name__)


def _run(prompts: list[str], req) -> list[str]:
    service = current_app.extensions["genq"]
    params = SamplingParams.model_validate(req.model_dump(exclude={"prompt", "prompts"}))
    service.validate(prompts, params)
    if not prompts:
        return []
    model = service.resolve_model(None)
    service.require_worker(model)
    ids = service.submit(prompts, params, model)
    deadline = time.monotonic() + service.settings.max_wait
    return [service.outcome(job_id, deadline)["text"] for job_id in ids]


@bp.post("/basic_generate")
def basic_generate():
    req = parse(BasicGenerateRequest)
    (completion,) = _run([req.prompt], req)
    return {"generated_text": req.prompt + completion}


@bp.post("/generate")
def generate():
    req = parse(GenerateRequest)
    completions = _run(req.prompts, req)
    return {"generated_texts": [p + c for p, c in zip(req.prompts, completions)]}

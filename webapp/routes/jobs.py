"""The job API: submit, look up (optionally waiting), cancel."""

from __future__ import annotations

import math

from flask import Blueprint, current_app, request, url_for

from tasks.schemas import JobRequest, SamplingParams
from webapp.errors import APIError
from webapp.routes._body import parse

bp = Blueprint("jobs", __name__, url_prefix="/v1/jobs")


def _service():
    return current_app.extensions["genq"]


@bp.post("")
def create_job():
    req = parse(JobRequest)
    params = SamplingParams.model_validate(req.model_dump(exclude={"prompt", "model"}))
    (job_id,) = _service().submit([req.prompt], params, req.model)
    location = url_for("jobs.get_job", job_id=job_id)
    return {"id": job_id, "status": "queued"}, 202, {"Location": location}


@bp.get("/<job_id>")
def get_job(job_id: str):
    wait = _wait_arg()
    return _service().view(job_id, wait)


@bp.post("/<job_id>/cancel")
def cancel_job(job_id: str):
    return _service().cancel(job_id)


def _wait_arg() -> float:
    raw = request.args.get("wait")
    if raw is None:
        return 0.0
    limit = current_app.config["GENQ"].max_wait
    try:
        wait = float(raw)
    except ValueError:
        wait = math.nan
    if not (0 <= wait <= limit):
        raise APIError(400, "invalid_request", f"wait: a number of seconds from 0 to {limit}")
    return wait

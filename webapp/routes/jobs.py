"""The job API: submit, look up (optionally waiting), cancel."""

from __future__ import annotations

import math

from flask import Blueprint, current_app, request, url_for

from tasks.schemas import JobRequest, SamplingParams
from tasks.streams import StreamEnd
from webapp import sse
from webapp.errors import APIError, error_body
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


@bp.get("/<job_id>/stream")
def stream_job(job_id: str):
    """SSE: `token` events `{"index", "text"}`, then `done` `{"text", "finish_reason", "usage"}`
    or `error`. Event ids are token indexes; `Last-Event-ID` resumes after one."""
    service = _service()
    service.require_job(job_id)
    after = _last_event_id()

    def chunks():
        for item in service.events([job_id], {job_id: after}):
            if item is None:
                yield sse.KEEPALIVE
                continue
            _, ev = item
            if isinstance(ev, StreamEnd):
                yield sse.event(error_body(409 if ev.status == "cancelled" else 502, **ev.error), "error")
            elif ev.finish:
                done = {"text": ev.text, "finish_reason": ev.finish, "usage": ev.usage}
                yield sse.event(done, "done", ev.index)
            else:
                yield sse.event({"index": ev.index, "text": ev.text}, "token", ev.index)

    return sse.response(chunks())


def _last_event_id() -> int:
    raw = request.headers.get("Last-Event-ID", request.args.get("last_event_id"))
    if raw is None:
        return -1
    try:
        return int(raw)
    except ValueError:
        raise APIError(400, "invalid_request", "Last-Event-ID: an event id (a whole number)") from None


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

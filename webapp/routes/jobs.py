"""The job API: submit, look up (optionally waiting), cancel."""

from __future__ import annotations

import math

from flask import Blueprint, current_app, request, url_for

from tasks.streams import parse_event_id
from webapp import auth, sse
from webapp.completions import current_completions
from webapp.errors import APIError, error_body, job_error_status
from webapp.openapi import IDEMPOTENCY, SSE, SUBMIT_ERRORS, Param, doc
from webapp.protocol.common import cached_tokens
from webapp.protocol.jobs import JobCreated, JobRequest, Jobs, JobView
from webapp.routes._body import parse
from webapp.service import current_service

bp = Blueprint("jobs", __name__, url_prefix="/v1/jobs")


@bp.post("")
@doc(
    params=(IDEMPOTENCY,),
    body=JobRequest,
    status=202,
    response=JobCreated,
    errors=SUBMIT_ERRORS,
    headers={"Location": "the job's URL"},
)
def create_job():
    """Queue one job."""
    req = parse(JobRequest)
    jobs = Jobs.of(req, [req.prompt], {"prompt", "model"}, model=req.model, api="jobs", stream=True)
    (job_id,) = current_completions().submit(jobs, auth.current_owner(), wait=False).ids
    location = url_for("jobs.get_job", job_id=job_id)
    return JobCreated(id=job_id).model_dump(), 202, {"Location": location}


@bp.get("/<job_id>")
@doc(
    response=JobView,
    errors=(400, 404, 503),
    params=(
        Param(
            "wait",
            "query",
            {"type": "number", "minimum": 0},
            "wait up to this many seconds (at most GENQ_MAX_WAIT) for the job to end",
        ),
    ),
)
def get_job(job_id: str):
    """A job: its status, timings, and its result or error once it has ended."""
    wait = _wait_arg()
    return JobView.answer(current_service().view(job_id, wait, owner=auth.owner_name()))


RESTARTED = "the job started over on another worker: discard the text received so far"


@bp.get("/<job_id>/stream")
@doc(
    stream=SSE("`token` events, then `done` or `error`; `restart`", ("token", "done", "error", "restart")),
    errors=(400, 404, 503),
    params=(
        Param("Last-Event-ID", "header", {"type": "string"}, "resume after this event id (`k` or `attempt:k`)"),
        Param("last_event_id", "query", {"type": "string"}, "the same, for clients that cannot set headers"),
    ),
)
def stream_job(job_id: str):
    """A job's tokens as server-sent events.

    SSE: `token` events `{"index", "text"}`, then `done` `{"text", "finish_reason", "usage"}`
    (usage: `prompt_tokens`, `completion_tokens`, `cached_tokens`; both with `logprobs` for a
    job that asked for them) or `error`; `restart` when a job
    started over after its worker died with other tokens than those sent (the new attempt's
    follow from its first). Event ids are token indexes (`attempt:index` after
    a restart); `Last-Event-ID` resumes after one."""
    service = current_service()
    service.require_job(job_id, auth.owner_name())
    after = _last_event_id()

    def token(_, ev):
        # A job with `logprobs` has them in its events too: those of the event's tokens.
        lp = {"logprobs": ev.logprobs} if ev.logprobs else {}
        if ev.finish:
            # cached_tokens 0 when a worker from before the prefix cache sent none.
            usage = ev.usage and {**ev.usage, "cached_tokens": cached_tokens(ev.usage)}
            done = {"text": ev.text, "finish_reason": ev.finish, "usage": usage, **lp}
            return sse.event(done, "done", ev.event_id)
        return sse.event({"index": ev.index, "text": ev.text, **lp}, "token", ev.event_id)

    def end(_, ev):
        return sse.event(error_body(job_error_status(ev.error["code"]), **ev.error), "error")

    def restart(_, ev):
        return sse.event({"attempt": ev.attempt, "message": RESTARTED}, "restart")

    return sse.relay(service.events([job_id], {job_id: after}), token, end, restart)


def _last_event_id() -> str:
    raw = request.headers.get("Last-Event-ID", request.args.get("last_event_id"))
    if raw is None:
        return "-1"
    try:
        parse_event_id(raw)
    except ValueError:
        raise APIError(
            400, "invalid_request", "Last-Event-ID: an event id (`k` or `attempt:k`, whole numbers)"
        ) from None
    return raw


@bp.post("/<job_id>/cancel")
@doc(response=JobView, errors=(404, 409, 503))
def cancel_job(job_id: str):
    """Cancel a job that has not ended; it is returned as it is then."""
    return JobView.answer(current_service().cancel(job_id, auth.owner_name()))


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

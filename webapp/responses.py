"""OpenAI's Responses API over the job queue: a response is one chat job
(webapp/protocol/responses.py makes its chat request; CompletionService submits it), and a
stored response is a record in Redis beside its job (`genq:response:<id>`, for
GENQ_RESPONSE_TTL, owned by the API key that made it): its request, its input items, the
conversation before them (`previous_response_id`) and, once it has ended, its answer.

Nothing about a response lives in an API process: any API process answers GET, cancel, delete
and a stream's resume from the record and the job, and a background response lives through an
API restart, a worker's death and a Redis restart exactly as its job does.

A stream's events are a function of the job's token stream alone (`ResponseEvents`,
webapp/response_events.py), so a resumed stream (`starting_after`) replays the job's tokens
from the first and sends the events after the one named: no gap, no duplicate."""

from __future__ import annotations

import json
import logging
from functools import cached_property
from typing import Any

from flask import Response, current_app, request

from tasks import keys
from tasks.schemas import JobStatus
from webapp import sse
from webapp.auth import ApiKey
from webapp.completions import CompletionService, Submitted
from webapp.errors import BROKER_ERRORS, APIError, owned
from webapp.protocol import responses as proto
from webapp.protocol.chat import ChatCompletionRequest
from webapp.protocol.common import invalid
from webapp.response_events import STATUS, ResponseEvents, finished

log = logging.getLogger(__name__)

EXTENSION = "genq_responses"


def current_responses() -> ResponseService:
    return current_app.extensions[EXTENSION]


class ResponseService:
    """Creates, keeps and answers responses: one per API process (over its CompletionService)."""

    def __init__(self, completions: CompletionService):
        self.completions = completions

    @property
    def jobs(self):
        return self.completions.jobs

    @cached_property
    def ttl(self) -> int:
        return self.jobs.settings.response_ttl

    # -- records ---------------------------------------------------------------------------

    def save(self, rec: dict[str, Any]) -> None:
        self.jobs.r.set(keys.response(rec["id"]), json.dumps(rec), ex=self.ttl)

    def load(self, resp_id: str, owner: str | None, param: str | None = None) -> dict[str, Any]:
        """The record, or 404 (also for another key's: the same answer)."""
        raw = self.jobs.r.get(keys.response(resp_id)) if resp_id.startswith("resp_") else None
        rec = json.loads(raw) if raw else None
        try:
            return owned(rec, owner, "response", resp_id)
        except APIError as exc:
            exc.param = param
            raise

    def current(self, rec: dict[str, Any]) -> dict[str, Any]:
        """The response as it is now, from its job; an ended one's answer is kept in its record."""
        if rec.get("final"):
            return rec["final"]
        try:
            job = self.jobs.view(rec["job_id"])
        except APIError as exc:
            if exc.status != 404:
                raise
            job = {"status": JobStatus.failed.value, "error": {"code": "expired", "message": "its job has expired"}}
        status = job["status"]
        if status == JobStatus.succeeded.value and job.get("result"):
            obj = finished(rec, job["result"])
        elif status == JobStatus.succeeded.value:
            error = {"code": "expired", "message": "its result has expired"}
            obj = proto.response_object(rec, "failed", error=error)
        else:
            error = job.get("error") if STATUS[status] == "failed" else None
            error = {"code": error["code"], "message": error["message"]} if error else None
            obj = proto.response_object(rec, STATUS[status], error=error)
        if obj["status"] not in ("queued", "in_progress"):
            rec["final"] = obj
            if rec["store"]:
                self.keep(rec)
        return obj

    def ended(self, rec: dict[str, Any], obj: dict[str, Any]) -> None:
        """A stream saw the response end: kept at once, so that a GET right after the stream
        agrees with it (the job's record may still say running for a moment)."""
        if rec["store"] and not rec.get("final"):
            rec["final"] = obj
            try:
                self.keep(rec)
            except BROKER_ERRORS as exc:
                log.warning("could not keep the end of response %s: %s", rec["id"], exc)

    def keep(self, rec: dict[str, Any]) -> None:
        """Write the record again, for what is left of its TTL."""
        key = keys.response(rec["id"])
        left = self.jobs.r.ttl(key)
        if left and left > 0:
            self.jobs.r.set(key, json.dumps(rec), ex=left)

    # -- create ----------------------------------------------------------------------------

    def create(self, req: proto.ResponsesRequest, owner: ApiKey | None) -> dict[str, Any] | Response:
        req.check()
        items = req.input_items()
        messages = proto.to_messages(items)
        history: list[dict[str, Any]] = []
        if req.previous_response_id is not None:
            prev = self.load(req.previous_response_id, owner.name if owner else None, "previous_response_id")
            done = self.current(prev)
            if done["status"] in ("queued", "in_progress"):
                raise invalid("previous_response_id", f"{prev['id']} has not ended yet ({done['status']})")
            history = prev["history"] + prev["messages"] + proto.assistant_messages(done["output"])
        jobs = ChatCompletionRequest.model_validate(req.chat_body(history, messages)).to_jobs()
        jobs.stream = bool(req.stream or req.background)
        jobs.max_tokens_field = "max_output_tokens"
        sub = self.completions.submit(jobs, owner, wait=not req.background)
        echo = req.model_dump(
            include={
                "instructions",
                "max_output_tokens",
                "temperature",
                "top_p",
                "tools",
                "tool_choice",
                "parallel_tool_calls",
                "text",
                "reasoning",
                "previous_response_id",
                "metadata",
            }
        )
        rec: dict[str, Any] = {
            "id": "resp_" + sub.ids[0].replace("-", ""),
            "owner": owner.name if owner else "",
            "job_id": sub.ids[0],
            "model": sub.model,
            "created": sub.created,
            "background": bool(req.background),
            "store": req.store is not False,
            "streamed": jobs.stream,
            "request": echo,
            "input_items": items,
            "history": history,
            "messages": messages,
            "entry": sub.entry(),
        }
        if rec["store"]:
            self.save(rec)
        if req.stream:
            return self.stream(rec, sub, -1, cancel_on_exit=not req.background)
        if req.background:
            return proto.response_object(rec, "queued")
        (result,) = self.completions.results(sub, request.environ)
        obj = rec["final"] = finished(rec, result)
        if rec["store"]:
            self.save(rec)
        return obj

    # -- the other routes ------------------------------------------------------------------

    def cancel(self, rec: dict[str, Any]) -> dict[str, Any]:
        if not rec["background"]:
            raise APIError(400, "invalid_request", "only a background response can be cancelled")
        if not rec.get("final"):
            self.jobs.store.cancel(rec["job_id"])
        obj = self.current(rec)
        if obj["status"] != "cancelled":
            raise APIError(409, "already_final", f"response {rec['id']} is already {obj['status']}")
        return obj

    def delete(self, rec: dict[str, Any]) -> dict[str, Any]:
        if not rec.get("final"):
            self.jobs.abandon([rec["job_id"]])
        self.jobs.r.delete(keys.response(rec["id"]))
        return {"id": rec["id"], "object": "response", "deleted": True}

    def stream(self, rec: dict[str, Any], sub: Submitted | None, after: int, cancel_on_exit: bool = False) -> Response:
        """The response's events from the one after `after` (-1: all), while its job runs. For
        a job that has ended, `after` must name one of its events (400 past the end)."""
        if not rec["streamed"]:
            raise invalid("stream", f"{rec['id']} was created without stream or background: it has no events")
        sub = sub or Submitted.from_entry(rec["entry"])
        events = ResponseEvents(rec, sub, after, on_final=lambda obj: self.ended(rec, obj))
        job_ids = [rec["job_id"]]
        if after >= 0 and self.current(rec)["status"] not in ("queued", "in_progress"):
            frames = events.replay(self.jobs.events(job_ids))
            if after >= events.seq - 1:
                raise invalid("starting_after", f"past the end: the stream's last sequence_number is {events.seq - 1}")
            return sse.response(frames)
        live = self.jobs.events(job_ids, cancel_on_exit=cancel_on_exit)
        return sse.relay(live, events.token, events.end, events.restart, events.head(), comments=False)

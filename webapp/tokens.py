"""`/tokenize` and `/detokenize`, and the count of a prompt's tokens at submit
(webapp/completions.py), answered by a worker of the model, which holds its tokenizer and chat
template (the API never loads either): the question goes onto the model's ask list, which
workers answer on threads of their own, never behind their jobs (worker/asks.py), or, where no
live worker announces that it answers asks (older workers), onto the model's queue as a
`genq.tokenize` task ahead of its jobs; either way the worker pushes its answer onto a reply
list that the request pops (tasks/keys.py `reply`)."""

from __future__ import annotations

import json
import time
import uuid

from tasks import keys
from tasks.celery_app import TOKENIZE_TASK, broker_priority
from tasks.config import queue_for
from tasks.schemas import PRIORITY_MIN
from webapp.errors import BROKER_ERRORS, BROKER_RETRY_AFTER, BROKER_UNAVAILABLE, APIError, job_error_status
from webapp.service import JobService

# How long a request waits for a worker's answer, and each blocking pop of it.
ANSWER_WAIT_S = 30.0
POP_S = 2.0


def ask(service: JobService, model: str | None, req: dict) -> dict:
    """A worker's answer to `req` (`op`: tokenize, detokenize or count); 503 at once when no
    worker serves the model, 504 when none answered in time."""
    model = service.resolve_model(model)
    service.require_worker(model)
    request_id = str(uuid.uuid4())
    deadline = time.time() + ANSWER_WAIT_S
    queue = queue_for(model)
    try:
        if any(w.answers_asks for w in service.workers_for(model)):
            pipe = service.r.pipeline()
            pipe.rpush(keys.asks(queue), json.dumps({**req, "id": request_id, "deadline": deadline}))
            pipe.expire(keys.asks(queue), int(ANSWER_WAIT_S))  # nobody left to pop it: gone with its waiters
            pipe.execute()
        else:
            service.celery.send_task(
                TOKENIZE_TASK,
                args=[{**req, "id": request_id}],
                task_id=request_id,
                queue=queue,
                priority=broker_priority(PRIORITY_MIN),
                expires=ANSWER_WAIT_S,
                argsrepr=f"{req['op']} {request_id}",
            )
        blocking = getattr(service, "blocking", service.r)
        while time.time() < deadline:
            got = blocking.blpop([keys.reply(request_id)], timeout=POP_S)
            if got is not None:
                answer = json.loads(got[1])
                break
        else:
            raise APIError(504, "timeout", f"no worker of {model!r} answered within {ANSWER_WAIT_S:g} s")
    except BROKER_ERRORS as exc:
        raise APIError(503, **BROKER_UNAVAILABLE, headers=BROKER_RETRY_AFTER) from exc
    if "error" in answer:
        error = answer["error"]
        raise APIError(job_error_status(error["code"]), error["code"], error["message"])
    return answer

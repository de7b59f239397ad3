"""The floor of the design: the textbook Flask + Celery app, with none of genqueue in it.

`POST /v1/completions` parses the JSON body, sends a Celery task (`floor.echo`: the prompt's
last `max_tokens` words, as genqueue's echo engine answers) and blocks on its result with
`AsyncResult.get`, Celery's own way (the Redis backend's pub/sub); the worker is a plain
Celery worker of the same kind as genqueue's (threads pool, `acks_late`, prefetch 1, Redis
broker and result backend). No job records, priorities, quotas, deadlines, recovery, token
streams, metrics or log lines: what is left is what gunicorn + Flask + Celery + Redis cost
per request. `python -m bench.frontend --floor` measures it beside genqueue's echo stack; with
FLOOR_HTTP_ONLY=1 the route answers by itself (no Celery, no Redis): what gunicorn and Flask
alone cost.

API: `gunicorn --config python:bench.floor_gunicorn bench.floor_app:app` (genqueue's gunicorn
settings without its hooks; port from GENQ_PORT). Worker: `celery -A bench.floor_app:celery
worker -P threads`. Both read REDIS_URL.
"""

from __future__ import annotations

import os

from celery import Celery
from flask import Flask, jsonify, request

_url = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0")

celery = Celery("floor", broker=_url, backend=_url)
celery.conf.update(
    task_acks_late=True,
    task_reject_on_worker_lost=True,
    worker_prefetch_multiplier=1,
    task_serializer="json",
    result_serializer="json",
    accept_content=["json"],
    result_expires=600,
    broker_transport_options={"visibility_timeout": 1200},
    worker_hijack_root_logger=False,
    worker_disable_rate_limits=True,
)


@celery.task(name="floor.echo")
def echo(prompt: str, max_tokens: int) -> dict:
    words = prompt.split()[-max_tokens:]
    return {"text": "".join(" " + w for w in words), "completion_tokens": len(words)}


app = Flask(__name__)


# FLOOR_HTTP_ONLY=1: the route answers by itself (no Celery, no Redis): the HTTP floor.
_HTTP_ONLY = bool(os.environ.get("FLOOR_HTTP_ONLY"))


@app.post("/v1/completions")
def completions():
    body = request.get_json()
    args = (body["prompt"], int(body.get("max_tokens", 16)))
    out = echo(*args) if _HTTP_ONLY else echo.apply_async(args).get(timeout=60)
    return jsonify({
        "object": "text_completion",
        "model": body.get("model"),
        "choices": [{"index": 0, "text": out["text"], "finish_reason": "length"}],
        "usage": {"completion_tokens": out["completion_tokens"]},
    })  # fmt: skip


@app.get("/healthz")
def healthz():
    return jsonify({"status": "ok"})

"""Liveness and readiness."""

from __future__ import annotations

import redis
from flask import Blueprint, current_app

from webapp.errors import error_response

bp = Blueprint("health", __name__)


@bp.get("/healthz")
def healthz():
    return {"status": "ok"}


@bp.get("/readyz")
def readyz():
    service = current_app.extensions["genq"]
    model = service.settings.served_model
    try:
        workers = service.workers_for(model)
    except redis.RedisError as exc:
        return error_response(503, "redis_unavailable", f"Redis does not answer: {exc}")
    if not workers:
        return error_response(503, "not_ready", f"no live worker with a loaded model serves {model!r}")
    return {
        "status": "ready",
        "model": model,
        "workers": [w.model_dump(include={"name", "engine", "capacity", "host"}) for w in workers],
    }

"""The HTTP API: validation, job records, routes. It never imports torch, transformers or vllm."""

from __future__ import annotations

import redis
from flask import Flask

from tasks.celery_app import make_celery
from tasks.config import Settings, get_settings
from webapp import errors
from webapp.routes import health, jobs, openai, teaching
from webapp.service import JobService


def create_app(settings: Settings | None = None) -> Flask:
    settings = settings or get_settings()
    app = Flask(__name__)
    app.config["GENQ"] = settings
    app.config["MAX_CONTENT_LENGTH"] = settings.max_body_bytes
    app.json.sort_keys = False

    # One connection per open request at most: a blocked wait or stream holds one.
    client = redis.Redis.from_url(
        settings.redis_url,
        decode_responses=True,
        health_check_interval=30,
        max_connections=settings.api_connections + 32,
    )
    app.extensions["genq"] = JobService(settings, client, make_celery(settings))

    errors.register(app)
    for bp in (health.bp, jobs.bp, teaching.bp, openai.bp):
        app.register_blueprint(bp)
    return app

"""The HTTP API: validation, job records, routes. It never imports torch, transformers or vllm."""

from __future__ import annotations

import redis
from flask import Flask
from redis.backoff import NoBackoff
from redis.retry import Retry

from tasks import redis_conn
from tasks.celery_app import BLOCKING_SOCKET_TIMEOUT_S, SENDER_CONNECT_TIMEOUT_S, SENDER_SOCKET_TIMEOUT_S, make_sender
from tasks.config import Settings, get_settings
from webapp import auth, batches, callbacks, completions, errors, idempotency, ids, metrics, openapi, responses
from webapp.bodyguard import BodyGuard
from webapp.routes import batches as batch_routes
from webapp.routes import health, jobs, openai, teaching, tokens, usage
from webapp.routes import messages as message_routes
from webapp.routes import responses as response_routes
from webapp.service import EXTENSION, JobService


def create_app(settings: Settings | None = None) -> Flask:
    settings = settings or get_settings()
    app = Flask(__name__)
    app.config["GENQ"] = settings
    app.config["MAX_CONTENT_LENGTH"] = settings.max_body_bytes
    app.json.sort_keys = False

    # One connection per open request at most: a blocked wait or stream holds one. While Redis
    # is down or frozen a call fails within a second (the route answers 503 at once): a short
    # socket timeout, and one retry for a refused or reset connection only (a pooled one that
    # went stale when Redis restarted), none for a timeout (redis-py's default retries ten
    # times). The blocking reads (XREAD BLOCK: tasks.jobs.MAX_BLOCK_S, tasks.streams.BLOCK_S)
    # go through a client of their own, whose socket timeout stays above the longest block.
    # Both reconnect by themselves once Redis is back.
    def redis_client(socket_timeout: float) -> redis.Redis:
        return redis_conn.client(  # REDIS_URL, or the master the sentinels name (GENQ_REDIS_SENTINELS)
            settings,
            decode_responses=True,
            health_check_interval=30,
            max_connections=settings.api_connections + 32,
            socket_connect_timeout=SENDER_CONNECT_TIMEOUT_S,
            socket_timeout=socket_timeout,
            retry=Retry(NoBackoff(), 1, supported_errors=(redis.ConnectionError,)),
        )

    client, blocking = redis_client(SENDER_SOCKET_TIMEOUT_S), redis_client(BLOCKING_SOCKET_TIMEOUT_S)
    app.extensions[EXTENSION] = service = JobService(settings, client, make_sender(settings), blocking)
    app.extensions[completions.EXTENSION] = answers = completions.CompletionService(service)
    app.extensions[responses.EXTENSION] = responses.ResponseService(answers)
    app.extensions[callbacks.EXTENSION] = callbacks.CallbackDeliverer(service, settings)
    idempotency.init_app(app, client)

    errors.register(app)
    metrics.init_app(app, settings)
    auth.init_app(app, settings)
    ids.init_app(app)  # after auth: its 401 comes first
    openapi.init_app(app)
    batches.init_app(app, settings)
    for bp in (
        health.bp,
        jobs.bp,
        teaching.bp,
        openai.bp,
        tokens.bp,
        batch_routes.bp,
        usage.bp,
        response_routes.bp,
        message_routes.bp,
    ):
        app.register_blueprint(bp)
    # No client holds the API by sending its bodies slowly (webapp/bodyguard.py).
    app.wsgi_app = BodyGuard(app.wsgi_app, settings.body_timeout, settings.max_bodies_per_client)
    return app

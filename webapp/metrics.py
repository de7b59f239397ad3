"""The API's Prometheus metrics at `/metrics` (added up over gunicorn's processes), and the log
line and queued-at header of every job it queues. What is counted where, and why:
docs/design.md, "API metrics"; the metrics themselves: docs/operations.md, "Observability"."""

from __future__ import annotations

import collections
import logging
import os
import time

from celery.signals import after_task_publish, before_task_publish
from flask import Flask, Response, g, request

from tasks.celery_app import GENERATE_TASK
from tasks.config import Settings, queue_for
from tasks.logs import job_event
from tasks.usage import read_usage
from webapp.errors import BROKER_ERRORS
from webapp.openapi import doc
from webapp.service import EXTENSION

log = logging.getLogger(__name__)

# The API's request latency: from milliseconds (a job's record) to GENQ_MAX_WAIT (blocking calls).
LATENCY_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
    120.0,
    300.0,
)

# Read from Redis at scrape time, not counted: (name, help).
WORKERS_LIVE = ("genq:workers_live", "Live workers with a loaded model, per model and engine.")
WAITING = ("genq:num_requests_waiting", "Jobs waiting in a model's queue (priority sub-queues included).")
# Counted by the workers as jobs end, per API key and model (tasks/usage.py), read when scraped.
KEY_TOKENS = ("genq:key_tokens", "Tokens of ended jobs per API key and model, by kind (prompt, completion, cached).")
KEY_JOBS = ("genq:key_jobs", "Ended jobs whose tokens were counted, per API key and model.")


class ApiMetrics:
    """The API's counters. Built (and prometheus_client imported) only in the app factory, i.e.
    in each gunicorn worker, after gunicorn_conf.py has chosen the multiprocess mode: a metric
    built earlier would keep single-process values."""

    def __init__(self, registry=None):
        from prometheus_client import REGISTRY, Counter, Gauge, Histogram

        registry = registry or REGISTRY
        self.requests = Counter(
            "genq:api_requests",
            "HTTP requests by route, method and status.",
            ["route", "method", "status"],
            registry=registry,
        )
        self.latency = Histogram(
            "genq:api_request_duration_seconds",
            "Seconds from a request's arrival to its response (a stream: until it opens), by route and method.",
            ["route", "method"],
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self.submitted = Counter("genq:api_jobs_submitted", "Jobs queued.", ["model_name"], registry=registry)
        self.rejected = Counter(
            "genq:api_jobs_rejected",
            "Job submissions refused: 429 (queue full, quota) or 503 (no worker, Redis away), by the error's code.",
            ["status", "reason"],
            registry=registry,
        )
        self.counted = Counter(
            "genq:api_prompts_counted",
            "Requests whose prompt tokens a worker counted before they were queued (their bound did not "
            "surely fit the model's context, or had none), per model.",
            ["model_name"],
            registry=registry,
        )
        self.open_streams = Gauge(
            "genq:api_open_streams", "Token streams being sent (SSE).", multiprocess_mode="livesum", registry=registry
        )


_m: ApiMetrics | None = None


def prompts_counted(model: str) -> None:
    """A request's prompts (or conversation) go to a worker to be counted (webapp/completions.py)."""
    if _m is not None:
        _m.counted.labels(model).inc()


def _stamp(sender=None, headers=None, **_) -> None:
    if sender == GENERATE_TASK and headers is not None:
        headers["genq_created"] = time.time()


def _queued(sender=None, body=None, **_) -> None:
    if sender != GENERATE_TASK:
        return
    try:
        spec = body[0][0]  # protocol 2: (args, kwargs, embed); args = [the job spec]
        job_id, model = spec["id"], spec["model"]
    except (TypeError, LookupError):
        return
    job_event("queued", job_id, model=model, owner=spec.get("owner"))
    if _m is not None:
        _m.submitted.labels(model).inc()


class _FromRedis:
    """Live workers and queue depths, read when scraped."""

    def __init__(self, service):
        self.service = service

    def collect(self):
        from prometheus_client.core import GaugeMetricFamily

        workers = self.service.live_workers(fresh=True)
        live = GaugeMetricFamily(*WORKERS_LIVE, labels=["model_name", "engine"])
        for (model, engine), n in sorted(collections.Counter((w.model, w.engine) for w in workers).items()):
            live.add_metric([model, engine], n)
        waiting = GaugeMetricFamily(*WAITING, labels=["model_name"])
        for model in sorted({w.model for w in workers} | {self.service.settings.served_model}):
            waiting.add_metric([model], self.service.store.depth(queue_for(model)))
        return [live, waiting, *self._usage()]

    def _usage(self):
        from prometheus_client.core import CounterMetricFamily

        tokens = CounterMetricFamily(*KEY_TOKENS, labels=["key", "model_name", "kind"])
        jobs = CounterMetricFamily(*KEY_JOBS, labels=["key", "model_name"])
        for u in read_usage(self.service.r):
            jobs.add_metric([u.key, u.model], u.jobs)
            for kind in ("prompt", "completion", "cached"):
                tokens.add_metric([u.key, u.model, kind], getattr(u, f"{kind}_tokens"))
        return [tokens, jobs]


# `/metrics` needs no key, and every label value is a series it serves for good: each label takes
# its values from a fixed set, never from what a client sends. Routes by their rule (not the
# path), methods outside these as "other", statuses as the API sent them (it makes them all).
METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})


def method_label(method: str) -> str:
    return method if method in METHODS else "other"


def _arrived() -> None:
    g.genq_arrived = time.perf_counter()


def _record(response: Response) -> Response:
    rule = request.url_rule
    status = response.status_code
    arrived = g.pop("genq_arrived", None)
    if arrived is not None:
        _m.latency.labels(rule.rule if rule else "unmatched", method_label(request.method)).observe(
            time.perf_counter() - arrived
        )
    _m.requests.labels(rule.rule if rule else "unmatched", method_label(request.method), str(status)).inc()
    if status in (429, 503) and request.method == "POST":
        body = response.get_json(silent=True) or {}
        reason = (body.get("error") or {}).get("code", "") if isinstance(body, dict) else ""
        _m.rejected.labels(str(status), reason).inc()
    if response.is_streamed and response.mimetype == "text/event-stream":
        _m.open_streams.inc()
        response.call_on_close(_m.open_streams.dec)
    return response


def init_app(app: Flask, settings: Settings) -> None:
    global _m
    before_task_publish.connect(_stamp, weak=False, dispatch_uid="genq-created")
    after_task_publish.connect(_queued, weak=False, dispatch_uid="genq-queued")
    if not settings.api_metrics:
        return
    from prometheus_client import REGISTRY, CollectorRegistry, generate_latest
    from prometheus_client.exposition import CONTENT_TYPE_LATEST

    if _m is None:  # once per process, however many apps it builds
        _m = ApiMetrics()
    scraped = CollectorRegistry(auto_describe=False)
    scraped.register(_FromRedis(app.extensions[EXTENSION]))
    app.before_request(_arrived)
    app.after_request(_record)

    @app.get("/metrics")
    @doc(media_type="text/plain", tag="health")
    def metrics():
        """Prometheus metrics of the API (and live workers and queue depths from Redis)."""
        if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
            from prometheus_client import multiprocess

            counted = CollectorRegistry()
            multiprocess.MultiProcessCollector(counted)
        else:
            counted = REGISTRY
        body = generate_latest(counted)
        try:
            body += generate_latest(scraped)
        except BROKER_ERRORS as exc:
            log.warning("/metrics without live workers and queue depths: Redis: %s", exc)
        return Response(body, content_type=CONTENT_TYPE_LATEST)
